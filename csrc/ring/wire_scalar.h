// The narrow wire's scalar arithmetic, shared by the CPU kernels (cpu/wire.cpp) and the CUDA kernel
// (cuda/wire.cuh), so that both round every element alike: bf16 and fp8 encodes (round to nearest
// even, fp8 saturating), an fp8 block's scale, fp8 bytes back to floats. Header-only.
#pragma once
#include <cfloat>
#include <cstdint>

#if defined(__CUDACC__)
#define RR_WIRE_INLINE __host__ __device__ __forceinline__
#else
#define RR_WIRE_INLINE inline __attribute__((always_inline))
#endif

namespace ringreduce::wire {

RR_WIRE_INLINE uint32_t bits(float f) { uint32_t u; __builtin_memcpy(&u, &f, 4); return u; }
RR_WIRE_INLINE float from_bits(uint32_t u) { float f; __builtin_memcpy(&f, &u, 4); return f; }

// The two fp8 formats (OCP FP8: E4M3 without infinities, E5M2 with): mantissa bits, exponent
// bias, smallest normal exponent, largest finite value and its byte.
template <int M, int Bias, int Emin, uint8_t MaxByte>
struct Fp8 {
  static constexpr int kM = M;
  static constexpr uint32_t kMaxByte = MaxByte;
  static constexpr int kMagicBits = (Emin - M + 23 + 127) << 23;  // 2^(Emin - M + 23)
  static constexpr int kMinNormalBits = (Emin + 127) << 23;       // 2^Emin
  static constexpr int kRebias = (127 - Bias) << M;
  static RR_WIRE_INLINE float max() {
    return from_bits(((MaxByte >> M) - Bias + 127u) << 23 | (MaxByte & ((1u << M) - 1)) << (23 - M));
  }
  // RNE, saturating; branch-free so that the CPU loops vectorize. |x| below the smallest normal:
  // the FPU rounds |x| + 2^(Emin - M + 23), whose ulp is the subnormal step; a subnormal that
  // rounds up to 2^Emin comes out as 2^M, the byte of 2^Emin.
  static RR_WIRE_INLINE uint8_t encode(float x) {
    const uint32_t u = bits(x), sign = (u >> 24) & 0x80, a = u & 0x7fffffffu;
    const float magic = from_bits(static_cast<uint32_t>(kMagicBits));
    const uint32_t sub = bits(from_bits(a) + magic) - bits(magic);
    const uint32_t r = a + ((1u << (22 - M)) - 1) + ((a >> (23 - M)) & 1);
    const uint32_t nrm = (r >> (23 - M)) - (static_cast<uint32_t>(127 - Bias) << M);
    const uint32_t is_sub = 0u - static_cast<uint32_t>(a < static_cast<uint32_t>(kMinNormalBits));
    uint32_t b = (sub & is_sub) | (nrm & ~is_sub);
    const uint32_t big = 0u - static_cast<uint32_t>(b > kMaxByte);  // masks: the loop vectorizes
    b = (kMaxByte & big) | (b & ~big);
    return static_cast<uint8_t>(sign | b);
  }
  // The byte's value, exactly (the encoder never makes E4M3's nan bytes 0x7f / 0xff).
  static RR_WIRE_INLINE float value(uint8_t b) {
    const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24, e = (b & 0x7f) >> M, m = b & ((1u << M) - 1);
    if (e == 0) return from_bits(sign | bits(static_cast<float>(m) * from_bits(static_cast<uint32_t>(Emin - M + 127) << 23)));
    if ((b & 0x7f) > MaxByte) return from_bits(sign | (e == (0x7fu >> M) && m == 0 ? 0x7f800000u : 0x7fc00000u));
    return from_bits(sign | (e - Bias + 127) << 23 | m << (23 - M));
  }
};
using E4M3 = Fp8<3, 7, -6, 0x7e>;   // max 448
using E5M2 = Fp8<2, 15, -14, 0x7b>;  // max 57344

// An fp8 block's scale from the bits of its largest magnitude (above 0x7f800000: a nan in the
// block, as torch's amax): scale = absmax / max and the multiplier inv = max / absmax; an inf or
// nan in the block makes it nan (scale nan); all zeros, or too small to scale, zeros (scale 0).
template <class F>
RR_WIRE_INLINE void fp8_scale(uint32_t amax_bits, float* inv, float* scale) {
  const float amax = amax_bits > 0x7f800000u ? from_bits(0x7fc00000u) : from_bits(amax_bits);
  *inv = F::max() / amax;
  *scale = amax / F::max();
  if (!(amax <= FLT_MAX)) *inv = 0.0f, *scale = from_bits(0x7fc00000u);
  else if (!(*inv <= FLT_MAX)) *inv = 0.0f, *scale = 0.0f;
}

RR_WIRE_INLINE uint16_t to_bf16(float f) {
  const uint32_t x = bits(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1)) >> 16;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? (x >> 16) | 0x40 : rounded);
}
RR_WIRE_INLINE float of_bf16(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }
// Finite fp32 values that round beyond 65504 in fp16 (>= 65520): they would become inf.
RR_WIRE_INLINE int over_f16(float f) {
  const uint32_t a = bits(f) & 0x7fffffffu;
  return a >= 0x477ff000u && a < 0x7f800000u;
}

}  // namespace ringreduce::wire
