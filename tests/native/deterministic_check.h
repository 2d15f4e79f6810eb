// Helpers of the native tests of deterministic mode (ringreduce::deterministic()) on the CUDA
// transports (test_p2p_deterministic.cpp: p2p; test_cuda_reduce.cpp: the fold kernel; test_nccl.cpp: nccl). The
// contract: every element of an all_reduce or reduce_scatter is the rank-order fold
// ((x0 op x1) op x2) ... in the accumulation type (fp16/bf16: fp32; integers: their own type,
// wrapping), AVG divided by the world size there, rounded once to the dtype. The references here are
// computed on the host from the element bits (cpu::half_to_float and friends), independently of the
// kernels; inputs are chosen so that rounding after every step, or another order (the ring's), gives
// other bits for some elements, and the tests assert that they do, so that they can fail.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda_check.h"
#include "ring/schedule.h"

// Sets ringreduce::deterministic() for a scope (the flag is process-wide).
struct DeterministicScope {
  bool prev;
  explicit DeterministicScope(bool on = true) : prev(rr::deterministic()) { rr::set_deterministic(on); }
  ~DeterministicScope() { rr::set_deterministic(prev); }
  DeterministicScope(const DeterministicScope&) = delete;
  DeterministicScope& operator=(const DeterministicScope&) = delete;
};

inline uint32_t det_hash(int64_t i, int rank, int salt) {
  uint32_t x = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(rank + 1) * 0x85EBCA77u ^
               static_cast<uint32_t>(salt) * 0xC2B2AE3Du;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  return x;
}

// Element i of rank's input, as a value exact in dtype t. Floats mix magnitudes around ulp(1) of
// the dtype: 1 + eps/2 + eps/2 is 1 + eps in fp32 but 1 rounded twice in fp16, and sums like
// (1 + eps/4) - 1 depend on the order. PROD stays near 1; integers wrap in their own type.
inline double det_value(rr::DType t, rr::RedOp op, int64_t i, int rank) {
  const uint32_t h = det_hash(i, rank, static_cast<int>(op));
  if (!rr::dtype_is_float(t)) {
    if (op == rr::RedOp::Prod) return static_cast<double>(h % 5) - (t == rr::DType::U8 ? 0 : 2);
    const int64_t v = static_cast<int64_t>(h % 256);
    return t == rr::DType::U8 ? static_cast<double>(v) : static_cast<double>(v - 128);
  }
  const double eps = t == rr::DType::F16 ? 0x1p-10 : t == rr::DType::BF16 ? 0x1p-7
                     : t == rr::DType::F32 ? 0x1p-23 : 0x1p-52;
  if (op == rr::RedOp::Prod) {
    const double p[] = {1 + eps, 1 - eps / 2, 1.5, 0.75, 1 + 3 * eps, 1 - eps, 1.25, 1 + 2 * eps};
    return p[h % 8];
  }
  const double v[] = {1.0, eps / 2, 3 * eps / 4, -1.0, eps / 4, 0.5, -eps / 2, 3.0,
                      eps / 2, 1.0, -eps / 4, 2.0 + 2 * eps, eps, -0.75, eps / 2, 1.0};
  return v[h % 16];
}

// Element bytes <-> the accumulation type, with the library's own host conversions.
inline double det_get(rr::DType t, const char* p) {
  uint16_t u;
  switch (t) {
    case rr::DType::F16: std::memcpy(&u, p, 2); return rr::cpu::half_to_float(u);
    case rr::DType::BF16: std::memcpy(&u, p, 2); return rr::cpu::bf16_to_float(u);
    default: return get(t, p);
  }
}
// acc rounded to the dtype: floats to nearest even (fp16/bf16 from their fp32 accumulator);
// integers wrap to their width.
inline void det_put(rr::DType t, char* p, double acc) {
  uint16_t u;
  switch (t) {
    case rr::DType::F16: u = rr::cpu::float_to_half(static_cast<float>(acc)); std::memcpy(p, &u, 2); break;
    case rr::DType::BF16: u = rr::cpu::float_to_bf16(static_cast<float>(acc)); std::memcpy(p, &u, 2); break;
    case rr::DType::F32: { const float f = static_cast<float>(acc); std::memcpy(p, &f, 4); break; }
    case rr::DType::F64: std::memcpy(p, &acc, 8); break;
    default: {  // two's complement: the low bytes of the 64-bit value
      const int64_t v = static_cast<int64_t>(acc);
      std::memcpy(p, &v, rr::dtype_size(t));
    }
  }
}

// a op b in the accumulation type of t (as the device's apply: MIN/MAX with the same operand
// order), rounded to that type: fp32 for fp32/fp16/bf16, fp64 for fp64, the dtype itself (wrapping)
// for integers. Values travel as doubles, which hold every one of them exactly.
inline double det_apply(rr::DType t, rr::RedOp op, double a, double b) {
  if (op == rr::RedOp::Min) return b < a ? b : a;
  if (op == rr::RedOp::Max) return a < b ? b : a;
  const bool prod = op == rr::RedOp::Prod;
  if (t == rr::DType::F64) return prod ? a * b : a + b;
  if (rr::dtype_is_float(t)) {
    const float x = static_cast<float>(a), y = static_cast<float>(b);
    return prod ? x * y : x + y;
  }
  const uint64_t x = static_cast<uint64_t>(static_cast<int64_t>(a)),
                 y = static_cast<uint64_t>(static_cast<int64_t>(b));
  const uint64_t w = prod ? x * y : x + y;
  switch (t) {  // wrap to the width, signed or not
    case rr::DType::I8: return static_cast<int8_t>(w);
    case rr::DType::U8: return static_cast<uint8_t>(w);
    case rr::DType::I32: return static_cast<int32_t>(w);
    default: return static_cast<double>(static_cast<int64_t>(w));
  }
}
inline double det_divide(rr::DType t, double acc, int n) {
  if (t == rr::DType::F64) return acc / n;
  if (rr::dtype_is_float(t)) return static_cast<float>(acc) / static_cast<float>(n);
  return static_cast<double>(static_cast<int64_t>(acc) / n);  // truncates toward zero
}

// The fold over xs (element bytes, in the order given) of dtype t: one rounding at the end (the
// contract), or (per_step) a rounding to the dtype after every step, as a chain of two-input
// reduces does (the ring's steps; AVG divides in the last step, before its rounding). Writes the
// dtype's bytes to out.
inline void det_fold(rr::DType t, rr::RedOp op, const std::vector<const char*>& xs, char* out,
                     bool per_step = false) {
  char tmp[8];
  auto round = [&](double v) {
    det_put(t, tmp, v);
    return det_get(t, tmp);
  };
  double acc = det_get(t, xs[0]);
  for (size_t q = 1; q < xs.size(); ++q) {
    acc = det_apply(t, op, acc, det_get(t, xs[q]));
    if (per_step && !(op == rr::RedOp::Avg && q + 1 == xs.size())) acc = round(acc);
  }
  if (op == rr::RedOp::Avg) acc = det_divide(t, acc, static_cast<int>(xs.size()));
  det_put(t, out, acc);
}

// How often the other references differ from the contract's, over the elements checked.
struct DetTeeth {
  int64_t elements = 0;
  int64_t per_step = 0;    // rounding to the dtype after every step
  int64_t ring_order = 0;  // each chunk folded from another rank on (the ring's order), per step
};

// After a collective of numel elements (in: the rank's input, host: what was written into it, one
// element more than numel, 0x5a past the data; got: the output read back, one element past it):
// nothing written past the output (past the whole input when in place), an out-of-place input
// untouched.
inline void expect_untouched(const std::vector<char>& got, int64_t out_n, size_t es, bool inplace,
                             const char* in, const std::vector<char>& host, int64_t numel,
                             const char* what, const char* coll, int r) {
  const char* past = &got[out_n * es];
  std::vector<char> tail(es);
  if (inplace) {
    RR_CUDA_CHECK(cudaMemcpy(tail.data(), in + numel * es, es, cudaMemcpyDeviceToHost));
    past = tail.data();
  }
  EXPECT(static_cast<unsigned char>(past[0]) == 0x5a, "%s: %s rank %d wrote past its output", what, coll, r);
  if (!inplace) {
    std::vector<char> back((numel + 1) * es);
    RR_CUDA_CHECK(cudaMemcpy(back.data(), in, (numel + 1) * es, cudaMemcpyDeviceToHost));
    EXPECT(back == host, "%s: %s rank %d modified its input", what, coll, r);
  }
}

// One all_reduce or reduce_scatter of numel elements on every rank, in place (reduce_scatter: the
// output is the rank's chunk of the input) or not; every rank's output must have exactly the bits of
// the rank-order fold, nothing past it written, an out-of-place input untouched.
inline void check_deterministic(std::vector<Rank>& ranks, rr::Coll coll, rr::DType t, rr::RedOp op,
                                int64_t numel, bool inplace, const char* what, DetTeeth* teeth) {
  const int n = static_cast<int>(ranks.size());
  const size_t es = rr::dtype_size(t);
  const bool rs = coll == rr::Coll::ReduceScatter;
  const int64_t m = numel / n, out_n = rs ? m : numel;
  std::vector<std::vector<char>> host(n);
  std::vector<std::unique_ptr<DevBuf>> ins, outs;
  std::vector<char*> in_p(n), out_p(n);
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(ranks[r].device));
    host[r].assign((numel + 1) * es, 0x5a);  // one element more: it must stay as it was
    for (int64_t i = 0; i < numel; ++i) put(t, &host[r][i * es], det_value(t, op, i, r));
    ins.push_back(std::make_unique<DevBuf>((numel + 1) * es));
    fill_on(ranks[r].stream, ins[r]->p, host[r]);  // on the rank's stream (cuda_check.h)
    in_p[r] = ins[r]->p;
    if (inplace) {
      outs.push_back(nullptr);
      out_p[r] = ins[r]->p + (rs ? r * m * es : 0);
    } else {
      outs.push_back(std::make_unique<DevBuf>((out_n + 1) * es));
      set_on(ranks[r].stream, outs[r]->p, 0x5a, (out_n + 1) * es);
      out_p[r] = outs[r]->p;
    }
  }
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(ranks[r].device));
    ranks[r].run({coll, t, op, numel, in_p[r], out_p[r]}, ranks[r].stream);
  }
  for (int r = 0; r < n; ++r) RR_CUDA_CHECK(cudaStreamSynchronize(ranks[r].stream));

  // The references, for the whole tensor.
  std::vector<char> want(numel * es), step(numel * es), ring(numel * es);
  std::vector<const char*> xs(n), rot(n);
  for (int64_t i = 0; i < numel; ++i) {
    for (int q = 0; q < n; ++q) xs[q] = &host[q][i * es];
    det_fold(t, op, xs, &want[i * es]);
    det_fold(t, op, xs, &step[i * es], true);
    // The ring folds chunk c from rank c + 1 on (ring::rs_send_chunk(c + 1, 0, n) == c).
    int c = 0;
    while (c + 1 < n && (rs ? (c + 1) * m : ringreduce::ring::chunk(numel, n, c + 1).begin) <= i) ++c;
    for (int q = 0; q < n; ++q) rot[q] = xs[(c + 1 + q) % n];
    det_fold(t, op, rot, &ring[i * es], true);
    if (teeth) {
      ++teeth->elements;
      teeth->per_step += std::memcmp(&want[i * es], &step[i * es], es) != 0;
      teeth->ring_order += std::memcmp(&want[i * es], &ring[i * es], es) != 0;
    }
  }
  for (int r = 0; r < n; ++r) {
    const std::string f = ranks[r].failure();
    EXPECT(f.empty(), "%s: rank %d failed: %s", what, r, f.c_str());
    std::vector<char> got((out_n + 1) * es);
    RR_CUDA_CHECK(cudaMemcpy(got.data(), out_p[r], (out_n + 1) * es, cudaMemcpyDeviceToHost));
    const int64_t shift = rs ? r * m : 0;
    for (int64_t i = 0; i < out_n; ++i) {
      const int64_t gi = i + shift;
      if (std::memcmp(&got[i * es], &want[gi * es], es) != 0) {
        EXPECT(false, "%s: %s n=%d %s %s numel=%lld%s rank %d element %lld: got %.17g want %.17g "
               "(per-step rounding %.17g, ring order %.17g)", what, rr::coll_name(coll), n,
               rr::dtype_name(t), rr::op_name(op), (long long)numel, inplace ? " in place" : "", r,
               (long long)gi, det_get(t, &got[i * es]), det_get(t, &want[gi * es]),
               det_get(t, &step[gi * es]), det_get(t, &ring[gi * es]));
        break;
      }
    }
    expect_untouched(got, out_n, es, inplace, ins[r]->p, host[r], numel, what, rr::coll_name(coll), r);
  }
}

// The deterministic sweep on one set of ranks: all_reduce and reduce_scatter, fp32/fp16/bf16/int8,
// SUM and AVG at every size (1 element, odd sizes, sizes of many slices or pieces), PROD (fp16) and
// MIN (bf16) at one size. Returns the number of collectives checked.
inline int deterministic_sweep(std::vector<Rank>& ranks, const std::vector<int64_t>& sizes,
                               const char* what, DetTeeth* teeth16, DetTeeth* teeth32) {
  const int n = static_cast<int>(ranks.size());
  int cases = 0;
  for (rr::Coll coll : {rr::Coll::AllReduce, rr::Coll::ReduceScatter})
    for (rr::DType t : {rr::DType::F32, rr::DType::F16, rr::DType::BF16, rr::DType::I8})
      for (rr::RedOp op : {rr::RedOp::Sum, rr::RedOp::Avg})
        for (size_t k = 0; k < sizes.size(); ++k) {
          // reduce_scatter: sizes[k] elements per rank. In place and not, alternately.
          const bool rs = coll == rr::Coll::ReduceScatter;
          const int64_t numel = rs ? sizes[k] * n : sizes[k];
          DetTeeth* teeth = t == rr::DType::F32 ? teeth32 : t == rr::DType::I8 ? nullptr : teeth16;
          check_deterministic(ranks, coll, t, op, numel, (k + static_cast<size_t>(op)) % 2 == 0, what,
                              teeth);
          ++cases;
        }
  const int64_t big = *std::max_element(sizes.begin(), sizes.end());
  check_deterministic(ranks, rr::Coll::AllReduce, rr::DType::F16, rr::RedOp::Prod, big, true, what, nullptr);
  check_deterministic(ranks, rr::Coll::ReduceScatter, rr::DType::BF16, rr::RedOp::Min, big * n, false,
                      what, nullptr);
  return cases + 2;
}

// What the sweeps' inputs must show at world >= 3 (at 2 every order and rounding agree: x0 op x1
// rounded once): fp16/bf16 SUM/AVG differ under per-step rounding, fp32 under the ring's order.
inline void expect_teeth(const DetTeeth& t16, const DetTeeth& t32, const char* what) {
  EXPECT(t16.per_step > 0 && t16.ring_order > 0,
         "%s: fp16/bf16 inputs never round differently per step (%lld) or in ring order (%lld) of "
         "%lld elements: the test could not fail", what, (long long)t16.per_step,
         (long long)t16.ring_order, (long long)t16.elements);
  EXPECT(t32.ring_order > 0, "%s: fp32 inputs never round differently in ring order (of %lld "
         "elements): the test could not fail", what, (long long)t32.elements);
  std::printf("%s: per-step rounding differs on %lld of %lld fp16/bf16 elements, ring order on %lld; "
              "fp32 ring order on %lld of %lld\n", what, (long long)t16.per_step,
              (long long)t16.elements, (long long)t16.ring_order, (long long)t32.ring_order,
              (long long)t32.elements);
}
