// The nccl transport: our schedules over NCCL send/recv (message passing, for ranks that cannot
// map each other's memory), on the caller's stream. Each NCCL group costs a host round trip (a
// non-blocking ncclGroupEnd must settle before the next call), so by size (plan()):
// - one-shot (small all_reduce): one group sends the whole input to every peer, then one launch
//   folds the N inputs in rank order ((x0 op x1) op x2 ..., in the compute type, rounded once): 1
//   group instead of the ring's 2(N-1);
// - two-shot (middle sizes): reduce-scatter as one group (chunk q to rank q) + the same fold,
//   all-gather as one group: 2 groups, the ring's bytes;
// - ring (large): step s is ncclGroupStart; ncclSend; ncclRecv; ncclGroupEnd into a staging buffer,
//   then our reduce kernel; one flow per rank, to its neighbour.
// NCCL is the libnccl.so.2 the process already has (torch's), opened with dlopen: no second copy, no
// link flags. Torch-free.
// Deterministic mode (ringreduce::deterministic()): all_reduce and reduce_scatter run one-shot or
// two-shot only, whose fold gives the bits of the rank-order reduction at every size and slicing.
// Mismatched calls: each call starts with a group of its own that exchanges a 32-byte call
// descriptor (Desc) with every peer, whatever the algorithm, so that it completes even where the
// calls' data groups block each other (one more group round trip per call: one-shot's 1 group is
// 2, two-shot's 2 are 3, the ring's 2(N-1) are 2N-1). A difference fails the call on every rank, which then
// aborts; an NCCL error or a timeout of a call whose descriptors differ is reported as the
// mismatch. NCCL alone failed only the rank whose receive it truncated.
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

#include "runtime/peers.h"
#include "cuda/call_log.h"
#include "cuda/nccl/defaults.h"
#include "ring/call.h"
#include "runtime/transport.h"

struct ncclComm;

namespace ringreduce::cuda::nccl {

// The direct algorithms (one-shot, two-shot) receive N-1 pieces into both staging buffers as one
// region of 2 x staging_bytes, each piece at a multiple of this (the kernels' widest load).
constexpr size_t kSlotAlign = 16;
// Two-shot up to here (bytes of the full tensor), the ring above. Both move 2(N-1)/N of the tensor
// per rank; two-shot saves 2(N-1) - 2 group round trips (~10-20 us each: ncclGroupEnd settling plus
// NCCL's p2p latency), which matter up to about this size at network speed (16 MiB x 2 x 7/8 at
// 25 GB/s ~ 1.2 ms against ~0.2 ms of round trips at N = 8); above it the ring's one flow per rank
// to its neighbour is what links between hosts carry best. A model, not yet
// measured on GPUs.
constexpr size_t kTwoShotMaxBytes = 16 << 20;

using ringreduce::Algo;  // the shared names (ring/call.h); this transport runs Auto to TwoShot
using ringreduce::algo_name;

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
  // Test knob: force an algorithm (Auto: by size). Where impossible it falls back: one-shot of a
  // reduce-scatter or an all-gather, or one whose N-1 inputs do not fit the staging, to two-shot;
  // two-shot whose pieces would be under one element (tiny staging, many ranks) to the ring.
  // Deterministic mode: a forced ring runs as Auto, and Auto never picks the ring.
  Algo algo = Algo::Auto;
};

// One-shot up to here (bytes of the full tensor): it sends (N-1) x size per rank against
// two-shot's 2(N-1)/N x size and saves one group round trip (alpha ~10 us); worth it while the
// extra bytes, (N-1)(N-2)/N x size, take less than alpha at network speed (25 GB/s). Rounded down
// to a power of two, at most 1 MiB (N = 2: no extra bytes). From this model, not from GPU timings.
size_t oneshot_max_bytes(int nranks);
// The algorithm of call c: the same on every rank for the same call (and the same options, and
// deterministic mode). In deterministic mode an all_reduce or reduce_scatter gets one-shot or
// two-shot, never the ring; where two-shot's pieces would be under one element (staging under
// 8 x (N-1) bytes) it throws RingError saying so, where the default mode falls back to the ring.
Algo plan(const Call& c, const Options& o);

class Endpoint : public runtime::Transport {
 public:
  // Collective over the group (every rank with the same id); on the current device.
  Endpoint(const Options& opt, const std::string& id);
  ~Endpoint() override;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // Enqueues one collective on stream. Throws RingError when the ring is broken or NCCL fails, and
  // when stream is capturing a CUDA graph (not capture-safe: see run()).
  void run(const Call& c, cudaStream_t stream);

  // runtime::Transport
  const char* name() const override { return "nccl"; }
  runtime::Caps caps() const override;
  int nranks() const override { return opt_.nranks; }
  Algo plan(const Call& c) override { return nccl::plan(c, opt_); }
  void run(const Call& c, void* stream) override { run(c, static_cast<cudaStream_t>(stream)); }
  int call_state(uint64_t seq, int64_t* done_ns) override {
    return static_cast<int>(calls_.state(seq, done_ns));
  }
  void log_calls(bool on) override { calls_.enable(on); }
  void close(bool /*peers_done*/) override { close(); }
  // The first failure (the watchdog's timeout, NCCL's async error, a CUDA error, a dead peer), or "".
  std::string failure() override;
  bool broken() { return !failure().empty(); }
  // The op_seq of the first call that failed, or 0 (see p2p::Endpoint::failed_seq).
  uint64_t failed_seq() override { return failed_seq_; }
  // Looks at NCCL's asynchronous error now (the watchdog does every period): a call whose event
  // has completed may still have failed inside NCCL (e.g. a truncated message).
  void poll() override;
  void abort(const std::string& why) override;
  // The watchdog also checks these peers' processes; a dead one fails and aborts the communicator.
  void watch_peers(std::vector<runtime::Peer> peers) override;
  // Stops the watchdog thread, nothing else (no NCCL or CUDA call): for a ring left to the
  // process's exit while the interpreter finalizes.
  void stop_threads() override;
  // Finalizes (or aborts, when broken) the NCCL communicator; frees the staging. Idempotent. The
  // caller's stream must be idle.
  void close();
  bool closed() const override { return closed_; }
  uint64_t op_seq() const override { return op_seq_; }
  // Which calls have finished on the device (the flight recorder reads it without blocking).
  CallLog& calls() { return calls_; }

 private:
  // A call's descriptor. NCCL does not fail every rank of a mismatched call (over sockets, on the
  // first H200 run, only the rank whose receive was truncated failed; the sender's call succeeded),
  // so each call's first group also sends this to the peers it sends to and receives theirs; the
  // host compares them as soon as they are copied back (Pending::descs), before the data has moved.
  struct Desc {
    uint64_t op_seq;
    int64_t numel;
    uint8_t coll, dtype, op, algo;
    uint32_t magic;
    uint64_t pad;
  };
  struct DescSlot {
    char* dev;   // nranks descriptors: this rank's at its rank, the peers' received at theirs
    Desc* host;  // pinned: this rank's (the copy's source), then all of them copied back
  };
  struct Pending {
    cudaEvent_t done;
    uint64_t seq;
    std::chrono::steady_clock::time_point enqueued;
    std::chrono::steady_clock::time_point seen_done{};  // when its event was first seen complete
    int slot = -1;                 // its DescSlot
    cudaEvent_t descs = nullptr;   // the peers' descriptors are in the slot's host copy
    std::vector<int> from;         // the peers whose descriptors it received
    bool checked = false;
  };
  struct P2p {  // one ncclSend (send) or ncclRecv of a group
    bool send;
    const void* buf;
    size_t bytes;
    int peer;
  };
  // One group of sends and receives on stream, settled (enqueued) before it returns; the call's
  // first is preceded by the descriptor group.
  void group(const std::vector<P2p>& ops, cudaStream_t stream);
  void post(const std::vector<P2p>& ops, cudaStream_t stream, const char* what);  // one group
  // The ring's step: send to the next rank, receive from the previous one.
  void group(const void* sbuf, size_t sbytes, void* rbuf, size_t rbytes, cudaStream_t stream);
  struct Prims;  // the ring's primitives (ring/loop.h) over NCCL groups
  void run_ring(const Call& c, cudaStream_t stream);
  // Direct halves (one group each): reduce-scatter (one_shot: every rank's whole input, else chunk
  // r of it) reduced in rank order into the output; all-gather of the reduced chunks.
  void direct_reduce(const Call& c, bool one_shot, cudaStream_t stream);
  void direct_gather(const Call& c, cudaStream_t stream);
  void settle(const char* what);  // non-blocking NCCL: wait until the last call is done, bounded
  void nccl_check(int res, const char* what);
  void fail_locked(const std::string& why);  // mu_ held: abort the NCCL communicator, record why
  // Records the first failure; seq: the first call it spoils (0: the oldest call not finished).
  void set_failure(const std::string& why, uint64_t seq = 0);
  uint64_t first_unfinished();  // qmu_ not held
  // The call an NCCL error spoils: the oldest not retired (qmu_ not held). NCCL may report an
  // error after the call's kernels have finished (its event is complete), so completion alone does
  // not clear a call.
  uint64_t first_unretired();
  // mu_ held: checks the peers' descriptors of every call that has them (a mismatch is recorded
  // as that call's failure and returned), then retires the calls whose events have completed, once
  // NCCL's async state read after those queries is clean; returns NCCL's error as a message, or "".
  std::string retire_locked();
  std::string check_descs(Pending& p);  // "" or the mismatch, as the p2p transport words it
  std::string descs_if_seen(Pending& p);  // check_descs once p's descriptors reached the host
  std::string known_mismatch();  // mu_ held, qmu_ not: the first mismatch seen (in flight, next_)
  int take_desc_slot();                 // mu_ held; grows the pool when every slot is in use
  void release_pending(Pending& p);     // qmu_ held: its events and slot
  void watch();
  std::string async_error_locked();  // mu_ held: NCCL's async error as a message, or ""

  Options opt_;
  int device_ = 0;
  int up_ = 0, down_ = 0;
  ncclComm* comm_ = nullptr;
  char* staging_[2] = {nullptr, nullptr};  // one allocation: the direct algorithms use both as one
  std::vector<P2p> ops_;  // group()'s list, kept to avoid an allocation per group
  std::vector<P2p> gops_;  // the list group() posts: ops_ with the descriptors first
  std::vector<DescSlot> desc_slots_;
  std::vector<int> desc_free_;
  std::vector<std::pair<void*, void*>> desc_chunks_;  // (device, pinned host) allocations
  Pending next_;  // the call being enqueued: its first group() adds the descriptors
  std::atomic<uint64_t> op_seq_{0};
  CallLog calls_;
  std::atomic<bool> in_call_{false};  // run() is enqueueing call op_seq_
  bool closed_ = false;

  std::mutex mu_;  // NCCL calls on comm_
  std::atomic<bool> abort_requested_{false};
  std::mutex fmu_;  // failure_, peers_
  std::string failure_;
  std::atomic<uint64_t> failed_seq_{0};
  std::vector<runtime::Peer> peers_;
  std::mutex qmu_;  // inflight_, stop_
  std::condition_variable qcv_;
  std::deque<Pending> inflight_;  // enqueued and not retired
  std::chrono::steady_clock::time_point last_done_;  // seen_done of the last call retired
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace ringreduce::cuda::nccl
