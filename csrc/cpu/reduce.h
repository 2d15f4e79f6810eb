// Typed reduce/copy of spans on the CPU. Knows nothing about ranks or torch.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ring/types.h"

namespace ringreduce::cpu {

// dst[i] = a[i] op b[i] for i < n; dst may be the same pointer as a or b.
// fp16/bf16 are computed in fp32 and rounded once. Integer SUM/PROD wrap around.
// AVG reduces as SUM; when divisor > 1 the result is divided by it (the rank that finishes a chunk
// passes the world size): floats in their compute type, integers truncating toward zero (as NCCL).
void reduce(DType t, RedOp op, void* dst, const void* a, const void* b, int64_t n, int divisor = 1);

// dst[i] = ((src[0][i] op src[1][i]) op src[2][i]) ... for i < n: the sources in the order given,
// accumulated in the dtype's accumulation type (fp16/bf16: fp32) and rounded once; AVG divides that
// sum by divisor (when > 1) before the rounding. nsrc == 1 copies. dst may be one of the sources
// (the same span, for an in-place call), never a partial overlap.
void reduce_rows(DType t, RedOp op, void* dst, const void* const* srcs, int nsrc, int64_t n,
                 int divisor = 1);

// dst[i] = src[i] / divisor, same rules as above (AVG on a single rank).
void divide(DType t, void* dst, const void* src, int64_t n, int divisor);

// memcpy with non-temporal stores, then a store fence (so a later release store publishes the
// data): the lines go to memory instead of staying in this core's cache. For data another core
// reads next, where an ordinary store would first have to take the line from that core's cache.
void copy_stream(void* dst, const void* src, size_t n);

// fp16 <-> fp32 conversions (round to nearest even), exposed for tests.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);
float bf16_to_float(uint16_t h);
uint16_t float_to_bf16(float f);

}  // namespace ringreduce::cpu
