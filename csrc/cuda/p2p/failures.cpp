// Stopping (failures.h): the control block, aborts, the first failure and failed call, the peer
// watcher. What a device's error record says: diagnose.cpp.
#include "cuda/p2p/failures.h"

#include <cuda_runtime.h>

#include <chrono>
#include <cstring>

#include "cuda/host.h"

namespace ringreduce::cuda::p2p {

Failures::~Failures() {
  stop();
  if (ctl_) cudaFreeHost(ctl_);
}

void Failures::create(std::function<void(uint32_t)> tell) {
  tell_ = std::move(tell);
  void* p = nullptr;
  RR_CUDA_CHECK(cudaHostAlloc(&p, sizeof(HostCtl), cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(p, 0, sizeof(HostCtl));
  void* dev = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&dev, p, 0);
  if (e != cudaSuccess) {
    cudaFreeHost(p);
    RR_CUDA_CHECK(e);
  }
  std::lock_guard<std::mutex> lk(mu_);
  ctl_ = static_cast<HostCtl*>(p);
  ctl_dev_ = static_cast<HostCtl*>(dev);
}

void Failures::abort_locked(const std::string& why, uint32_t cause) {
  if (!ctl_) return;
  if (reason_.empty()) reason_ = why;
  if (abort_seq_ == 0) abort_seq_ = op_seq_ + 1;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  reinterpret_cast<volatile uint32_t*>(&ctl_->abort)[0] = kCtlAbort;
  // The peers poll only their own memory: the abort word goes into every area this rank maps, and
  // the copy algorithm's stream waits are released (after the word: a released stream's next
  // kernel sees why).
  if (tell_ && nranks_ > 1) tell_(abort_word(cause, rank_));
  if (failure_.empty()) failure_ = "ringreduce: rank " + std::to_string(rank_) + ": aborted: " + why;
}

void Failures::fail(const std::string& why, uint64_t call, uint32_t cause) {
  std::lock_guard<std::mutex> lk(mu_);
  if (failure_.empty()) failure_ = why;
  if (abort_seq_ == 0 || call < abort_seq_) abort_seq_ = call;
  abort_locked(why, cause);
}

void Failures::watch_peers(std::vector<runtime::Peer> peers) {
  // 50 ms: as the shared-memory ring's peer check; a /proc read per peer each time.
  watcher_ = std::make_unique<runtime::Ticker>(std::chrono::milliseconds(50), [this, peers] {
    const std::string dead = runtime::dead_peer(peers);
    if (dead.empty()) return;
    std::lock_guard<std::mutex> lk(mu_);
    if (reason_.empty()) abort_locked(dead, kHostAbort);
  });
}

std::string Failures::failure() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!failure_.empty() || !ctl_) return failure_;
  // Prefer a record of a block that saw the cause itself over one that learned of it.
  int pick = -1;
  for (int k = 0; k < kMaxBlocks; ++k) {
    const volatile ErrorRecord* e = &ctl_->err[k];
    if (e->word == 0) continue;
    if (pick < 0 || (e->local && !ctl_->err[pick].local)) pick = k;
  }
  if (pick < 0) return failure_;
  std::atomic_thread_fence(std::memory_order_acquire);
  ErrorRecord rec;
  std::memcpy(&rec, const_cast<const ErrorRecord*>(&ctl_->err[pick]), sizeof rec);
  failure_ = describe(rec, pick);
  return failure_;
}

uint64_t Failures::failed_seq() {
  std::lock_guard<std::mutex> lk(mu_);
  return failed_seq_locked();
}

uint64_t Failures::failed_seq_locked() const {
  uint64_t first = abort_seq_;
  if (closed_failed_seq_ && (first == 0 || closed_failed_seq_ < first)) first = closed_failed_seq_;
  if (!ctl_) return first;
  for (int k = 0; k < kMaxBlocks; ++k) {
    const volatile ErrorRecord* e = &ctl_->err[k];
    if (e->word == 0) continue;
    std::atomic_thread_fence(std::memory_order_acquire);
    const uint64_t seq = e->mine.op_seq;
    if (first == 0 || seq < first) first = seq;
  }
  return first;
}

void Failures::close_begin(bool keep, bool replayable) {
  std::lock_guard<std::mutex> lk(mu_);
  if (keep) abort_locked("closed while a neighbour may still use this rank's memory", kHostAbort);
  if (replayable && ctl_) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    reinterpret_cast<volatile uint32_t*>(&ctl_->abort)[0] = kCtlClosed;
  }
}

void Failures::close_end(bool replayable) {
  std::lock_guard<std::mutex> lk(mu_);
  // A Work whose call failed on the device may be waited on after this (the worker's join timed
  // out): the first failed call must outlive the records it was read from.
  closed_failed_seq_ = failed_seq_locked();
  if (ctl_ && !replayable) cudaFreeHost(ctl_);  // else kept: a replay's kernel still reads it
  ctl_ = ctl_dev_ = nullptr;
  tell_ = nullptr;
}

}  // namespace ringreduce::cuda::p2p
