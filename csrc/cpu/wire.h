// A narrow wire with a wide sum (rr.all_reduce(..., wire_dtype=)): each rank's contribution is
// rounded to the wire type once, every element is summed in fp32 in rank order, and the sum is
// rounded once more for the all-gather. Typed spans only; knows nothing about ranks or torch.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cpu/reduce.h"

namespace ringreduce {

// Values are part of the message headers and of the Python binding.
enum class Wire : uint8_t { None = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4, kCount };

// Elements per block. fp8 carries one fp32 scale per block (absmax / the format's largest finite
// value), so a block is the unit of chunks and slices: its bits never depend on how a call is cut.
// 128 as in the issue (and DeepSeek-V3's fp8 training: 1 x 128 tiles).
constexpr int64_t kWireBlock = 128;

const char* wire_name(Wire w);
size_t wire_elem_bytes(Wire w);  // 2 (bf16, fp16) or 1 (fp8)
constexpr bool wire_scaled(Wire w) { return w == Wire::E4M3 || w == Wire::E5M2; }
inline int64_t wire_blocks(int64_t n) { return (n + kWireBlock - 1) / kWireBlock; }
// A span of n elements on the wire: fp8: [fp32 scale per block][n bytes]; else [n elements].
inline size_t wire_span_bytes(Wire w, int64_t n) {
  return (wire_scaled(w) ? 4 * wire_blocks(n) : 0) + n * wire_elem_bytes(w);
}
// Room for n elements when n is a whole number of blocks: what a slot holds per part.
inline size_t wire_block_bytes(Wire w) { return wire_span_bytes(w, kWireBlock); }

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
