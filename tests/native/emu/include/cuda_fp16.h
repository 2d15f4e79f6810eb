// Emulated CUDA (tests only): __half and the conversions csrc/cuda/ and its tests use. Conversions
// go through the compiler's _Float16 (IEEE binary16, round to nearest even), not through
// csrc/cpu/reduce.cpp, so the CPU and emulated kernels are not checked against the same code.
#pragma once
#include <cstring>

#include "cuda_runtime.h"

struct __half_raw {
  unsigned short x;
};
struct __half {
  unsigned short __x;
  __half() = default;
  __half(const __half_raw& r) : __x(r.x) {}
  operator __half_raw() const { return {__x}; }
};

inline __half __ushort_as_half(unsigned short u) { return __half_raw{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.__x, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float v) {
  const _Float16 f = static_cast<_Float16>(v);
  unsigned short u;
  std::memcpy(&u, &f, 2);
  return __half_raw{u};
}
