// The watchdog and the retirement of calls: which calls in flight have finished, whether their
// descriptors matched, whether NCCL reported an error after them, and the timeout.
#include <algorithm>

#include "cuda/host.h"
#include "cuda/nccl/endpoint.h"
#include "cuda/nccl/library.h"

namespace ringreduce::cuda::nccl {

using Clock = std::chrono::steady_clock;

uint64_t Endpoint::first_unfinished() {
  RelaxedCapture relaxed;
  std::lock_guard<std::mutex> qlk(qmu_);
  uint64_t seq = 0;
  for (const Pending& p : inflight_)
    if (cudaEventQuery(p.done) != cudaSuccess) {
      seq = p.seq;
      break;
    }
  cudaGetLastError();
  if (seq) return seq;
  return op_seq_ + (in_call_ ? 0 : 1);  // the call being enqueued, else the next one
}

uint64_t Endpoint::first_unretired() {
  std::lock_guard<std::mutex> qlk(qmu_);
  if (!inflight_.empty()) return inflight_.front().seq;
  return op_seq_ + (in_call_ ? 0 : 1);
}

std::string Endpoint::retire_locked() {
  RelaxedCapture relaxed;
  uint64_t upto = 0;
  {
    std::string mismatch;
    uint64_t mismatch_seq = 0;
    {
      std::lock_guard<std::mutex> qlk(qmu_);
      for (Pending& p : inflight_) {  // calls on other streams may complete out of order
        if (p.checked) continue;
        if (p.descs) {
          const cudaError_t q = cudaEventQuery(p.descs);
          if (q == cudaErrorNotReady) continue;
          if (q != cudaSuccess) break;  // a fault is the watchdog's to report
        }
        p.checked = true;
        mismatch = p.descs ? check_descs(p) : std::string();
        if (!mismatch.empty()) {
          mismatch_seq = p.seq;
          break;
        }
      }
      cudaGetLastError();
    }
    if (!mismatch.empty()) {
      set_failure(mismatch, mismatch_seq);
      return mismatch;
    }
  }
  {
    std::lock_guard<std::mutex> qlk(qmu_);
    for (Pending& p : inflight_) {
      if (!p.checked || cudaEventQuery(p.done) != cudaSuccess) break;  // a fault: the watchdog's
      if (p.seen_done == Clock::time_point{}) p.seen_done = Clock::now();
      upto = p.seq;
    }
    cudaGetLastError();
  }
  const std::string why = async_error_locked();
  if (!why.empty() || upto == 0) return why;
  std::lock_guard<std::mutex> qlk(qmu_);
  while (!inflight_.empty() && inflight_.front().seq <= upto) {
    last_done_ = inflight_.front().seen_done;
    release_pending(inflight_.front());
    inflight_.pop_front();
  }
  return "";
}

std::string Endpoint::check_descs(const Pending& p) {
  return mismatch(descs_.host(p.slot), opt_.rank, p.from);
}

std::string Endpoint::descs_if_seen(Pending& p) {
  if (!p.descs || p.slot < 0) return "";
  RelaxedCapture relaxed;
  const cudaError_t q = cudaEventQuery(p.descs);
  cudaGetLastError();
  return q == cudaSuccess ? check_descs(p) : std::string();
}

std::string Endpoint::known_mismatch() {
  {
    std::lock_guard<std::mutex> qlk(qmu_);
    for (Pending& p : inflight_) {
      const std::string m = descs_if_seen(p);
      if (!m.empty()) return m;
    }
  }
  return descs_if_seen(next_);
}

void Endpoint::watch() {
  RelaxedCapture relaxed;  // this thread's queries, for its whole life
  cudaSetDevice(device_);
  const auto timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(opt_.timeout_s));
  std::unique_lock<std::mutex> qlk(qmu_);
  while (!stop_) {
    qcv_.wait_for(qlk, kWatchPeriod);
    if (stop_) break;
    std::string why;
    uint64_t why_seq = 0;
    // The oldest call not complete is timed from when the one before it was seen complete. Complete
    // calls stay until retire_locked() has also seen NCCL's async state clean after them.
    Clock::time_point prev_done = last_done_;
    for (Pending& p : inflight_) {
      const cudaError_t q = cudaEventQuery(p.done);
      if (q == cudaErrorNotReady) {
        if (Clock::now() - std::max(p.enqueued, prev_done) > timeout) {
          why = descs_if_seen(p);  // mismatched calls, where the descriptors show it
          if (why.empty())
            why = rank_text() + "collective #" + std::to_string(p.seq) +
                  " on the nccl transport timed out after " +
                  seconds(opt_.timeout_s) + " s (RINGREDUCE_TIMEOUT; did every rank make the same call?)";
          why_seq = p.seq;
        }
        break;
      }
      cudaGetLastError();
      if (q != cudaSuccess) {  // a fault on the stream (sticky): nothing after it ran right
        why = rank_text() + "collective #" + std::to_string(p.seq) +
              " on the nccl transport failed: CUDA error " +
              cudaGetErrorName(q) + " (" + cudaGetErrorString(q) + ")";
        why_seq = p.seq;
        break;
      }
      if (p.seen_done == Clock::time_point{}) p.seen_done = Clock::now();
      prev_done = p.seen_done;
    }
    qlk.unlock();
    if (why.empty()) {
      std::vector<runtime::Peer> peers;
      {
        std::lock_guard<std::mutex> flk(fmu_);
        peers = peers_;
      }
      const std::string dead = runtime::dead_peer(peers);
      if (!dead.empty()) why = rank_text() + dead;
    }
    if (why.empty() && failure().empty()) {
      std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);  // else run() retires
      if (lk.owns_lock()) why = retire_locked();
      if (!why.empty()) why_seq = first_unretired();
    }
    if (!why.empty()) set_failure(why, why_seq);  // the first failure wins
    // Abort for a timeout seen now, and also for one requested earlier while run() held mu_ (a
    // timeout here, or abort() from another thread): run() may have returned without polling
    // again, and then nobody aborted the communicator, NCCL's kernels never returned and every
    // synchronize() and close() waited forever. Retried each period until the lock is free.
    if (!why.empty() || abort_requested_) {
      std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
      if (lk.owns_lock())
        fail_locked(failure());
      else
        abort_requested_ = true;  // the thread inside NCCL aborts when it next polls (settle)
    }
    qlk.lock();
  }
}

std::string Endpoint::async_error_locked() {
  if (!comm_) return "";
  ncclResult_t state = ncclSuccess;
  const Api& nc = api(opt_.lib);
  nc.async_error(comm_, &state);
  if (state == ncclSuccess || state == ncclInProgress) return "";
  return rank_text() + "NCCL error: " + error_text(nc, state, comm_);
}

void Endpoint::poll() {
  if (!failure().empty()) return;
  std::string why;
  {
    std::lock_guard<std::mutex> lk(mu_);
    why = retire_locked();
    if (!why.empty()) {
      set_failure(why, first_unretired());
      fail_locked(why);
    }
  }
}

}  // namespace ringreduce::cuda::nccl
