// Liveness of the other ranks' processes on this host, shared by every transport: a rank waiting on
// a peer that died raises within a fraction of a second instead of at its timeout. Torch-free.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace ringreduce::runtime {

struct Peer {
  int rank;
  int pid;
};

// The process is gone, or a zombie (killed or exited, not yet reaped by its parent).
bool process_dead(int pid);
// "peer rank R (pid P) died" for the first dead peer, or "". Pids <= 0 and our own are skipped.
std::string dead_peer(const std::vector<Peer>& peers);

// Calls fn every period on a thread of its own until stopped or destroyed.
class Ticker {
 public:
  Ticker(std::chrono::milliseconds period, std::function<void()> fn);
  ~Ticker() { stop(); }
  Ticker(const Ticker&) = delete;
  Ticker& operator=(const Ticker&) = delete;
  void stop();  // idempotent; waits for a call in progress

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread th_;
};

}  // namespace ringreduce::runtime
