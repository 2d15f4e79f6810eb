// The standalone reduce kernel (NCCL transport's "reduce what arrived" step, native tests).
#include <stdexcept>
#include <string>

#include "cuda/kernels.h"
#include "cuda/platform.cuh"
#include "cuda/reduce.cuh"

namespace ringreduce::cuda {

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error so the next call does not see it again
  throw RingError(std::string("ringreduce: CUDA error in ") + what + ": " + cudaGetErrorName(e) +
                  " (" + cudaGetErrorString(e) + ")");
}

int sm_count() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  int dev = 0;
  RR_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= kMaxDevices) dev = 0;
  if (cached[dev] == 0) {
    int n = 0;
    RR_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cached[dev] = n > 0 ? n : 1;
  }
  return cached[dev];
}

namespace {

// Blocks per SM of the standalone kernel: 2 x 512 threads keep enough 16-byte loads in flight to
// reach DRAM bandwidth on A100/H100 class parts (NVIDIA's guidance for streaming kernels: at least
// 1024 resident threads per SM); more only adds scheduling.
constexpr int kBlocksPerSm = 2;
// Elements of one block's part are a multiple of this, so every part after the first starts with
// the same alignment mod 16 bytes as the span (16 elements are >= 16 bytes for every dtype).
constexpr int64_t kPartQuantum = 16;
// A block gets at least this many bytes, so small spans do not launch many near-empty blocks.
constexpr int64_t kMinBytesPerBlock = 64 << 10;

template <class T, RedOp Op>
__global__ void __launch_bounds__(kThreads) reduce_kernel(T* d, const T* a, const T* b, int64_t n,
                                                          int div, int64_t per_block) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * per_block;
  if (begin >= n) return;
  const int64_t count = n - begin < per_block ? n - begin : per_block;
  span_op<T, Op, true>(d + begin, nullptr, a + begin, b + begin, count, div,
                       static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
}

}  // namespace

void launch_reduce(DType t, RedOp op, void* dst, const void* a, const void* b, int64_t n,
                   int divisor, cudaStream_t stream) {
  if (t >= DType::kCount || op >= RedOp::kCount)
    throw std::invalid_argument("ringreduce: launch_reduce: bad dtype or op code");
  if (n <= 0) return;
  const int64_t bytes = n * static_cast<int64_t>(dtype_size(t));
  int64_t blocks = (bytes + kMinBytesPerBlock - 1) / kMinBytesPerBlock;
  const int64_t max_blocks = static_cast<int64_t>(sm_count()) * kBlocksPerSm;
  if (blocks > max_blocks) blocks = max_blocks;
  int64_t per_block = (n + blocks - 1) / blocks;
  per_block = (per_block + kPartQuantum - 1) / kPartQuantum * kPartQuantum;
  blocks = (n + per_block - 1) / per_block;
  const int div = op == RedOp::Avg ? divisor : 1;
  dispatch_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(op, [&](auto optag) {
      constexpr auto kernel = &reduce_kernel<T, decltype(optag)::value>;
      RR_LAUNCH(kernel, static_cast<unsigned>(blocks), kThreads, stream, static_cast<T*>(dst),
                static_cast<const T*>(a), static_cast<const T*>(b), n, div, per_block);
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringreduce::cuda
