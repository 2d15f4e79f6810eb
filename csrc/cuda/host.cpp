// Host-side helpers over the CUDA runtime (host.h).
#include "cuda/host.h"

#include <string>

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

}  // namespace ringreduce::cuda
