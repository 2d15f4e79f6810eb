// The nccl transport's defaults, CUDA-free, so that the module reads them in every build
// (ringreduce._C.CUDA_DEFAULTS: the policy's knobs start from them).
#pragma once
#include <cstddef>

namespace ringreduce::cuda::nccl {

// Staging per buffer (two alternate): chunks larger than this go through the ring in pieces.
// 16 MiB keeps NCCL's transfers far above its per-call latency (a few us, i.e. ~1 MB at
// NVLink speed) while costing 32 MiB per communicator.
constexpr size_t kDefaultStagingBytes = 16 << 20;

}  // namespace ringreduce::cuda::nccl
