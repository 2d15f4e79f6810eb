// The call vocabulary every layer shares: element types, reduction ops, the narrow wire, and their
// names and sizes. Header-only, torch-free, no CPU or CUDA code; the values are part of the message
// headers of every transport and of the Python binding (ringreduce/collectives.py).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ringreduce {

enum class DType : uint8_t { F32 = 0, F64, F16, BF16, I8, U8, I32, I64, kCount };
enum class RedOp : uint8_t { Sum = 0, Avg, Min, Max, Prod, kCount };

constexpr size_t dtype_size(DType t) {
  constexpr size_t sizes[] = {4, 8, 2, 2, 1, 1, 4, 8};
  return t < DType::kCount ? sizes[static_cast<int>(t)] : 0;
}
inline const char* dtype_name(DType t) {
  static const char* const names[] = {"float32", "float64", "float16", "bfloat16",
                                      "int8",    "uint8",   "int32",   "int64"};
  return t < DType::kCount ? names[static_cast<int>(t)] : "unknown";
}
inline const char* op_name(RedOp op) {
  static const char* const names[] = {"SUM", "AVG", "MIN", "MAX", "PRODUCT"};
  return op < RedOp::kCount ? names[static_cast<int>(op)] : "unknown";
}
constexpr bool dtype_is_float(DType t) { return t <= DType::BF16; }

// The narrow wire (rr.all_reduce(..., wire_dtype=)): the type a float tensor's values travel in
// between ranks, summed in fp32 (cpu/wire.h, cuda/wire.cuh).
enum class Wire : uint8_t { None = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4, kCount };

// Elements per block. fp8 carries one fp32 scale per block (absmax / the format's largest finite
// value), so a block is the unit of chunks and slices: its bits never depend on how a call is cut.
// 128 as DeepSeek-V3's fp8 training (1 x 128 tiles).
constexpr int64_t kWireBlock = 128;

inline const char* wire_name(Wire w) {
  static const char* const names[] = {"none", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"};
  return w < Wire::kCount ? names[static_cast<int>(w)] : "unknown";
}
// What a wire takes: tensors of float32, float16 and bfloat16, reduced by SUM or AVG. The one
// check of the API (binding/torch_types.h: to_wire; Python reads it as _C.WIRE_TENSOR_DTYPES).
constexpr bool wire_takes(DType t) { return t == DType::F32 || t == DType::F16 || t == DType::BF16; }
constexpr bool wire_takes(RedOp op) { return op == RedOp::Sum || op == RedOp::Avg; }
// The names of the dtypes a wire takes, in code order (Python: _C.WIRE_TENSOR_DTYPES).
inline std::vector<std::string> wire_dtype_names() {
  std::vector<std::string> d;
  for (int k = 0; k < static_cast<int>(DType::kCount); ++k)
    if (wire_takes(DType(k))) d.push_back(dtype_name(DType(k)));
  return d;
}
// What a wire takes, in words, from wire_takes: "float32, float16 or bfloat16 ... with SUM or AVG".
inline std::string wire_takes_text() {
  const std::vector<std::string> d = wire_dtype_names();
  std::vector<std::string> o;
  for (int k = 0; k < static_cast<int>(RedOp::kCount); ++k)
    if (wire_takes(RedOp(k))) o.push_back(op_name(RedOp(k)));
  auto join = [](const std::vector<std::string>& v) {
    std::string s;
    for (size_t i = 0; i < v.size(); ++i) s += (i == 0 ? "" : i + 1 == v.size() ? " or " : ", ") + v[i];
    return s;
  };
  return join(d) + " tensor with " + join(o);
}
constexpr size_t wire_elem_bytes(Wire w) { return w == Wire::BF16 || w == Wire::F16 ? 2 : 1; }
constexpr bool wire_scaled(Wire w) { return w == Wire::E4M3 || w == Wire::E5M2; }
constexpr int64_t wire_blocks(int64_t n) { return (n + kWireBlock - 1) / kWireBlock; }
// A span of n elements on the wire: fp8: [fp32 scale per block][n bytes]; else [n elements].
constexpr size_t wire_span_bytes(Wire w, int64_t n) {
  return (wire_scaled(w) ? 4 * wire_blocks(n) : 0) + n * wire_elem_bytes(w);
}
// Room for n elements when n is a whole number of blocks: what a slot holds per part.
constexpr size_t wire_block_bytes(Wire w) { return wire_span_bytes(w, kWireBlock); }

constexpr size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace ringreduce
