// Device side of the narrow wire (csrc/cuda/p2p/sym_wire.cu): one element onto the wire and back,
// with the CPU kernels' arithmetic (ring/wire_scalar.h), so that a CUDA call gives the bits of the
// CPU's and of tests/reference.py. Included by .cu files only.
#pragma once
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ring/wire_scalar.h"
#include "cuda/reduce.cuh"

namespace ringreduce::cuda {

template <Wire W> struct WireElem { using E = uint8_t; };
template <> struct WireElem<Wire::BF16> { using E = uint16_t; };
template <> struct WireElem<Wire::F16> { using E = uint16_t; };
template <Wire W> using Fp8Of = std::conditional_t<W == Wire::E4M3, wire::E4M3, wire::E5M2>;

// No fused multiply-add (nvcc contracts a * b + c by default): q x scale, then + acc, each
// rounded, as the CPU kernels and the torch reference compute them.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }

// x onto the wire (fp8: x times its block's inv, ring/wire_scalar.h's fp8_scale).
template <Wire W>
__device__ __forceinline__ typename WireElem<W>::E wire_put(float x, float inv) {
  if constexpr (W == Wire::BF16) return wire::to_bf16(x);
  else if constexpr (W == Wire::F16) return __half_as_ushort(__float2half_rn(x));
  else return Fp8Of<W>::encode(mul_rn(x, inv));
}
// A wire element's value (fp8: times its block's scale).
template <Wire W>
__device__ __forceinline__ float wire_get(typename WireElem<W>::E e, float scale) {
  if constexpr (W == Wire::BF16) return wire::of_bf16(e);
  else if constexpr (W == Wire::F16) return __half2float(__ushort_as_half(e));
  else return mul_rn(Fp8Of<W>::value(e), scale);
}

// The wire type as a compile-time constant (float, fp16 and bf16 tensors only).
template <class F>
void dispatch_wire(Wire w, F&& f) {
  switch (w) {
    case Wire::BF16: return f(std::integral_constant<Wire, Wire::BF16>{});
    case Wire::F16: return f(std::integral_constant<Wire, Wire::F16>{});
    case Wire::E4M3: return f(std::integral_constant<Wire, Wire::E4M3>{});
    case Wire::E5M2: return f(std::integral_constant<Wire, Wire::E5M2>{});
    default: throw std::invalid_argument("ringreduce: unknown wire type");
  }
}
template <class F>
void dispatch_wire_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: return f(float{});
    case DType::F16: return f(F16{});
    case DType::BF16: return f(BF16{});
    default: throw std::invalid_argument(std::string("ringreduce: a narrow wire takes no ") + dtype_name(t) +
                                         " tensor (ring/types.h: wire_takes)");
  }
}

}  // namespace ringreduce::cuda
