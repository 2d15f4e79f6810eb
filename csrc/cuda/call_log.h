// Where a CUDA ring's calls stand on the device, read without blocking: the flight recorder's view
// of the GPU. An event (with timing) is recorded after each call's kernels, for the last kWindow
// calls; a query says whether call #seq has finished on the device and, if so, about when (host
// steady clock). Torch-free; runs on the emulated device in the native tests.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>

namespace ringreduce::cuda {

class CallLog {
 public:
  static constexpr int kWindow = 64;
  enum class State { Unknown = 0, Pending, Done };

  CallLog() = default;
  // Records only while enabled (a flight recorder is attached and on): events cost the GPU path.
  void enable(bool on) { enabled_.store(on, std::memory_order_relaxed); }
  ~CallLog();
  CallLog(const CallLog&) = delete;
  CallLog& operator=(const CallLog&) = delete;

  // After call seq's kernels on stream (on the current device). Nothing for a call captured into a
  // CUDA graph (a captured event cannot be queried), or when an event fails.
  void record(uint64_t seq, cudaStream_t stream, bool captured);
  // Call seq: Done (*done_ns: when, on the host's steady clock, to about a microsecond; 0 once it
  // left the window, known done because a later call on the stream is), Pending, or Unknown (not
  // recorded).
  State state(uint64_t seq, int64_t* done_ns);
  // Frees the events (the device's kernels must be done or abandoned). Idempotent.
  void close();

 private:
  bool start(cudaStream_t stream);  // the reference event, once

  struct Slot {
    uint64_t seq = 0;
    cudaEvent_t ev = nullptr;
  };
  std::mutex mu_;
  Slot slots_[kWindow];
  cudaEvent_t ref_ = nullptr;  // completed at ref_ns_ (host steady clock)
  int64_t ref_ns_ = 0;
  bool failed_ = false;  // an event call failed: record nothing more
  int device_ = 0;       // of the events (queries come from threads with another device)
  std::atomic<bool> enabled_{false};
};

// Records call seq in log when the scope it guards (a ring's run()) returns without throwing.
struct LogOnReturn {
  CallLog& log;
  uint64_t seq;
  cudaStream_t stream;
  bool captured;
  int uncaught = std::uncaught_exceptions();
  ~LogOnReturn() {
    if (std::uncaught_exceptions() == uncaught) log.record(seq, stream, captured);
  }
};

}  // namespace ringreduce::cuda
