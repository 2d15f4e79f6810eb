// The failure record, a part of the nccl endpoint: the first failure, the first call it spoiled,
// and the peers the watchdog checks. Read by every thread (run(), Work.wait(), the watchdog,
// Communicator.abort()); its lock is a leaf: nothing else is called while it is held.
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "runtime/peers.h"

namespace ringreduce::cuda::nccl {

class Failures {
 public:
  // Records why and seq (the first call it spoils) unless a failure is recorded: the first wins.
  void set(const std::string& why, uint64_t seq) {
    std::lock_guard<std::mutex> lk(mu_);
    if (!failure_.empty()) return;
    failure_ = why;
    failed_seq_ = seq;
  }
  std::string failure() {
    std::lock_guard<std::mutex> lk(mu_);
    return failure_;
  }
  uint64_t failed_seq() const { return failed_seq_; }
  void watch_peers(std::vector<runtime::Peer> peers) {
    std::lock_guard<std::mutex> lk(mu_);
    peers_ = std::move(peers);
  }
  // A dead peer in words, or "": its /proc reads are made outside the lock.
  std::string dead_peer() {
    std::vector<runtime::Peer> peers;
    {
      std::lock_guard<std::mutex> lk(mu_);
      peers = peers_;
    }
    return runtime::dead_peer(peers);
  }

 private:
  std::mutex mu_;
  std::string failure_;
  std::atomic<uint64_t> failed_seq_{0};  // read without the lock
  std::vector<runtime::Peer> peers_;
};

}  // namespace ringreduce::cuda::nccl
