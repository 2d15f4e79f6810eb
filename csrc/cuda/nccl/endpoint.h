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
// NCCL is the libnccl.so.2 the process already has (torch's: library.h). Torch-free.
// Deterministic mode (Call::deterministic): all_reduce and reduce_scatter run one-shot or
// two-shot only, whose fold gives the bits of the rank-order reduction at every size and slicing.
// Mismatched calls: each call starts with a group of its own that exchanges a 32-byte call
// descriptor (descriptor.h) with every peer, whatever the algorithm, so that it completes even where the
// calls' data groups block each other (one more group round trip per call: one-shot's 1 group is
// 2, two-shot's 2 are 3, the ring's 2(N-1) are 2N-1). A difference fails the call on every rank, which then
// aborts; an NCCL error or a timeout of a call whose descriptors differ is reported as the
// mismatch. NCCL alone failed only the rank whose receive it truncated.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda/call_log.h"
#include "cuda/nccl/algorithms.h"
#include "cuda/nccl/descriptor.h"
#include "cuda/nccl/failures.h"
#include "cuda/nccl/inflight.h"
#include "cuda/nccl/plan.h"
#include "ring/call.h"
#include "runtime/peers.h"
#include "runtime/transport.h"

struct ncclComm;

namespace ringreduce::cuda::nccl {

// How often the watchdog looks at the oldest call in flight and at NCCL's async error.
constexpr auto kWatchPeriod = std::chrono::milliseconds(100);

// NCCL's version as ncclGetVersion reports it (e.g. 23007); loads the library on first use.
// lib: a path to try when no libnccl.so.2 is loaded yet ("" for the default search).
int version(const std::string& lib);
// A new ncclUniqueId, as bytes for the store.
std::string unique_id(const std::string& lib);

// plan(c, o, c.deterministic): the plan in the mode the call was made in.
Algo plan(const Call& c, const Options& o);

// The front over two parts that each own their state and lock: the calls in flight (InFlight)
// and the failure record (Failures). Lock order is call order: mu_, then one part's lock; the
// parts call neither each other nor the endpoint.
class Endpoint : public runtime::Transport {
 public:
  // Collective over the group (every rank with the same id); on the current device.
  Endpoint(const Options& opt, const std::string& id);
  ~Endpoint() override;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // Enqueues one collective on stream. Throws RingError when the ring is broken or NCCL fails, and
  // when c.captured (not capture-safe: see run()).
  // Before the call is counted: a call deterministic mode cannot run throws in its plan, on every
  // rank alike (the plan depends only on the call and the options), and the ranks stay in step.
  void run(const Call& c, cudaStream_t stream) { run(c, nccl::plan(c, opt_), stream); }
  void run(const Call& c, Algo algo, cudaStream_t stream);

  // runtime::Transport
  const char* name() const override { return "nccl"; }
  runtime::Caps caps() const override;
  int nranks() const override { return opt_.nranks; }
  Plan plan(const Call& c) override {
    Plan p;
    p.algo = nccl::plan(c, opt_);
    return p;
  }
  void run(const Call& c, const Plan& p, void* stream) override { run(c, p.algo, static_cast<cudaStream_t>(stream)); }
  int call_state(uint64_t seq, int64_t* done_ns) override {
    return static_cast<int>(calls_.state(seq, done_ns));
  }
  void log_calls(bool on) override { calls_.enable(on); }
  void close(bool /*peers_done*/) override { close(); }
  // The first failure (the watchdog's timeout, NCCL's async error, a CUDA error, a dead peer), or "".
  std::string failure() override { return failures_.failure(); }
  bool broken() { return !failure().empty(); }
  // The op_seq of the first call that failed, or 0 (see p2p::Endpoint::failed_seq).
  uint64_t failed_seq() override { return failures_.failed_seq(); }
  // Looks at NCCL's asynchronous error now (the watchdog does every period): a call whose event
  // has completed may still have failed inside NCCL (e.g. a truncated message).
  void poll() override;
  void abort(const std::string& why) override;
  // The watchdog also checks these peers' processes; a dead one fails and aborts the communicator.
  void watch_peers(std::vector<runtime::Peer> peers) override { failures_.watch_peers(std::move(peers)); }
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
  // One group of sends and receives on stream, settled (enqueued) before it returns; the call's
  // first is preceded by the descriptor group.
  void group(const std::vector<P2p>& ops, cudaStream_t stream);
  void post(const std::vector<P2p>& ops, cudaStream_t stream, const char* what);  // one group
  void settle(const char* what);  // non-blocking NCCL: wait until the last call is done, bounded
  void nccl_check(int res, const char* what);
  void fail_locked(const std::string& why);  // mu_ held: abort the NCCL communicator, record why
  // Records the first failure; seq: the first call it spoils (0: the oldest call not finished).
  void set_failure(const std::string& why, uint64_t seq = 0) {
    failures_.set(why, seq ? seq : inflight_.first_unfinished());
  }
  // mu_ held: checks the peers' descriptors of every call that has them (a mismatch is recorded
  // as that call's failure and returned), then retires the calls whose events have completed, once
  // NCCL's async state read after those queries is clean; returns NCCL's error as a message, or "".
  std::string retire_locked();
  std::string known_mismatch() { return inflight_.known_mismatch(next_); }  // mu_ held
  void watch();
  std::string async_error_locked();  // mu_ held: NCCL's async error as a message, or ""
  std::string rank_text() const;     // "ringreduce: rank R: ", every message's start
  static std::string seconds(double s);

  Options opt_;
  int device_ = 0;
  ncclComm* comm_ = nullptr;
  Groups groups_;  // the schedules' view: world, staging, group()
  std::vector<P2p> gops_;  // the descriptor group's list
  Pending next_;  // mu_ held: the call being enqueued; its first group() adds the descriptors
  std::atomic<uint64_t> op_seq_{0};
  CallLog calls_;
  std::atomic<bool> in_call_{false};  // run() is enqueueing call op_seq_
  bool closed_ = false;

  std::mutex mu_;  // NCCL calls on comm_, next_
  std::atomic<bool> abort_requested_{false};
  Failures failures_;
  InFlight inflight_{opt_.rank, opt_.nranks, op_seq_, in_call_};
  std::thread watchdog_;
};

}  // namespace ringreduce::cuda::nccl
