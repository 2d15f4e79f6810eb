// The copy algorithm (Algo::Copy; copy.cpp says how it runs), a part of the p2p endpoint: the
// group's counters (CopyCtl, shared memory every rank registers with CUDA), the calls it enqueued
// and its watchdog. Its own lock. It calls no other part: the watchdog asks whether the group is
// broken and reports a stuck piece through the callbacks watch() takes, never under this lock
// (those callbacks may call release_waits(), which takes it).
#pragma once
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/p2p/area_layout.h"
#include "runtime/peers.h"

namespace ringreduce::cuda::p2p {

class CopyPath {
 public:
  CopyPath(const Options& o, const AreaLayout& l, int device) : opt_(o), layout_(l), device_(device) {}
  ~CopyPath() { stop(); }
  CopyPath(const CopyPath&) = delete;
  CopyPath& operator=(const CopyPath&) = delete;

  bool on() const { return layout_.inbox > 0; }  // the group has the inbox (RINGREDUCE_CUDA_ALGO=copy)
  // The counters: rank 0 creates the POSIX shared memory `name`, the others map it after; every
  // rank registers it with CUDA. Before the first call.
  void attach(const std::string& name, bool create);
  CopyCtl* counters_dev() const { return cctl_dev_; }  // set before the first call (attach)
  // Throws where a call cannot run (no inbox or counters, a driver without 64-bit stream memory
  // operations, a capture).
  void check(bool captured) const;
  // Enqueues call #op_seq's pieces on stream: a: the kernel's arguments; areas: every rank's area.
  void run(const Call& c, const Plan& p, Args a, const std::vector<char*>& areas, HostCtl* ctl_dev,
           uint64_t op_seq, cudaStream_t stream);
  // Every copy wait of the group released by CPU stores, after `word` (if not 0) became the
  // group's abort word.
  void release_waits(uint32_t word);
  // The watchdog (every 50 ms) over where this rank's stream stands (ctl): a piece waited on for
  // longer than the timeout is reported, fail(why, call), and a broken group's waits are released
  // while calls remain.
  void watch(const HostCtl* ctl, std::function<bool()> broken,
             std::function<void(const std::string&, uint64_t)> fail);
  void stop() {
    if (ticker_) ticker_->stop();
  }
  // Unregisters and unmaps the counters, unless this rank's stream may still write them (keep:
  // kept until exit, as the area is).
  void close(bool keep);

 private:
  void tick();
  void release_locked(uint32_t word);

  const Options& opt_;
  const AreaLayout& layout_;
  const int device_;
  mutable std::mutex mu_;
  CopyCtl* cctl_ = nullptr;      // the group's counters (shared memory, registered)
  CopyCtl* cctl_dev_ = nullptr;  // the same as the device sees them
  uint64_t pieces_ = 0;          // pieces enqueued (the same count on every rank)
  struct Sent {
    MsgHeader call;
    uint64_t first_piece;
  };
  Sent sent_[64] = {};  // the last calls run() enqueued, by op_seq % 64
  struct Watch {
    uint64_t reached = 0, done = 0;
    std::chrono::steady_clock::time_point since{};
  } watch_;
  const HostCtl* ctl_ = nullptr;
  std::function<bool()> broken_;
  std::function<void(const std::string&, uint64_t)> fail_;
  std::unique_ptr<runtime::Ticker> ticker_;  // declared last: stopped first
};

}  // namespace ringreduce::cuda::p2p
