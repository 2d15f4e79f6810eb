#include "runtime/peers.h"

#include <unistd.h>

#include <cstdio>
#include <cstring>

namespace ringreduce::runtime {

bool process_dead(int pid) {
  if (pid <= 0 || pid == getpid()) return false;
  char path[64], buf[512];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return true;
  const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* p = std::strrchr(buf, ')');  // the state follows the parenthesised command name
  return p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X');
}

std::string dead_peer(const std::vector<Peer>& peers) {
  for (const Peer& p : peers)
    if (process_dead(p.pid))
      return "peer rank " + std::to_string(p.rank) + " (pid " + std::to_string(p.pid) + ") died";
  return "";
}

Ticker::Ticker(std::chrono::milliseconds period, std::function<void()> fn) {
  th_ = std::thread([this, period, fn = std::move(fn)] {
    std::unique_lock<std::mutex> lk(mu_);
    while (!cv_.wait_for(lk, period, [&] { return stop_; })) {
      lk.unlock();
      fn();
      lk.lock();
    }
  });
}

void Ticker::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (th_.joinable() && th_.get_id() != std::this_thread::get_id()) th_.join();
}

}  // namespace ringreduce::runtime
