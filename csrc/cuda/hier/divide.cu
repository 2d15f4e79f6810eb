// AVG's one division of the two-level plan (cuda/hier/endpoint.h: launch_divide), with the
// arithmetic of the other transports' last step (cuda/reduce.cuh's combine): in the compute type,
// integers in a wide type, truncating toward zero.
#include "cuda/hier/endpoint.h"
#include "cuda/host.h"
#include "cuda/reduce.cuh"

namespace ringreduce::cuda::hier {
namespace {

template <class T>
__global__ void __launch_bounds__(kThreads) divide_kernel(T* x, int64_t n, int divisor) {
  using N = Num<T>;
  using C = typename N::C;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    C c = N::up(load1(x + i));
    if constexpr (std::is_integral_v<C>) c = static_cast<C>(static_cast<int64_t>(c) / divisor);
    else c = c / static_cast<C>(divisor);
    store1(x + i, N::down(c));
  }
}

}  // namespace

void launch_divide(DType t, void* x, int64_t n, int divisor, cudaStream_t stream) {
  if (n <= 0 || divisor <= 1) return;
  const int64_t blocks = std::min<int64_t>((n + kThreads - 1) / kThreads, 1024);
  dispatch_dtype(t, [&](auto tag) {
    using T = decltype(tag);
    constexpr auto kernel = &divide_kernel<T>;
    RR_LAUNCH(kernel, static_cast<int>(blocks), kThreads, stream, static_cast<T*>(x), n, divisor);
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringreduce::cuda::hier
