// CPU kernels: fp16/bf16 conversions against exact expectations, every dtype x op against a scalar
// reference, odd lengths and unaligned starts.
#include <cmath>
#include <cstring>
#include <random>
#include <type_traits>
#include <vector>

#include "check.h"
#include "cpu/reduce.h"

using namespace ringreduce;

static void test_half_roundtrip() {
  // Every finite half converts to a float and back to itself.
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t exp = (h >> 10) & 0x1f;
    if (exp == 31 && (h & 0x3ff)) continue;  // nan payloads: only check they stay nan
    const uint16_t back = cpu::float_to_half(cpu::half_to_float(static_cast<uint16_t>(h)));
    CHECK(back == h, "half 0x%04x -> %g -> 0x%04x", h, cpu::half_to_float(h), back);
  }
  CHECK(std::isnan(cpu::half_to_float(cpu::float_to_half(NAN))), "nan");
  CHECK(cpu::float_to_half(65520.f) == 0x7c00, "65520 rounds to inf");
  CHECK(cpu::float_to_half(65504.f) == 0x7bff, "max half");
  CHECK(cpu::float_to_half(1.0f + 1.0f / 2048) == 0x3c00, "tie rounds to even (down)");
  CHECK(cpu::float_to_half(1.0f + 3.0f / 2048) == 0x3c02, "tie rounds to even (up)");
  CHECK(cpu::float_to_half(5.9604645e-8f) == 0x0001, "smallest subnormal");
  CHECK(cpu::float_to_half(2.9802322e-8f) == 0x0000, "half of smallest subnormal ties to zero");
  CHECK(cpu::bf16_to_float(cpu::float_to_bf16(1.0f)) == 1.0f, "bf16 one");
  CHECK(cpu::float_to_bf16(1.0f + 1.0f / 256) == 0x3f80, "bf16 tie to even");
  CHECK(cpu::float_to_bf16(1.0f + 3.0f / 256) == 0x3f82, "bf16 tie to even up");
}

template <class T>
static double ref_op(RedOp op, double a, double b) {
  switch (op) {
    case RedOp::Sum: case RedOp::Avg: return a + b;
    case RedOp::Prod: return a * b;
    case RedOp::Min: return std::min(a, b);
    case RedOp::Max: return std::max(a, b);
    default: return 0;
  }
}

// double -> T, wrapping for integers like the kernels do (a direct out-of-range cast is undefined).
template <class T>
static T cast(double e) {
  if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<int64_t>(e));
  else return static_cast<T>(e);
}

template <class T>
static void test_plain(DType t) {
  std::mt19937 rng(42);
  for (int op = 0; op < static_cast<int>(RedOp::kCount); ++op) {
    for (int64_t n : {0, 1, 7, 33, 1000, 4099}) {
      for (int off : {0, 1, 3}) {
        std::vector<T> a(n + off), b(n + off), d(n + off);
        for (int64_t i = 0; i < n + off; ++i) {
          a[i] = static_cast<T>(static_cast<int>(rng() % 11) - 5);
          b[i] = static_cast<T>(static_cast<int>(rng() % 11) - 5);
        }
        const int divisor = RedOp(op) == RedOp::Avg ? 3 : 1;
        cpu::reduce(t, RedOp(op), d.data() + off, a.data() + off, b.data() + off, n, divisor);
        for (int64_t i = off; i < n + off; ++i) {
          double e = ref_op<T>(RedOp(op), a[i], b[i]);
          T expect = cast<T>(e);
          if (divisor > 1) expect = static_cast<T>(cast<T>(e) / static_cast<T>(divisor));
          CHECK(d[i] == expect, "%s op %s n %lld i %lld: got %g want %g", dtype_name(t),
                op_name(RedOp(op)), (long long)n, (long long)i, (double)d[i], (double)expect);
        }
        // In place (dst == a) gives the same result.
        std::vector<T> a2 = a;
        cpu::reduce(t, RedOp(op), a2.data() + off, a2.data() + off, b.data() + off, n, divisor);
        CHECK(std::memcmp(a2.data() + off, d.data() + off, n * sizeof(T)) == 0, "in place %s",
              dtype_name(t));
      }
    }
  }
}

static void test_wrap() {
  int8_t a = 100, b = 100, d = 0;
  cpu::reduce(DType::I8, RedOp::Sum, &d, &a, &b, 1);
  CHECK(d == static_cast<int8_t>(200), "int8 sum wraps: %d", d);
  int32_t x = 2147483647, y = 1, z = 0;
  cpu::reduce(DType::I32, RedOp::Sum, &z, &x, &y, 1);
  CHECK(z == -2147483647 - 1, "int32 sum wraps: %d", z);
  int64_t p = -7, q = 2, r = 0;  // AVG on integers truncates toward zero
  cpu::reduce(DType::I64, RedOp::Avg, &r, &p, &q, 1, 2);
  CHECK(r == -2, "int64 avg truncates: %lld", (long long)r);
}

static void test_half_reduce(DType t) {
  auto to = [&](float f) { return t == DType::F16 ? cpu::float_to_half(f) : cpu::float_to_bf16(f); };
  auto from = [&](uint16_t h) { return t == DType::F16 ? cpu::half_to_float(h) : cpu::bf16_to_float(h); };
  for (int64_t n : {1, 7, 8, 9, 513, 2000}) {
    std::vector<uint16_t> a(n), b(n), d(n);
    for (int64_t i = 0; i < n; ++i) {
      a[i] = to(0.25f * static_cast<float>(i % 97) - 3.0f);
      b[i] = to(1.5f - 0.125f * static_cast<float>(i % 13));
    }
    for (int op = 0; op < static_cast<int>(RedOp::kCount); ++op) {
      const int divisor = RedOp(op) == RedOp::Avg ? 4 : 1;
      cpu::reduce(t, RedOp(op), d.data(), a.data(), b.data(), n, divisor);
      for (int64_t i = 0; i < n; ++i) {
        float e = static_cast<float>(ref_op<float>(RedOp(op), from(a[i]), from(b[i])));
        if (divisor > 1) e /= static_cast<float>(divisor);
        CHECK(d[i] == to(e), "%s %s i %lld: got %g want %g", dtype_name(t), op_name(RedOp(op)),
              (long long)i, from(d[i]), from(to(e)));
      }
    }
  }
}

// AVG divides by the world size, which need not fit the element type: int8 with 128 ranks and uint8
// with 256 or 300 ranks (cast to the element type, the divisor was -128, 0 and 44).
static void test_avg_wide_divisor() {
  struct Case { DType t; int64_t a, b; int divisor; int64_t want; };
  const Case cases[] = {
      {DType::I8, -64, -64, 128, -1},   {DType::I8, 100, 20, 128, 0},   {DType::I8, -60, -60, 200, 0},
      {DType::U8, 200, 50, 256, 0},     {DType::U8, 200, 50, 300, 0},   {DType::U8, 100, 100, 100, 2},
      {DType::I32, 3000, 3000, 129, 46}, {DType::I64, -5000, -5000, 256, -39},
  };
  for (const Case& c : cases) {
    const size_t es = dtype_size(c.t);
    std::vector<char> a(es * 3), b(es * 3), d(es * 3, 0x5a), q(es * 3, 0x5a);
    for (int i = 0; i < 3; ++i) {
      std::memcpy(&a[i * es], &c.a, es);  // little-endian: the low bytes hold the value
      std::memcpy(&b[i * es], &c.b, es);
    }
    cpu::reduce(c.t, RedOp::Avg, d.data(), a.data(), b.data(), 3, c.divisor);
    const int64_t sum = c.a + c.b;
    std::vector<char> s(es * 3);
    for (int i = 0; i < 3; ++i) std::memcpy(&s[i * es], &sum, es);
    cpu::divide(c.t, q.data(), s.data(), 3, c.divisor);
    for (int i = 0; i < 3; ++i) {
      int64_t got = 0, div = 0;
      std::memcpy(&got, &d[i * es], es);
      std::memcpy(&div, &q[i * es], es);
      if (c.t == DType::I8) got = static_cast<int8_t>(got), div = static_cast<int8_t>(div);
      if (c.t == DType::I32) got = static_cast<int32_t>(got), div = static_cast<int32_t>(div);
      CHECK(got == c.want, "%s AVG (%lld + %lld) / %d: got %lld want %lld", dtype_name(c.t),
            (long long)c.a, (long long)c.b, c.divisor, (long long)got, (long long)c.want);
      CHECK(div == c.want, "%s divide %lld / %d: got %lld want %lld", dtype_name(c.t),
            (long long)sum, c.divisor, (long long)div, (long long)c.want);
    }
  }
}

int main() {
  test_half_roundtrip();
  test_avg_wide_divisor();
  test_plain<float>(DType::F32);
  test_plain<double>(DType::F64);
  test_plain<int8_t>(DType::I8);
  test_plain<uint8_t>(DType::U8);
  test_plain<int32_t>(DType::I32);
  test_plain<int64_t>(DType::I64);
  test_wrap();
  test_half_reduce(DType::F16);
  test_half_reduce(DType::BF16);
  return finish("test_reduce");
}
