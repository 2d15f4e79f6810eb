#include "cpu/wire.h"
#include "ring/wire_scalar.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ringreduce {

namespace cpu {
namespace {

#define RR_INLINE inline __attribute__((always_inline))

using wire::bits;
using wire::from_bits;
using wire::E4M3;
using wire::E5M2;
using wire::to_bf16;
using wire::of_bf16;
using wire::over_f16;

struct Lut {
  float e4m3[256], e5m2[256];
  Lut() {
    for (int b = 0; b < 256; ++b) {
      e4m3[b] = E4M3::value(static_cast<uint8_t>(b));
      e5m2[b] = E5M2::value(static_cast<uint8_t>(b));
    }
  }
};
const Lut lut;

// fp16 <-> fp32 for a block: F16C (one instruction per 8) in the AVX2 build, else scalar. Not
// inline: an intrinsic may only be inlined into a function compiled for its instruction set.
#if defined(__x86_64__)
__attribute__((target("avx2,f16c"))) void h2f_f16c(const uint16_t* s, float* d, int64_t m) {
  int64_t k = 0;
  for (; k + 8 <= m; k += 8)
    _mm256_storeu_ps(d + k, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k))));
  for (; k < m; ++k) d[k] = half_to_float(s[k]);
}
__attribute__((target("avx2,f16c"))) void f2h_f16c(const float* s, uint16_t* d, int64_t m) {
  int64_t k = 0;
  for (; k + 8 <= m; k += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + k),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + k), _MM_FROUND_TO_NEAREST_INT));
  for (; k < m; ++k) d[k] = float_to_half(s[k]);
}
// bf16 of 8 floats (RNE, nan quieted) in the low halves of 32-bit lanes.
__attribute__((target("avx2"), always_inline)) inline __m256i bf16_of8(__m256i x) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(r, quiet, nan);
}
// d = bf16 of s; kept (when not null) = the values sent, as floats (the reduce keeps them).
__attribute__((target("avx2"))) void f2bf_avx2(const float* s, uint16_t* d, float* kept, int64_t m) {
  int64_t k = 0;
  for (; k + 16 <= m; k += 16) {
    const __m256i a = bf16_of8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + k)));
    const __m256i b = bf16_of8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + k + 8)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + k),
                        _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8));
    if (kept) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(kept + k), _mm256_slli_epi32(a, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(kept + k + 8), _mm256_slli_epi32(b, 16));
    }
  }
  for (; k < m; ++k) {
    d[k] = to_bf16(s[k]);
    if (kept) kept[k] = of_bf16(d[k]);
  }
}
// fp8 bytes of x * inv for 8 floats (F::encode's arithmetic), in the low bytes of 32-bit lanes.
template <class F>
__attribute__((target("avx2"), always_inline)) inline __m256i fp8_of8(__m256 y) {
  constexpr int M = F::kM;
  const __m256i u = _mm256_castps_si256(y);
  const __m256i sign = _mm256_srli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(INT32_MIN)), 24);
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i magic = _mm256_set1_epi32(F::kMagicBits);
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(magic))), magic);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(a, 23 - M), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(a, _mm256_add_epi32(lsb, _mm256_set1_epi32((1 << (22 - M)) - 1)));
  const __m256i nrm = _mm256_sub_epi32(_mm256_srli_epi32(r, 23 - M), _mm256_set1_epi32(F::kRebias));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(F::kMinNormalBits), a);
  const __m256i b = _mm256_min_epu32(_mm256_blendv_epi8(nrm, sub, is_sub), _mm256_set1_epi32(F::kMaxByte));
  return _mm256_or_si256(b, sign);
}
template <class F>
__attribute__((target("avx2"))) void f2fp8_avx2(const float* x, int64_t m, float inv, uint8_t* q) {
  const __m256 s = _mm256_set1_ps(inv);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int64_t k = 0;
  for (; k + 32 <= m; k += 32) {
    const __m256i b0 = fp8_of8<F>(_mm256_mul_ps(_mm256_loadu_ps(x + k), s));
    const __m256i b1 = fp8_of8<F>(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), s));
    const __m256i b2 = fp8_of8<F>(_mm256_mul_ps(_mm256_loadu_ps(x + k + 16), s));
    const __m256i b3 = fp8_of8<F>(_mm256_mul_ps(_mm256_loadu_ps(x + k + 24), s));
    const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(b0, b1), _mm256_packus_epi32(b2, b3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), _mm256_permutevar8x32_epi32(p, order));
  }
  for (; k < m; ++k) q[k] = F::encode(x[k] * inv);
}
// fp8 bytes -> q * sc by way of fp16, which holds every fp8 value: e5m2 is fp16's top byte; e4m3's
// exponent and mantissa shifted into fp16's are the value / 256 (subnormals too).
template <bool kE4M3, bool kAdd>
__attribute__((target("avx2,f16c"))) void fp8_to_f32_f16c(const uint8_t* q, float* v, int64_t m,
                                                          float sc) {
  const __m256 scale = _mm256_set1_ps(kE4M3 ? sc * 256.0f : sc);  // exact: a power of two
  int64_t k = 0;
  for (; k + 8 <= m; k += 8) {
    __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k)));
    b = kE4M3 ? _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                             _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7f)), 7))
              : _mm_slli_epi16(b, 8);
    const __m256 x = _mm256_mul_ps(_mm256_cvtph_ps(b), scale);
    _mm256_storeu_ps(v + k, kAdd ? _mm256_add_ps(_mm256_loadu_ps(v + k), x) : x);
  }
  for (; k < m; ++k) {
    const float x = (kE4M3 ? lut.e4m3 : lut.e5m2)[q[k]] * sc;
    v[k] = kAdd ? v[k] + x : x;
  }
}
#endif
template <bool kAvx2>
RR_INLINE void h2f(const uint16_t* s, float* d, int64_t m) {
#if defined(__x86_64__)
  if constexpr (kAvx2) return h2f_f16c(s, d, m);
#endif
  for (int64_t k = 0; k < m; ++k) d[k] = half_to_float(s[k]);
}
template <bool kAvx2>
RR_INLINE void f2h(const float* s, uint16_t* d, int64_t m) {
#if defined(__x86_64__)
  if constexpr (kAvx2) return f2h_f16c(s, d, m);
#endif
  for (int64_t k = 0; k < m; ++k) d[k] = float_to_half(s[k]);
}

// A block of the source dtype as fp32 (fp32 itself is read in place).
template <bool kAvx2>
RR_INLINE const float* load(DType t, const void* src, int64_t i, int64_t m, float* buf) {
  if (t == DType::F32) return static_cast<const float*>(src) + i;
  const uint16_t* s = static_cast<const uint16_t*>(src) + i;
  if (t == DType::BF16)
    for (int64_t k = 0; k < m; ++k) buf[k] = of_bf16(s[k]);
  else
    h2f<kAvx2>(s, buf, m);
  return buf;
}
template <bool kAvx2>
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
    f2h<kAvx2>(v, d, m);
}

// The bits of a block's largest |x| (above 0x7f800000: a nan, as torch's amax): the magnitudes'
// bits order like the values, and an integer max vectorizes where a float max with nan rules does not.
RR_INLINE uint32_t absmax_bits(const float* x, int64_t m) {
  uint32_t a = 0;
  for (int64_t k = 0; k < m; ++k) {
    const uint32_t b = bits(x[k]) & 0x7fffffffu;
    a = b > a ? b : a;
  }
  return a;
}

template <class F, bool kAvx2>
RR_INLINE void fp8_block(const float* x, int64_t m, float* scale, uint8_t* q) {
  float inv;
  wire::fp8_scale<F>(absmax_bits(x, m), &inv, scale);
#if defined(__x86_64__)
  if constexpr (kAvx2) return f2fp8_avx2<F>(x, m, inv, q);
#endif
  for (int64_t k = 0; k < m; ++k) q[k] = F::encode(x[k] * inv);
}

// A wire type's block operations; the span holds nb blocks, this block starts at element i.
template <Wire W, bool kAvx2>
struct Ops {
  // x (m <= kWireBlock floats) onto the wire; returns the fp16 overflows.
  static RR_INLINE int64_t encode(const float* x, int64_t m, int64_t blk, char* d, int64_t nb,
                                  int64_t i) {
    if constexpr (W == Wire::BF16) {
      uint16_t* o = reinterpret_cast<uint16_t*>(d) + i;
#if defined(__x86_64__)
      if constexpr (kAvx2) return f2bf_avx2(x, o, nullptr, m), 0;
#endif
      for (int64_t k = 0; k < m; ++k) o[k] = to_bf16(x[k]);
      return 0;
    } else if constexpr (W == Wire::F16) {
      int64_t over = 0;
      for (int64_t k = 0; k < m; ++k) over += over_f16(x[k]);
      f2h<kAvx2>(x, reinterpret_cast<uint16_t*>(d) + i, m);
      return over;
    } else {
      using F = std::conditional_t<W == Wire::E4M3, E4M3, E5M2>;
      fp8_block<F, kAvx2>(x, m, reinterpret_cast<float*>(d) + blk, reinterpret_cast<uint8_t*>(d + 4 * nb) + i);
      return 0;
    }
  }
  // acc onto the wire, and kept = the values sent (bf16: one pass).
  static RR_INLINE int64_t round(const float* acc, int64_t m, int64_t blk, char* d, int64_t nb,
                                 int64_t i, float* kept) {
#if defined(__x86_64__)
    if constexpr (W == Wire::BF16 && kAvx2)
      return f2bf_avx2(acc, reinterpret_cast<uint16_t*>(d) + i, kept, m), 0;
#endif
    const int64_t over = encode(acc, m, blk, d, nb, i);
    decode(d, m, blk, nb, i, kept);
    return over;
  }
  // acc (+)= the span's values: one pass per source.
  template <bool kAdd>
  static RR_INLINE void accumulate(const char* s, int64_t m, int64_t blk, int64_t nb, int64_t i,
                                   float* acc, float* tmp) {
    if constexpr (W == Wire::BF16) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(s) + i;
      for (int64_t k = 0; k < m; ++k) acc[k] = kAdd ? acc[k] + of_bf16(h[k]) : of_bf16(h[k]);
    } else if constexpr (wire_scaled(W) && kAvx2) {
#if defined(__x86_64__)
      float sc;
      std::memcpy(&sc, s + 4 * blk, 4);
      fp8_to_f32_f16c<W == Wire::E4M3, kAdd>(reinterpret_cast<const uint8_t*>(s + 4 * nb) + i, acc, m, sc);
#endif
    } else {
      decode(s, m, blk, nb, i, kAdd ? tmp : acc);
      if constexpr (kAdd)
        for (int64_t k = 0; k < m; ++k) acc[k] += tmp[k];
    }
  }
  static RR_INLINE void decode(const char* s, int64_t m, int64_t blk, int64_t nb, int64_t i, float* v) {
    if constexpr (W == Wire::BF16) {
      const uint16_t* h = reinterpret_cast<const uint16_t*>(s) + i;
      for (int64_t k = 0; k < m; ++k) v[k] = of_bf16(h[k]);
    } else if constexpr (W == Wire::F16) {
      h2f<kAvx2>(reinterpret_cast<const uint16_t*>(s) + i, v, m);
    } else {
      float sc;
      std::memcpy(&sc, s + 4 * blk, 4);
      const uint8_t* q = reinterpret_cast<const uint8_t*>(s + 4 * nb) + i;
#if defined(__x86_64__)
      if constexpr (kAvx2) return fp8_to_f32_f16c<W == Wire::E4M3, false>(q, v, m, sc);
#endif
      const float* table = W == Wire::E4M3 ? lut.e4m3 : lut.e5m2;
      for (int64_t k = 0; k < m; ++k) v[k] = table[q[k]] * sc;
    }
  }
};

template <Wire W, bool kAvx2>
RR_INLINE int64_t encode_impl(DType t, const void* src, int64_t n, void* dst) {
  if constexpr (!wire_scaled(W))  // no scales: one loop over the span (blocks cost ~40% here)
    if (t == DType::F32) return Ops<W, kAvx2>::encode(static_cast<const float*>(src), n, 0, static_cast<char*>(dst), 0, 0);
  const int64_t nb = wire_blocks(n);
  alignas(64) float buf[kWireBlock];
  int64_t over = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i = b * kWireBlock, m = std::min(kWireBlock, n - i);
    over += Ops<W, kAvx2>::encode(load<kAvx2>(t, src, i, m, buf), m, b, static_cast<char*>(dst), nb, i);
  }
  return over;
}

template <Wire W, bool kAvx2>
RR_INLINE void decode_impl(const void* src, int64_t n, DType t, void* dst) {
  if constexpr (!wire_scaled(W))
    if (t == DType::F32) return Ops<W, kAvx2>::decode(static_cast<const char*>(src), n, 0, 0, 0, static_cast<float*>(dst));
  const int64_t nb = wire_blocks(n);
  alignas(64) float buf[kWireBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i = b * kWireBlock, m = std::min(kWireBlock, n - i);
    float* v = t == DType::F32 ? static_cast<float*>(dst) + i : buf;
    Ops<W, kAvx2>::decode(static_cast<const char*>(src), m, b, nb, i, v);
    store<kAvx2>(t, v, m, dst, i);
  }
}

template <Wire W, bool kAvx2>
RR_INLINE int64_t reduce_impl(const void* const* srcs, int nsrc, int64_t n, int divisor,
                              void* wire_out, DType t, void* out) {
  using O = Ops<W, kAvx2>;
  // Unscaled wires have no blocks: longer pieces (the accumulator stays in L1).
  constexpr int64_t kPiece = wire_scaled(W) ? kWireBlock : 8 * kWireBlock;
  const int64_t nb = (n + kPiece - 1) / kPiece;
  alignas(64) float acc[kPiece], tmp[kPiece];
  int64_t over = 0;
  const float div = static_cast<float>(divisor);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i = b * kPiece, m = std::min(kPiece, n - i);
    O::template accumulate<false>(static_cast<const char*>(srcs[0]), m, b, nb, i, acc, tmp);
    for (int q = 1; q < nsrc; ++q)
      O::template accumulate<true>(static_cast<const char*>(srcs[q]), m, b, nb, i, acc, tmp);
    if (divisor > 1)
      for (int64_t k = 0; k < m; ++k) acc[k] /= div;
    // fp32 output: the values sent go straight into it.
    float* kept = t == DType::F32 ? static_cast<float*>(out) + i : tmp;
    if (wire_out) {
      over += O::round(acc, m, b, static_cast<char*>(wire_out), nb, i, kept);
      store<kAvx2>(t, kept, m, out, i);
    } else {
      store<kAvx2>(t, acc, m, out, i);
    }
  }
  return over;
}

// Two builds of each entry point: AVX2 (8 lanes) where the CPU has it, else the x86-64 baseline;
// the wire type a compile-time constant (one switch per call, not per block). No lambdas here: a
// lambda is a function of its own, compiled without the caller's target. No FMA in either build,
// so q * scale + acc rounds twice, as the torch reference does.
#define RR_BY_WIRE(...)                                    \
  switch (w) {                                             \
    case Wire::BF16: { constexpr Wire W = Wire::BF16; __VA_ARGS__; } \
    case Wire::F16: { constexpr Wire W = Wire::F16; __VA_ARGS__; }   \
    case Wire::E4M3: { constexpr Wire W = Wire::E4M3; __VA_ARGS__; } \
    default: { constexpr Wire W = Wire::E5M2; __VA_ARGS__; }         \
  }
#define RR_WIRE_VARIANT(SUFFIX, ATTR, AVX)                                                        \
  ATTR int64_t encode_##SUFFIX(Wire w, DType t, const void* src, int64_t n, void* dst) {          \
    RR_BY_WIRE(return encode_impl<W, AVX>(t, src, n, dst))                                         \
  }                                                                                                \
  ATTR void decode_##SUFFIX(Wire w, const void* src, int64_t n, DType t, void* dst) {              \
    RR_BY_WIRE(return decode_impl<W, AVX>(src, n, t, dst))                                         \
  }                                                                                                \
  ATTR int64_t reduce_##SUFFIX(Wire w, const void* const* srcs, int nsrc, int64_t n, int divisor, \
                               void* wire_out, DType t, void* out) {                              \
    RR_BY_WIRE(return reduce_impl<W, AVX>(srcs, nsrc, n, divisor, wire_out, t, out))               \
  }
RR_WIRE_VARIANT(base, , false)
#if defined(__x86_64__)
RR_WIRE_VARIANT(avx2, __attribute__((target("avx2,f16c"))), true)
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
