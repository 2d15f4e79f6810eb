// Stopping, a part of the p2p endpoint: the host-mapped control block (HostCtl: the host's abort
// flag, the device's error records and reports), why this rank aborted, the first failure put into
// words (failures.cpp, from the error records: diagnose.cpp), and the peer watcher. Its own lock;
// an abort tells the peers through the callback the endpoint gives it (the areas' abort words, the
// copy algorithm's waits), called under this lock: those parts never call back into this one.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/p2p/layout.h"
#include "runtime/peers.h"

namespace ringreduce::cuda::p2p {

// "all_reduce(numel=..., dtype=..., op=...; algorithm)" for error messages (diagnose.cpp).
std::string call_text(const MsgHeader& h);

class Failures {
 public:
  // op_seq: the endpoint's count of calls (an abort fails every call from the next one on).
  Failures(int rank, int nranks, double timeout_s, const std::atomic<uint64_t>& op_seq)
      : rank_(rank), nranks_(nranks), timeout_s_(timeout_s), op_seq_(op_seq) {}
  ~Failures();
  Failures(const Failures&) = delete;
  Failures& operator=(const Failures&) = delete;

  // Allocates the control block (zeroed). tell(word): how an abort reaches the peers.
  void create(std::function<void(uint32_t word)> tell);
  HostCtl* ctl() const { return ctl_; }          // as the host sees it; null once closed
  HostCtl* ctl_dev() const { return ctl_dev_; }  // as the device sees it
  // The first failure the device recorded (or the host decided), formatted; "" while none.
  std::string failure();
  // The op_seq of the first call that failed, or 0: it and every later call failed.
  uint64_t failed_seq();
  // Stops this rank's running and future kernels and tells the peers.
  void abort(const std::string& why) {
    std::lock_guard<std::mutex> lk(mu_);
    abort_locked(why, kHostAbort);
  }
  // A watchdog found call #call stuck (cause: kTimeout): that call failed, with `why`.
  void fail(const std::string& why, uint64_t call, uint32_t cause);
  // Every 50 ms: a dead peer aborts the group ("peer rank R (pid P) died").
  void watch_peers(std::vector<runtime::Peer> peers);
  void stop() {
    if (watcher_) watcher_->stop();
  }
  // The close, in two steps around the other parts' (no thread may call in meanwhile but abort()):
  // first the stop words (keep: a peer may still use this rank's memory, so the group is aborted;
  // replayable: a graph may replay a launch, which then stops at its first wait), then, once the
  // side stream's abort words have landed, the first failed call recorded and the block freed
  // (unless a replay may still read it).
  void close_begin(bool keep, bool replayable);
  void close_end(bool replayable);

 private:
  std::string describe(const ErrorRecord& e, int block) const;  // diagnose.cpp
  void abort_locked(const std::string& why, uint32_t cause);
  uint64_t failed_seq_locked() const;

  const int rank_, nranks_;
  const double timeout_s_;
  const std::atomic<uint64_t>& op_seq_;
  std::function<void(uint32_t)> tell_;
  // Called from other threads (Work.wait(), Communicator.abort(), the watchers) while run() calls
  // failure() with the GIL released.
  std::mutex mu_;
  HostCtl* ctl_ = nullptr;      // host-mapped (cudaHostAlloc)
  HostCtl* ctl_dev_ = nullptr;  // the same memory as the device sees it
  std::string reason_;          // why this rank aborted (host side)
  std::string failure_;
  uint64_t abort_seq_ = 0;         // op_seq + 1 at a host abort: the first call it can affect
  uint64_t closed_failed_seq_ = 0;  // the device's first failed call, read at close
  std::unique_ptr<runtime::Ticker> watcher_;
};

}  // namespace ringreduce::cuda::p2p
