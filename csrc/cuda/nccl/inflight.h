// The calls in flight, a part of the nccl endpoint: each call's completion event, its descriptors'
// slot (DescSlots) and their copy to the host, when the last retired call was seen complete, and
// the watchdog's period. Its lock is taken under the endpoint's mu_ (run, close, NCCL's errors) and
// without it (the watchdog, abort()); while held it calls CUDA only, no other part.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/nccl/descriptor.h"

namespace ringreduce::cuda::nccl {

using Clock = std::chrono::steady_clock;

struct Pending {
  cudaEvent_t done = nullptr;
  uint64_t seq = 0;
  Clock::time_point enqueued;
  Clock::time_point seen_done{};  // when its event was first seen complete
  int slot = -1;                  // its descriptors' slot
  cudaEvent_t descs = nullptr;    // the peers' descriptors are in the slot's host copy
  std::vector<int> from;          // the peers whose descriptors it received
  bool checked = false;
};

class InFlight {
 public:
  // op_seq, in_call: the endpoint's count of calls and whether run() is enqueueing #op_seq.
  InFlight(int rank, int nranks, const std::atomic<uint64_t>& op_seq, const std::atomic<bool>& in_call)
      : rank_(rank), op_seq_(op_seq), in_call_(in_call), descs_(nranks) {}
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

  // A slot for the call being enqueued: nranks descriptors on the device and their host copy.
  int take();
  char* dev(int slot);
  Desc* host(int slot);
  void push(Pending&& p);    // enqueued: in flight until retired
  void release(Pending& p);  // its events and slot: a call that never went in flight

  // The oldest call whose event has not completed; else the call being enqueued, or the next.
  uint64_t first_unfinished();
  // The oldest call not retired (NCCL may report an error after a call's event has completed, so
  // completion alone does not clear it); else as first_unfinished.
  uint64_t first_unretired();
  // Retiring, in three steps, each under this lock alone (the endpoint reads NCCL's async state
  // between the second and the third): the first mismatch among the calls whose descriptors have
  // reached the host (compared once each), with its call in *seq, or "";
  std::string check(uint64_t* seq);
  // then the newest call of the checked, complete calls from the oldest on (0: none);
  uint64_t finished();
  // then the calls up to #upto retired.
  void retire(uint64_t upto);
  // The first mismatch the descriptors that reached the host show, in flight, else next's.
  std::string known_mismatch(Pending& next);

  // The watchdog's look at the oldest call not complete, on its thread (under its RelaxedCapture):
  // seq 0 when none is stuck; else a fault on its stream, or a timeout (timed from when the call
  // before it was seen complete) and the mismatch its descriptors show, if they arrived.
  struct Stuck {
    uint64_t seq = 0;
    cudaError_t fault = cudaSuccess;
    std::string mismatch;
  };
  Stuck stuck(Clock::duration timeout);
  bool wait(std::chrono::milliseconds period);  // the watchdog's period; false once stopped
  void stop();
  // Every call released and the slots freed: the device is current and nothing runs.
  void clear();

 private:
  std::string check_descs(const Pending& p);  // "" or the mismatch (descriptor.h)
  std::string descs_if_seen(Pending& p);       // check_descs once p's descriptors reached the host
  void release_locked(Pending& p);

  const int rank_;
  const std::atomic<uint64_t>& op_seq_;
  const std::atomic<bool>& in_call_;
  std::mutex mu_;
  std::condition_variable cv_;
  DescSlots descs_;
  std::deque<Pending> q_;  // enqueued and not retired
  Clock::time_point last_done_ = Clock::now();  // seen_done of the last call retired
  bool stop_ = false;
};

}  // namespace ringreduce::cuda::nccl
