#include "cpu/reduce.h"
#include "ring/wire_scalar.h"

#include <algorithm>
#include <cstring>
#include <immintrin.h>
#include <type_traits>

namespace ringreduce {

namespace cpu {
using wire::bits;
using wire::from_bits;

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) return from_bits(sign | bits(static_cast<float>(mant) * 5.9604644775390625e-8f));
  if (exp == 31) return from_bits(sign | 0x7f800000u | (mant << 13));
  return from_bits(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t float_to_half(float f) {
  uint32_t x = bits(f);
  const uint32_t sign = (x >> 16) & 0x8000;
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return sign | 0x7c00 | (x > 0x7f800000u ? 0x200 : 0);  // inf, nan
  if (x >= 0x477ff000u) return sign | 0x7c00;               // rounds to >= 65536: inf
  if (x < 0x38800000u) {                                     // half subnormal: let the FPU round
    const float t = from_bits(x) + 0.5f;                     // ulp at 0.5 is 2^-24, half's step
    return static_cast<uint16_t>(sign | (bits(t) - 0x3f000000u));
  }
  x += 0xc8000fffu + ((x >> 13) & 1);                        // rebias exponent, round to even
  return static_cast<uint16_t>(sign | (x >> 13));
}

float bf16_to_float(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

uint16_t float_to_bf16(float f) {
  const uint32_t x = bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet nan
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

namespace {

// Conversion of blocks; fp16 uses the F16C instructions when the CPU has them.
__attribute__((target("avx2,f16c"))) void h2f_f16c(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  for (; i < n; ++i) d[i] = half_to_float(s[i]);
}
__attribute__((target("avx2,f16c"))) void f2h_f16c(const float* s, uint16_t* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) d[i] = float_to_half(s[i]);
}
const bool kHasF16C = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");

struct Half { uint16_t v; };
struct BF16 { uint16_t v; };

template <class T> struct IsHalf : std::false_type {};
template <> struct IsHalf<Half> : std::true_type {};
template <> struct IsHalf<BF16> : std::true_type {};

void to_float(const Half* s, float* d, int64_t n) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(s);
  if (kHasF16C) return h2f_f16c(u, d, n);
  for (int64_t i = 0; i < n; ++i) d[i] = half_to_float(u[i]);
}
void from_float(const float* s, Half* d, int64_t n) {
  uint16_t* u = reinterpret_cast<uint16_t*>(d);
  if (kHasF16C) return f2h_f16c(s, u, n);
  for (int64_t i = 0; i < n; ++i) u[i] = float_to_half(s[i]);
}
void to_float(const BF16* s, float* d, int64_t n) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(s);
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_float(u[i]);
}
void from_float(const float* s, BF16* d, int64_t n) {
  uint16_t* u = reinterpret_cast<uint16_t*>(d);
  for (int64_t i = 0; i < n; ++i) u[i] = float_to_bf16(s[i]);
}

// Integer SUM/PROD go through the unsigned type so that overflow wraps instead of being undefined.
template <class T> T add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}
template <class T> T mul(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;
    return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

// x / divisor. Integers divide in a wide type: the divisor (the world size) need not fit the element
// type (int8 with 128 ranks, uint8 with 256), so casting it there would divide by -128 or by zero.
template <class T> T divide_by(T x, int divisor) {
  if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<int64_t>(x) / divisor);
  else return x / static_cast<T>(divisor);
}

// Plain loops over one compute type; the compiler keeps them in SIMD registers (-O3).
template <class T>
void reduce_plain(RedOp op, T* d, const T* a, const T* b, int64_t n, int divisor) {
  switch (op) {
    case RedOp::Sum:
    case RedOp::Avg:
      for (int64_t i = 0; i < n; ++i) d[i] = add(a[i], b[i]);
      break;
    case RedOp::Prod:
      for (int64_t i = 0; i < n; ++i) d[i] = mul(a[i], b[i]);
      break;
    case RedOp::Min:
      for (int64_t i = 0; i < n; ++i) d[i] = b[i] < a[i] ? b[i] : a[i];
      break;
    case RedOp::Max:
      for (int64_t i = 0; i < n; ++i) d[i] = a[i] < b[i] ? b[i] : a[i];
      break;
    default:
      break;
  }
  if (op == RedOp::Avg && divisor > 1)
    for (int64_t i = 0; i < n; ++i) d[i] = divide_by(d[i], divisor);
}

// fp16/bf16: convert a block to fp32, reduce there, round once.
template <class H>
void reduce_half(RedOp op, H* d, const H* a, const H* b, int64_t n, int divisor) {
  constexpr int64_t kBlock = 512;  // two fp32 blocks of 2 KiB stay in L1
  alignas(64) float fa[kBlock], fb[kBlock];
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = std::min(kBlock, n - i);
    to_float(a + i, fa, m);
    to_float(b + i, fb, m);
    reduce_plain<float>(op, fa, fa, fb, m, divisor);
    from_float(fa, d + i, m);
  }
}

// Rank-order fold over nsrc sources, a block at a time: the accumulator stays in L1, every source
// is read once and dst written once (after the block's sources were read, so dst may alias one).
template <class T>
void rows_t(RedOp op, void* dst, const void* const* srcs, int nsrc, int64_t n, int divisor) {
  constexpr int64_t kBlock = 1024;
  using C = std::conditional_t<IsHalf<T>::value, float, T>;
  alignas(64) C acc[kBlock];
  [[maybe_unused]] alignas(64) float tmp[IsHalf<T>::value ? kBlock : 1];
  auto src = [&](int q, int64_t i) { return static_cast<const T*>(srcs[q]) + i; };
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t m = std::min(kBlock, n - i);
    if constexpr (IsHalf<T>::value) {
      to_float(src(0, i), acc, m);
      for (int q = 1; q < nsrc; ++q) {
        to_float(src(q, i), tmp, m);
        reduce_plain<float>(op, acc, acc, tmp, m, 1);
      }
      if (op == RedOp::Avg && divisor > 1)
        for (int64_t k = 0; k < m; ++k) acc[k] = divide_by(acc[k], divisor);
      from_float(acc, static_cast<T*>(dst) + i, m);
    } else {
      std::memcpy(acc, src(0, i), m * sizeof(T));
      for (int q = 1; q < nsrc; ++q) reduce_plain<T>(op, acc, acc, src(q, i), m, 1);
      if (op == RedOp::Avg && divisor > 1)
        for (int64_t k = 0; k < m; ++k) acc[k] = divide_by(acc[k], divisor);
      std::memcpy(static_cast<T*>(dst) + i, acc, m * sizeof(T));
    }
  }
}

template <class T>
void reduce_t(RedOp op, void* d, const void* a, const void* b, int64_t n, int divisor) {
  if constexpr (IsHalf<T>::value)
    reduce_half(op, static_cast<T*>(d), static_cast<const T*>(a), static_cast<const T*>(b), n, divisor);
  else
    reduce_plain(op, static_cast<T*>(d), static_cast<const T*>(a), static_cast<const T*>(b), n, divisor);
}

template <class F>
void dispatch(DType t, F&& f) {
  switch (t) {
    case DType::F32: return f(float{});
    case DType::F64: return f(double{});
    case DType::F16: return f(Half{});
    case DType::BF16: return f(BF16{});
    case DType::I8: return f(int8_t{});
    case DType::U8: return f(uint8_t{});
    case DType::I32: return f(int32_t{});
    case DType::I64: return f(int64_t{});
    default: return;
  }
}

}  // namespace

void reduce(DType t, RedOp op, void* dst, const void* a, const void* b, int64_t n, int divisor) {
  if (n <= 0) return;
  dispatch(t, [&](auto tag) { reduce_t<decltype(tag)>(op, dst, a, b, n, divisor); });
}

void reduce_rows(DType t, RedOp op, void* dst, const void* const* srcs, int nsrc, int64_t n,
                 int divisor) {
  if (n <= 0 || nsrc <= 0) return;
  dispatch(t, [&](auto tag) { rows_t<decltype(tag)>(op, dst, srcs, nsrc, n, divisor); });
}

void copy_stream(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const size_t head = std::min(n, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= 64; n -= 64, d += 64, s += 64)  // SSE2 is in every x86-64: no dispatch needed
    for (int k = 0; k < 64; k += 16)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + k),
                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + k)));
  std::memcpy(d, s, n);
  _mm_sfence();
#else
  std::memcpy(dst, src, n);
#endif
}

void divide(DType t, void* dst, const void* src, int64_t n, int divisor) {
  if (n <= 0) return;
  // MAX of x with itself is x; AVG with divisor applies the division only.
  dispatch(t, [&](auto tag) {
    using T = decltype(tag);
    reduce_t<T>(RedOp::Max, dst, src, src, n, 1);
    if (divisor > 1) {
      if constexpr (IsHalf<T>::value) {
        reduce_half(RedOp::Avg, static_cast<T*>(dst), static_cast<const T*>(dst),
                    static_cast<const T*>(dst), n, 2 * divisor);  // (x + x) / 2N in fp32: exact doubling
      } else {
        T* d = static_cast<T*>(dst);
        for (int64_t i = 0; i < n; ++i) d[i] = divide_by(d[i], divisor);
      }
    }
  });
}

}  // namespace cpu
}  // namespace ringreduce
