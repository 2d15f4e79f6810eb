// Launchers of the nccl transport's reduce kernels (cuda/nccl/reduce.cu): a ring step's reduce of
// what arrived, and the direct algorithms' rank-order fold, on typed spans on a stream. Torch-free;
// also run by tests/native/test_cuda_reduce.cpp.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ring/call.h"

namespace ringreduce::cuda::nccl {

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

}  // namespace ringreduce::cuda::nccl
