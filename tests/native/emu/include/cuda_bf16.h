// Emulated CUDA (tests only): __nv_bfloat16 and its conversions (round to nearest even; NaN stays
// a quiet NaN of the same sign).
#pragma once
#include <cstdint>
#include <cstring>

#include "cuda_runtime.h"

struct __nv_bfloat16_raw {
  unsigned short x;
};
struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(const __nv_bfloat16_raw& r) : __x(r.x) {}
  operator __nv_bfloat16_raw() const { return {__x}; }
};

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16_raw{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline float __bfloat162float(__nv_bfloat16 h) {
  const uint32_t u = static_cast<uint32_t>(h.__x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16_raw{static_cast<unsigned short>((u >> 16) | 0x40)};
  const uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
  return __nv_bfloat16_raw{static_cast<unsigned short>(rounded >> 16)};
}
