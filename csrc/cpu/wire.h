// A narrow wire with a wide sum (rr.all_reduce(..., wire_dtype=)): each rank's contribution is
// rounded to the wire type once, every element is summed in fp32 in rank order, and the sum is
// rounded once more for the all-gather. Typed spans only; knows nothing about ranks or torch.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cpu/reduce.h"

namespace ringreduce {

namespace cpu {

// Rounds n elements of src (dtype t: F32, F16 or BF16) onto the wire span dst, blocks from
// src[0]. fp8: scale = absmax / max, q = round(x * (max / absmax)); a block whose max / absmax is
// not finite (all zeros, or absmax below max / FLT_MAX) is all zeros with scale 0. Returns how many
// elements did not fit: fp16 values that round beyond 65504 (they become inf); 0 otherwise.
int64_t wire_encode(Wire w, DType t, const void* src, int64_t n, void* dst);

// dst (dtype t) = the values of the wire span src (fp8: q * scale in fp32), rounded to t.
void wire_decode(Wire w, const void* src, int64_t n, DType t, void* dst);

// The fold: acc = ((v0 + v1) + v2) ... in fp32 over the nsrc wire spans in the order given (v: a
// span's values as wire_decode gives them), acc / divisor when divisor > 1. wire_out non-null
// (all-reduce): acc rounded to the wire into wire_out, and out gets those rounded values (so the
// rank that reduced a chunk holds the same bits as the ranks that decode it); null (reduce-scatter):
// out gets acc. out is rounded to t. Returns encode's count for the rounding into wire_out.
int64_t wire_reduce(Wire w, const void* const* srcs, int nsrc, int64_t n, int divisor,
                    void* wire_out, DType t, void* out);

// The fp8 byte of x (RNE, saturated to the largest finite value) and back; exposed for tests.
uint8_t float_to_fp8(Wire w, float x);
float fp8_to_float(Wire w, uint8_t b);

}  // namespace cpu
}  // namespace ringreduce
