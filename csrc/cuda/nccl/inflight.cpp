// The calls in flight (inflight.h): their slots, which have finished, whether their descriptors
// matched, and what the watchdog sees stuck.
#include "cuda/nccl/inflight.h"

#include <algorithm>

#include "cuda/host.h"

namespace ringreduce::cuda::nccl {

int InFlight::take() {
  std::lock_guard<std::mutex> lk(mu_);
  return descs_.take();
}

// The slots' memory never moves (DescSlots grows by chunks), only the table that take() grows.
char* InFlight::dev(int slot) {
  std::lock_guard<std::mutex> lk(mu_);
  return descs_.dev(slot);
}

Desc* InFlight::host(int slot) {
  std::lock_guard<std::mutex> lk(mu_);
  return descs_.host(slot);
}

void InFlight::push(Pending&& p) {
  std::lock_guard<std::mutex> lk(mu_);
  q_.push_back(std::move(p));
}

void InFlight::release(Pending& p) {
  std::lock_guard<std::mutex> lk(mu_);
  release_locked(p);
}

void InFlight::release_locked(Pending& p) {
  if (p.done) cudaEventDestroy(p.done);
  if (p.descs) cudaEventDestroy(p.descs);
  if (p.slot >= 0) descs_.give(p.slot);
  p.done = p.descs = nullptr;
  p.slot = -1;
}

uint64_t InFlight::first_unfinished() {
  RelaxedCapture relaxed;
  std::lock_guard<std::mutex> lk(mu_);
  uint64_t seq = 0;
  for (const Pending& p : q_)
    if (cudaEventQuery(p.done) != cudaSuccess) {
      seq = p.seq;
      break;
    }
  cudaGetLastError();
  if (seq) return seq;
  return op_seq_ + (in_call_ ? 0 : 1);  // the call being enqueued, else the next one
}

uint64_t InFlight::first_unretired() {
  std::lock_guard<std::mutex> lk(mu_);
  if (!q_.empty()) return q_.front().seq;
  return op_seq_ + (in_call_ ? 0 : 1);
}

std::string InFlight::check(uint64_t* seq) {
  std::string mismatch;
  std::lock_guard<std::mutex> lk(mu_);
  for (Pending& p : q_) {  // calls on other streams may complete out of order
    if (p.checked) continue;
    if (p.descs) {
      const cudaError_t q = cudaEventQuery(p.descs);
      if (q == cudaErrorNotReady) continue;
      if (q != cudaSuccess) break;  // a fault is the watchdog's to report
    }
    p.checked = true;
    mismatch = p.descs ? check_descs(p) : std::string();
    if (!mismatch.empty()) {
      *seq = p.seq;
      break;
    }
  }
  cudaGetLastError();
  return mismatch;
}

uint64_t InFlight::finished() {
  uint64_t upto = 0;
  std::lock_guard<std::mutex> lk(mu_);
  for (Pending& p : q_) {
    if (!p.checked || cudaEventQuery(p.done) != cudaSuccess) break;  // a fault: the watchdog's
    if (p.seen_done == Clock::time_point{}) p.seen_done = Clock::now();
    upto = p.seq;
  }
  cudaGetLastError();
  return upto;
}

void InFlight::retire(uint64_t upto) {
  std::lock_guard<std::mutex> lk(mu_);
  while (!q_.empty() && q_.front().seq <= upto) {
    last_done_ = q_.front().seen_done;
    release_locked(q_.front());
    q_.pop_front();
  }
}

std::string InFlight::check_descs(const Pending& p) {
  return mismatch(descs_.host(p.slot), rank_, p.from);
}

std::string InFlight::descs_if_seen(Pending& p) {
  if (!p.descs || p.slot < 0) return "";
  RelaxedCapture relaxed;
  const cudaError_t q = cudaEventQuery(p.descs);
  cudaGetLastError();
  return q == cudaSuccess ? check_descs(p) : std::string();
}

std::string InFlight::known_mismatch(Pending& next) {
  std::lock_guard<std::mutex> lk(mu_);
  for (Pending& p : q_) {
    const std::string m = descs_if_seen(p);
    if (!m.empty()) return m;
  }
  return descs_if_seen(next);
}

InFlight::Stuck InFlight::stuck(Clock::duration timeout) {
  Stuck s;
  std::lock_guard<std::mutex> lk(mu_);
  // The oldest call not complete is timed from when the one before it was seen complete. Complete
  // calls stay until retire() (the endpoint has also seen NCCL's async state clean after them).
  Clock::time_point prev_done = last_done_;
  for (Pending& p : q_) {
    const cudaError_t q = cudaEventQuery(p.done);
    if (q == cudaErrorNotReady) {
      if (Clock::now() - std::max(p.enqueued, prev_done) > timeout) {
        s.seq = p.seq;
        s.mismatch = descs_if_seen(p);  // mismatched calls, where the descriptors show it
      }
      break;
    }
    cudaGetLastError();
    if (q != cudaSuccess) {
      s.seq = p.seq;
      s.fault = q;
      break;
    }
    if (p.seen_done == Clock::time_point{}) p.seen_done = Clock::now();
    prev_done = p.seen_done;
  }
  return s;
}

bool InFlight::wait(std::chrono::milliseconds period) {
  std::unique_lock<std::mutex> lk(mu_);
  if (!stop_) cv_.wait_for(lk, period);
  return !stop_;
}

void InFlight::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
}

void InFlight::clear() {
  std::lock_guard<std::mutex> lk(mu_);
  for (Pending& p : q_) release_locked(p);
  q_.clear();
  descs_.free_all();
}

}  // namespace ringreduce::cuda::nccl
