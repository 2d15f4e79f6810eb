// The watchdog and the retirement of calls: the calls in flight (inflight.h) that finished or are
// stuck, whether their descriptors matched, whether NCCL reported an error after them.
#include "cuda/host.h"
#include "cuda/nccl/endpoint.h"
#include "cuda/nccl/library.h"

namespace ringreduce::cuda::nccl {

std::string Endpoint::retire_locked() {
  RelaxedCapture relaxed;
  uint64_t mismatch_seq = 0;
  const std::string mismatch = inflight_.check(&mismatch_seq);
  if (!mismatch.empty()) {
    set_failure(mismatch, mismatch_seq);
    return mismatch;
  }
  const uint64_t upto = inflight_.finished();
  const std::string why = async_error_locked();
  if (!why.empty() || upto == 0) return why;
  inflight_.retire(upto);
  return "";
}

void Endpoint::watch() {
  RelaxedCapture relaxed;  // this thread's queries, for its whole life
  cudaSetDevice(device_);
  const auto timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(opt_.timeout_s));
  while (inflight_.wait(kWatchPeriod)) {
    const InFlight::Stuck stuck = inflight_.stuck(timeout);
    std::string why = stuck.mismatch;  // mismatched calls, where the descriptors show it
    uint64_t why_seq = stuck.seq;
    if (stuck.seq && why.empty()) {
      why = rank_text() + "collective #" + std::to_string(stuck.seq) + " on the nccl transport ";
      if (stuck.fault != cudaSuccess)  // a fault on the stream (sticky): nothing after it ran right
        why += std::string("failed: CUDA error ") + cudaGetErrorName(stuck.fault) + " (" +
               cudaGetErrorString(stuck.fault) + ")";
      else
        why += "timed out after " + seconds(opt_.timeout_s) +
               " s (RINGREDUCE_TIMEOUT; did every rank make the same call?)";
    }
    if (why.empty()) {
      const std::string dead = failures_.dead_peer();
      if (!dead.empty()) why = rank_text() + dead;
    }
    if (why.empty() && failure().empty()) {
      std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);  // else run() retires
      if (lk.owns_lock()) why = retire_locked();
      if (!why.empty()) why_seq = inflight_.first_unretired();
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
      set_failure(why, inflight_.first_unretired());
      fail_locked(why);
    }
  }
}

}  // namespace ringreduce::cuda::nccl
