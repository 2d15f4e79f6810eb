// The narrow wire between hosts of the two-level plan (hier/endpoint.h): a host's partial sums
// rounded onto the wire once, every host's rows folded in host order in float32 and rounded once
// more, the CPU's two-level wire bit for bit (ringreduce/_hier/two_level.py; fp8 blocks of 128
// from each row's start, rows on the tensor's grid of 128). A row is a workspace wire span
// (p2p/layout.h: workspace_wire_bytes), rounded and folded by p2p/wire_warp.cuh, as the
// workspace's own wire kernel does.
#include "cuda/hier/endpoint.h"
#include "cuda/p2p/wire_warp.cuh"

namespace ringreduce::cuda::hier {
namespace {

using p2p::WSpan;

// Kernel block b: row b / per_row, its part b % per_row of the row's cap wire blocks.
__device__ ring::Span row_part(int64_t cap, int per_row) {
  return ring::channel_part(ring::Span{0, cap}, per_row, static_cast<int>(blockIdx.x % per_row));
}

template <class T, Wire W>
__global__ void __launch_bounds__(kThreads) put_kernel(const T* rows, int64_t n, char* out, uint64_t row_bytes,
                                                      int per_row) {
  const int k = static_cast<int>(blockIdx.x / per_row);
  const int64_t cap = n / kWireBlock;
  p2p::put_part<T, W>(rows + k * n, n, row_part(cap, per_row), WSpan<W>{out + k * row_bytes, cap});
}

template <class T, Wire W>
__global__ void __launch_bounds__(kThreads) fold_kernel(const char* got, int nhosts, int nrows, int64_t n,
                                                       uint64_t row_bytes, T* out, int per_row) {
  const int k = static_cast<int>(blockIdx.x / per_row);
  const int64_t cap = n / kWireBlock;
  auto src = [&](int h) { return WSpan<W>{const_cast<char*>(got) + (h * nrows + k) * row_bytes, cap}; };
  const WSpan<W> nowhere{nullptr, cap};  // rounded once more; the values into out
  p2p::fold_part<T, W>(src, nhosts, n, row_part(cap, per_row), 1, &nowhere, out + k * n);
}

// Blocks per row: enough for the device, a tile of kBatch wire blocks per warp at least.
int per_row(int64_t n, int nrows) {
  const int64_t tiles = (n / kWireBlock + (kThreads / 32) * 4 - 1) / ((kThreads / 32) * 4);
  const int64_t want = std::max<int64_t>(1, 2 * std::max(1, sm_count()) / std::max(1, nrows));
  return static_cast<int>(std::max<int64_t>(1, std::min(tiles, want)));
}

template <class F>
void dispatch(DType t, Wire w, F&& f) {
  dispatch_wire_dtype(t, [&](auto tag) {
    dispatch_wire(w, [&](auto wtag) { f(tag, wtag); });
  });
}

}  // namespace

uint64_t wire_row_bytes(Wire w, int64_t n) {
  return p2p::workspace_wire_bytes(wire_scaled(w), wire_elem_bytes(w), n / kWireBlock);
}

void launch_wire_put(DType t, Wire w, const void* rows, int nrows, int64_t n, char* out, cudaStream_t stream) {
  if (n <= 0 || nrows <= 0) return;
  const int pr = per_row(n, nrows);
  dispatch(t, w, [&](auto tag, auto wtag) {
    using T = decltype(tag);
    constexpr auto kernel = &put_kernel<T, decltype(wtag)::value>;
    RR_LAUNCH_WARPS(kernel, pr * nrows, kThreads, stream, static_cast<const T*>(rows), n, out,
                    wire_row_bytes(w, n), pr);
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

void launch_wire_fold(DType t, Wire w, const char* got, int nhosts, int nrows, int64_t n, void* out,
                      cudaStream_t stream) {
  if (n <= 0 || nrows <= 0) return;
  const int pr = per_row(n, nrows);
  dispatch(t, w, [&](auto tag, auto wtag) {
    using T = decltype(tag);
    constexpr auto kernel = &fold_kernel<T, decltype(wtag)::value>;
    RR_LAUNCH_WARPS(kernel, pr * nrows, kThreads, stream, got, nhosts, nrows, n, wire_row_bytes(w, n),
                    static_cast<T*>(out), pr);
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringreduce::cuda::hier
