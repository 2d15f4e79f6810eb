#include "cpu/wire.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>

namespace ringreduce {

const char* wire_name(Wire w) {
  static const char* names[] = {"none", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"};
  return w < Wire::kCount ? names[static_cast<int>(w)] : "unknown";
}

size_t wire_elem_bytes(Wire w) { return w == Wire::BF16 || w == Wire::F16 ? 2 : 1; }

namespace cpu {
namespace {

#define RR_INLINE inline __attribute__((always_inline))

RR_INLINE uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
RR_INLINE float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// The two fp8 formats (OCP FP8: E4M3 without infinities, E5M2 with): mantissa bits, exponent
// bias, smallest normal exponent, largest finite value and its byte.
template <int M, int Bias, int Emin, uint8_t MaxByte>
struct Fp8 {
  static constexpr int kM = M;
  static constexpr uint32_t kMaxByte = MaxByte;
  static float max() { return from_bits(((MaxByte >> M) - Bias + 127u) << 23 | (MaxByte & ((1u << M) - 1)) << (23 - M)); }
  // RNE, saturating; branch-free so that the loops vectorize. |x| below the smallest normal: the
  // FPU rounds |x| + 2^(Emin - M + 23), whose ulp is the subnormal step; a subnormal that rounds
  // up to 2^Emin comes out as 2^M, the byte of 2^Emin.
  static RR_INLINE uint8_t encode(float x) {
    const uint32_t u = bits(x), sign = (u >> 24) & 0x80, a = u & 0x7fffffffu;
    const float magic = from_bits(static_cast<uint32_t>(Emin - M + 23 + 127) << 23);
    const uint32_t sub = bits(from_bits(a) + magic) - bits(magic);
    const uint32_t r = a + ((1u << (22 - M)) - 1) + ((a >> (23 - M)) & 1);
    const uint32_t nrm = (r >> (23 - M)) - (static_cast<uint32_t>(127 - Bias) << M);
    uint32_t b = a < (static_cast<uint32_t>(Emin + 127) << 23) ? sub : nrm;
    b = b > kMaxByte ? kMaxByte : b;
    return static_cast<uint8_t>(sign | b);
  }
  static float decode(uint8_t b) {
    const float sign = b & 0x80 ? -1.0f : 1.0f;
    const int e = (b & 0x7f) >> M, mant = b & ((1 << M) - 1);
    if (e == 0) return sign * std::ldexp(static_cast<float>(mant), Emin - M);
    if ((b & 0x7f) > MaxByte) return e == (0x7f >> M) && mant == 0 ? sign * INFINITY : NAN;
    return sign * std::ldexp(1.0f + static_cast<float>(mant) / (1 << M), e - Bias);
  }
};
using E4M3 = Fp8<3, 7, -6, 0x7e>;   // max 448
using E5M2 = Fp8<2, 15, -14, 0x7b>;  // max 57344

struct Lut {
  float e4m3[256], e5m2[256];
  Lut() {
    for (int b = 0; b < 256; ++b) {
      e4m3[b] = E4M3::decode(static_cast<uint8_t>(b));
      e5m2[b] = E5M2::decode(static_cast<uint8_t>(b));
    }
  }
};
const Lut lut;

RR_INLINE uint16_t to_bf16(float f) {
  const uint32_t x = bits(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1)) >> 16;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? (x >> 16) | 0x40 : rounded);
}
RR_INLINE float of_bf16(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }
// Finite fp32 values that round beyond 65504 in fp16 (>= 65520): they would become inf.
RR_INLINE int over_f16(float f) {
  const uint32_t a = bits(f) & 0x7fffffffu;
  return a >= 0x477ff000u && a < 0x7f800000u;
}

// A block of the source dtype as fp32 (fp32 itself is read in place).
RR_INLINE const float* load(DType t, const void* src, int64_t i, int64_t m, float* buf) {
  if (t == DType::F32) return static_cast<const float*>(src) + i;
  const uint16_t* s = static_cast<const uint16_t*>(src) + i;
  if (t == DType::BF16)
    for (int64_t k = 0; k < m; ++k) buf[k] = of_bf16(s[k]);
  else
    for (int64_t k = 0; k < m; ++k) buf[k] = half_to_float(s[k]);
  return buf;
}
RR_INLINE void store(DType t, const float* v, int64_t m, void* dst, int64_t i) {
  if (t == DType::F32) {
    float* d = static_cast<float*>(dst) + i;
    if (d != v) std::memcpy(d, v, m * 4);
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst) + i;
  if (t == DType::BF16)
    for (int64_t k = 0; k < m; ++k) d[k] = to_bf16(v[k]);
  else
    for (int64_t k = 0; k < m; ++k) d[k] = float_to_half(v[k]);
}

// One block (m <= kWireBlock elements) of fp32 onto the wire. fp16: F16C's rounding when compiled
// for it (the same RNE as float_to_half), counting the finite values that overflow.
template <class F>
RR_INLINE void fp8_block(const float* x, int64_t m, float* scale, uint8_t* q) {
  float amax = 0.0f;
  int nan = 0;
  for (int64_t k = 0; k < m; ++k) amax = std::max(amax, std::fabs(x[k]));
  for (int64_t k = 0; k < m; ++k) nan |= x[k] != x[k];  // std::max drops nan; torch's amax keeps it
  if (nan) amax = NAN;
  float inv = F::max() / amax, s = amax / F::max();
  if (!(amax <= FLT_MAX)) inv = 0.0f, s = NAN;   // inf or nan in the block: the block is nan
  else if (!(inv <= FLT_MAX)) inv = 0.0f, s = 0.0f;  // all zeros (or too small to scale): zeros
  *scale = s;
  for (int64_t k = 0; k < m; ++k) q[k] = F::encode(x[k] * inv);
}

RR_INLINE int64_t encode_block(Wire w, const float* x, int64_t m, int64_t blk, void* dst, int64_t nb,
                               int64_t i) {
  char* d = static_cast<char*>(dst);
  int64_t over = 0;
  switch (w) {
    case Wire::BF16: {
      uint16_t* o = reinterpret_cast<uint16_t*>(d) + i;
      for (int64_t k = 0; k < m; ++k) o[k] = to_bf16(x[k]);
      break;
    }
    case Wire::F16: {
      uint16_t* o = reinterpret_cast<uint16_t*>(d) + i;
      for (int64_t k = 0; k < m; ++k) over += over_f16(x[k]);
      for (int64_t k = 0; k < m; ++k) o[k] = float_to_half(x[k]);
      break;
    }
    case Wire::E4M3:
      fp8_block<E4M3>(x, m, reinterpret_cast<float*>(d) + blk,
                      reinterpret_cast<uint8_t*>(d + 4 * nb) + i);
      break;
    case Wire::E5M2:
      fp8_block<E5M2>(x, m, reinterpret_cast<float*>(d) + blk,
                      reinterpret_cast<uint8_t*>(d + 4 * nb) + i);
      break;
    default: break;
  }
  return over;
}

// Block blk of a wire span (nb blocks) as fp32 into v.
RR_INLINE void decode_block(Wire w, const void* src, int64_t m, int64_t blk, int64_t nb, int64_t i,
                            float* v) {
  const char* s = static_cast<const char*>(src);
  switch (w) {
    case Wire::BF16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(s) + i;
      for (int64_t k = 0; k < m; ++k) v[k] = of_bf16(h[k]);
      break;
    }
    case Wire::F16: {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(s) + i;
      for (int64_t k = 0; k < m; ++k) v[k] = half_to_float(h[k]);
      break;
    }
    case Wire::E4M3:
    case Wire::E5M2: {
      const float* table = w == Wire::E4M3 ? lut.e4m3 : lut.e5m2;
      float sc;
      std::memcpy(&sc, s + 4 * blk, 4);
      const uint8_t* q = reinterpret_cast<const uint8_t*>(s + 4 * nb) + i;
      for (int64_t k = 0; k < m; ++k) v[k] = table[q[k]] * sc;
      break;
    }
    default: break;
  }
}

RR_INLINE int64_t encode_impl(Wire w, DType t, const void* src, int64_t n, void* dst) {
  const int64_t nb = wire_blocks(n);
  alignas(64) float buf[kWireBlock];
  int64_t over = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i = b * kWireBlock, m = std::min(kWireBlock, n - i);
    over += encode_block(w, load(t, src, i, m, buf), m, b, dst, nb, i);
  }
  return over;
}

RR_INLINE void decode_impl(Wire w, const void* src, int64_t n, DType t, void* dst) {
  const int64_t nb = wire_blocks(n);
  alignas(64) float buf[kWireBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i = b * kWireBlock, m = std::min(kWireBlock, n - i);
    float* v = t == DType::F32 ? static_cast<float*>(dst) + i : buf;
    decode_block(w, src, m, b, nb, i, v);
    store(t, v, m, dst, i);
  }
}

RR_INLINE int64_t reduce_impl(Wire w, const void* const* srcs, int nsrc, int64_t n, int divisor,
                              void* wire_out, DType t, void* out) {
  const int64_t nb = wire_blocks(n);
  alignas(64) float acc[kWireBlock], tmp[kWireBlock];
  int64_t over = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i = b * kWireBlock, m = std::min(kWireBlock, n - i);
    decode_block(w, srcs[0], m, b, nb, i, acc);
    for (int q = 1; q < nsrc; ++q) {
      decode_block(w, srcs[q], m, b, nb, i, tmp);
      for (int64_t k = 0; k < m; ++k) acc[k] += tmp[k];
    }
    if (divisor > 1)
      for (int64_t k = 0; k < m; ++k) acc[k] /= static_cast<float>(divisor);
    if (wire_out) {
      over += encode_block(w, acc, m, b, wire_out, nb, i);
      decode_block(w, wire_out, m, b, nb, i, acc);
    }
    store(t, acc, m, out, i);
  }
  return over;
}

// Two builds of each entry point: AVX2 (8 lanes) where the CPU has it, else the x86-64 baseline.
// No FMA in either, so q * scale + acc rounds twice, as the torch reference does.
#define RR_WIRE_VARIANT(SUFFIX, ATTR)                                                            \
  ATTR int64_t encode_##SUFFIX(Wire w, DType t, const void* src, int64_t n, void* dst) {          \
    return encode_impl(w, t, src, n, dst);                                                         \
  }                                                                                                \
  ATTR void decode_##SUFFIX(Wire w, const void* src, int64_t n, DType t, void* dst) {              \
    decode_impl(w, src, n, t, dst);                                                                \
  }                                                                                                \
  ATTR int64_t reduce_##SUFFIX(Wire w, const void* const* srcs, int nsrc, int64_t n, int divisor, \
                               void* wire_out, DType t, void* out) {                              \
    return reduce_impl(w, srcs, nsrc, n, divisor, wire_out, t, out);                               \
  }
RR_WIRE_VARIANT(base, )
#if defined(__x86_64__)
RR_WIRE_VARIANT(avx2, __attribute__((target("avx2,f16c"))))
const bool kAvx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
#define encode_avx2 encode_base
#define decode_avx2 decode_base
#define reduce_avx2 reduce_base
const bool kAvx2 = false;
#endif

}  // namespace

int64_t wire_encode(Wire w, DType t, const void* src, int64_t n, void* dst) {
  if (n <= 0) return 0;
  return kAvx2 ? encode_avx2(w, t, src, n, dst) : encode_base(w, t, src, n, dst);
}

void wire_decode(Wire w, const void* src, int64_t n, DType t, void* dst) {
  if (n <= 0) return;
  kAvx2 ? decode_avx2(w, src, n, t, dst) : decode_base(w, src, n, t, dst);
}

int64_t wire_reduce(Wire w, const void* const* srcs, int nsrc, int64_t n, int divisor,
                    void* wire_out, DType t, void* out) {
  if (n <= 0 || nsrc <= 0) return 0;
  return kAvx2 ? reduce_avx2(w, srcs, nsrc, n, divisor, wire_out, t, out)
               : reduce_base(w, srcs, nsrc, n, divisor, wire_out, t, out);
}

uint8_t float_to_fp8(Wire w, float x) { return w == Wire::E4M3 ? E4M3::encode(x) : E5M2::encode(x); }
float fp8_to_float(Wire w, uint8_t b) { return w == Wire::E4M3 ? lut.e4m3[b] : lut.e5m2[b]; }

}  // namespace cpu
}  // namespace ringreduce
