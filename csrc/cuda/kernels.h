// Launcher API of the CUDA reduce kernel (typed spans on a stream). Torch-free; used by
// the NCCL transport, the torch binding and tests/native/test_cuda_kernels.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ring/call.h"

namespace ringreduce::cuda {

// Throws RingError naming the failed call; CUDA errors are not recoverable for a communicator.
void check(cudaError_t e, const char* what);
#define RR_CUDA_CHECK(expr) ::ringreduce::cuda::check((expr), #expr)

// Threads per block of every kernel here: 512 is what NCCL's simple protocol uses per channel and
// keeps 16-byte loads of a whole block in flight (512 x 16 B x unroll 4 = 32 KiB per round).
constexpr int kThreads = 512;
// 16-byte loads each thread has in flight in the data loops (reduce.cuh), for elements of 4 bytes:
// the ring's span_op loads kUnroll of both its inputs, span_fold (direct algorithms) kUnroll of two
// sources at a time (of one where it copies). By Little's law a block moves at most kThreads x
// loads x 16 B per load latency.
constexpr int kUnroll = 4;
constexpr int kRingLoadsInFlight = 2 * kUnroll;
constexpr int kFoldLoadsInFlight = 2 * kUnroll;

// dst[i] = a[i] op b[i] (AVG: SUM, then divided by divisor when divisor > 1), i < n. fp16/bf16 are
// computed in fp32 and rounded once; integer SUM/PROD wrap; integer AVG truncates toward zero.
// The same element rules as cpu::reduce. dst may equal a or b. n == 0 launches nothing.
void launch_reduce(DType t, RedOp op, void* dst, const void* a, const void* b, int64_t n,
                   int divisor, cudaStream_t stream);

// The rank-order fold of the direct algorithms: dst[i] = ((x_0[i] op x_1[i]) op x_2[i]) ... op
// x_{nranks-1}[i], i < n, accumulated in the compute type (fp16/bf16: fp32) and rounded once (AVG:
// divided by divisor first), as span_fold: the bits of ringreduce::deterministic(), for any nranks,
// in one launch. x_own is at own; the other ranks' pieces lie in rank order at slots + k *
// slot_bytes (k = q, or q - 1 past own; slot_bytes a multiple of the element size). dst may equal
// own (in place).
void launch_reduce_ranks(DType t, RedOp op, void* dst, const void* own, int own_rank,
                         const void* slots, size_t slot_bytes, int nranks, int64_t n, int divisor,
                         cudaStream_t stream);

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
