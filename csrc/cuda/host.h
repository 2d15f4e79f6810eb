// Host-side helpers over the CUDA runtime that every CUDA transport and the binding use: errors
// (RR_CUDA_CHECK), the device's SM count, the relaxed capture mode, a device scope. Torch-free.
#pragma once
#include <cuda_runtime.h>

#include "ring/call.h"

namespace ringreduce::cuda {

// Throws RingError naming the failed call; CUDA errors are not recoverable for a communicator.
void check(cudaError_t e, const char* what);
#define RR_CUDA_CHECK(expr) ::ringreduce::cuda::check((expr), #expr)

// Number of streaming multiprocessors of the current device (cached per device).
int sm_count();

// Relaxed stream capture mode for a scope: an event query or synchronize from this thread must not
// invalidate a CUDA graph another thread captures (global mode is torch.cuda.graph's default: there,
// such a call from any thread not in relaxed mode fails and invalidates the capture). PyTorch's
// allocator skips its event queries during capture for the same reason.
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Makes dev current for a scope (CUDA calls act on the calling thread's current device).
class DeviceScope {
 public:
  explicit DeviceScope(int dev) {
    cudaGetDevice(&prev_);
    if (prev_ != dev) cudaSetDevice(dev);
  }
  ~DeviceScope() {
    int cur = prev_;
    cudaGetDevice(&cur);
    if (cur != prev_) cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = 0;
};

}  // namespace ringreduce::cuda
