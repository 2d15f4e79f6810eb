// The nccl transport's reduce kernels (reduce.h): a ring step's "reduce what arrived", and the
// direct algorithms' rank-order fold of every rank's piece, over the device reductions every
// transport shares (cuda/reduce.cuh). Also run by the native tests.
#include <stdexcept>
#include <string>

#include "cuda/host.h"
#include "cuda/nccl/reduce.h"
#include "cuda/shape.h"
#include "cuda/platform.cuh"
#include "cuda/reduce.cuh"

namespace ringreduce::cuda::nccl {

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

// Every rank's piece in rank order (launch_reduce_ranks): rank own's at own, the others' at
// slots + k * stride elements, k = q (q < own) or q - 1 (q > own).
template <class T, RedOp Op>
__global__ void __launch_bounds__(kThreads) fold_kernel(T* d, const T* own, int own_rank,
                                                        const T* slots, int64_t stride, int nranks,
                                                        int64_t n, int div, int64_t per_block) {
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * per_block;
  if (begin >= n) return;
  const int64_t count = n - begin < per_block ? n - begin : per_block;
  auto src = [=](int q) {
    return q == own_rank ? own + begin : slots + (q < own_rank ? q : q - 1) * stride + begin;
  };
  T* dst = d + begin;
  span_fold<T, Op>(&dst, 1, src, nranks, count, div, static_cast<int>(threadIdx.x),
                   static_cast<int>(blockDim.x));
}

// Blocks and elements per block of a kernel over n elements of es bytes: parts of a multiple of
// kPartQuantum elements, at least kMinBytesPerBlock each, at most kBlocksPerSm per SM.
void split(int64_t n, size_t es, int64_t* blocks, int64_t* per_block) {
  const int64_t bytes = n * static_cast<int64_t>(es);
  int64_t b = (bytes + kMinBytesPerBlock - 1) / kMinBytesPerBlock;
  const int64_t max_blocks = static_cast<int64_t>(sm_count()) * kBlocksPerSm;
  if (b > max_blocks) b = max_blocks;
  int64_t per = (n + b - 1) / b;
  per = (per + kPartQuantum - 1) / kPartQuantum * kPartQuantum;
  *per_block = per;
  *blocks = (n + per - 1) / per;
}

}  // namespace

void launch_reduce_ranks(DType t, RedOp op, void* dst, const void* own, int own_rank,
                         const void* slots, size_t slot_bytes, int nranks, int64_t n, int divisor,
                         cudaStream_t stream) {
  const size_t es = t < DType::kCount ? dtype_size(t) : 0;
  if (es == 0 || op >= RedOp::kCount || nranks < 1 || own_rank < 0 || own_rank >= nranks ||
      slot_bytes % es)
    throw std::invalid_argument("ringreduce: launch_reduce_ranks: bad dtype, op, rank or slot size");
  if (n <= 0) return;
  int64_t blocks = 0, per_block = 0;
  split(n, es, &blocks, &per_block);
  const int div = op == RedOp::Avg ? divisor : 1;
  const int64_t stride = static_cast<int64_t>(slot_bytes / es);
  dispatch_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(op, [&](auto optag) {
      constexpr auto kernel = &fold_kernel<T, decltype(optag)::value>;
      RR_LAUNCH(kernel, static_cast<unsigned>(blocks), kThreads, stream, static_cast<T*>(dst),
                static_cast<const T*>(own), own_rank, static_cast<const T*>(slots), stride, nranks,
                n, div, per_block);
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

void launch_reduce(DType t, RedOp op, void* dst, const void* a, const void* b, int64_t n,
                   int divisor, cudaStream_t stream) {
  if (t >= DType::kCount || op >= RedOp::kCount)
    throw std::invalid_argument("ringreduce: launch_reduce: bad dtype or op code");
  if (n <= 0) return;
  int64_t blocks = 0, per_block = 0;
  split(n, dtype_size(t), &blocks, &per_block);
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

}  // namespace ringreduce::cuda::nccl
