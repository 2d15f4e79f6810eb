// The nccl transport: our ring schedule over NCCL send/recv (message passing, for ranks that cannot
// map each other's memory). Each step is ncclGroupStart; ncclSend; ncclRecv; ncclGroupEnd into a
// staging buffer on the caller's stream, then our reduce kernel. NCCL is the libnccl.so.2 the process
// already has (torch's), opened with dlopen: no second copy, no link flags. Torch-free.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "host/peers.h"
#include "ring/call.h"

struct ncclComm;

namespace ringreduce::cuda::nccl {

// Staging per buffer (two alternate): chunks larger than this go through the ring in pieces.
// 16 MiB keeps NCCL's transfers far above its per-call latency (a few us, i.e. ~1 MB at
// NVLink speed) while costing 32 MiB per communicator.
constexpr size_t kDefaultStagingBytes = 16 << 20;
// How often the watchdog looks at the oldest call in flight and at NCCL's async error.
constexpr auto kWatchPeriod = std::chrono::milliseconds(100);

// NCCL's version as ncclGetVersion reports it (e.g. 23007); loads the library on first use.
// lib: a path to try when no libnccl.so.2 is loaded yet ("" for the default search).
int version(const std::string& lib);
// A new ncclUniqueId, as bytes for the store.
std::string unique_id(const std::string& lib);

struct Options {
  int rank = 0;
  int nranks = 1;
  double timeout_s = 300.0;  // RINGREDUCE_TIMEOUT: setup, each NCCL call, and each collective
  size_t staging_bytes = kDefaultStagingBytes;
  std::string lib;
};

class Ring {
 public:
  // Collective over the group (every rank with the same id); on the current device.
  Ring(const Options& opt, const std::string& id);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // Enqueues one collective on stream. Throws RingError when the ring is broken or NCCL fails, and
  // when stream is capturing a CUDA graph (not capture-safe: see run()).
  void run(const Call& c, cudaStream_t stream);
  // The first failure (the watchdog's timeout, NCCL's async error, a CUDA error, a dead peer), or "".
  std::string failure();
  bool broken() { return !failure().empty(); }
  // The op_seq of the first call that failed, or 0 (see p2p::Ring::failed_seq).
  uint64_t failed_seq() const { return failed_seq_; }
  // Looks at NCCL's asynchronous error now (the watchdog does every period): a call whose event
  // has completed may still have failed inside NCCL (e.g. a truncated message).
  void poll();
  void abort(const std::string& why);
  // The watchdog also checks these peers' processes; a dead one fails and aborts the communicator.
  void watch_peers(std::vector<host::Peer> peers);
  // Finalizes (or aborts, when broken) the NCCL communicator; frees the staging. Idempotent. The
  // caller's stream must be idle.
  void close();
  bool closed() const { return closed_; }
  uint64_t op_seq() const { return op_seq_; }

 private:
  struct Pending {
    cudaEvent_t done;
    uint64_t seq;
    std::chrono::steady_clock::time_point enqueued;
  };
  void group(const void* sbuf, size_t sbytes, void* rbuf, size_t rbytes, cudaStream_t stream);
  void settle(const char* what);  // non-blocking NCCL: wait until the last call is done, bounded
  void nccl_check(int res, const char* what);
  void fail_locked(const std::string& why);  // mu_ held: abort the NCCL communicator, record why
  // Records the first failure; seq: the first call it spoils (0: the oldest call not finished).
  void set_failure(const std::string& why, uint64_t seq = 0);
  uint64_t first_unfinished();  // qmu_ not held
  void watch();
  std::string async_error_locked();  // mu_ held: NCCL's async error as a message, or ""

  Options opt_;
  int device_ = 0;
  int up_ = 0, down_ = 0;
  ncclComm* comm_ = nullptr;
  char* staging_[2] = {nullptr, nullptr};
  std::atomic<uint64_t> op_seq_{0};
  std::atomic<bool> in_call_{false};  // run() is enqueueing call op_seq_
  bool closed_ = false;

  std::mutex mu_;  // NCCL calls on comm_
  std::atomic<bool> abort_requested_{false};
  std::mutex fmu_;  // failure_, peers_
  std::string failure_;
  std::atomic<uint64_t> failed_seq_{0};
  std::vector<host::Peer> peers_;
  std::mutex qmu_;  // inflight_, stop_
  std::condition_variable qcv_;
  std::deque<Pending> inflight_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace ringreduce::cuda::nccl
