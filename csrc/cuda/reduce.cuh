// Device side of the kernels: typed reduce/copy of a span by one cooperating thread block, and the
// host-side dtype/op dispatch. Torch-free; included by the .cu files only.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "ring/types.h"
#include "cuda/shape.h"
#include "cuda/platform.cuh"

namespace ringreduce::cuda {

struct F16 { uint16_t bits; };
struct BF16 { uint16_t bits; };

// Compute type of each element type: fp16/bf16 in fp32 (rounded once, to nearest even), the rest
// in themselves.
template <class T> struct Num {
  using C = T;
  __device__ __forceinline__ static C up(T x) { return x; }
  __device__ __forceinline__ static T down(C x) { return x; }
};
template <> struct Num<F16> {
  using C = float;
  __device__ __forceinline__ static float up(F16 x) { return __half2float(__ushort_as_half(x.bits)); }
  __device__ __forceinline__ static F16 down(float x) { return {__half_as_ushort(__float2half_rn(x))}; }
};
template <> struct Num<BF16> {
  using C = float;
  __device__ __forceinline__ static float up(BF16 x) {
    return __bfloat162float(__ushort_as_bfloat16(x.bits));
  }
  __device__ __forceinline__ static BF16 down(float x) {
    return {__bfloat16_as_ushort(__float2bfloat16_rn(x))};
  }
};

// The operators, element for element as cpu::reduce: integer SUM/PROD wrap (through unsigned),
// MIN/MAX keep the same operand order so NaN handling matches too.
template <RedOp Op, class C>
__device__ __forceinline__ C apply(C a, C b) {
  if constexpr (Op == RedOp::Min) {
    return b < a ? b : a;
  } else if constexpr (Op == RedOp::Max) {
    return a < b ? b : a;
  } else if constexpr (std::is_integral_v<C>) {
    using U = std::conditional_t<(sizeof(C) < sizeof(unsigned)), unsigned, std::make_unsigned_t<C>>;
    if constexpr (Op == RedOp::Prod) return static_cast<C>(static_cast<U>(a) * static_cast<U>(b));
    else return static_cast<C>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    if constexpr (Op == RedOp::Prod) return a * b;
    else return a + b;
  }
}

// One element: a op b, divided by div when div > 1 (AVG on the rank that finishes a chunk).
template <class T, RedOp Op>
__device__ __forceinline__ T combine(T a, T b, int div) {
  using N = Num<T>;
  using C = typename N::C;
  C c = apply<Op>(N::up(a), N::up(b));
  if (div > 1) {
    // Integers divide in a wide type: the world size need not fit an int8 or uint8 (see cpu::reduce).
    if constexpr (std::is_integral_v<C>) c = static_cast<C>(static_cast<int64_t>(c) / div);
    else c = c / static_cast<C>(div);
  }
  return N::down(c);
}

// Scalar loads/stores through L2 (.cg): slots are reused and written by other processes, so
// nothing may be served from a stale L1 line.
template <int S> struct Word;
template <> struct Word<1> { using U = unsigned char; };
template <> struct Word<2> { using U = unsigned short; };
template <> struct Word<4> { using U = unsigned int; };
template <> struct Word<8> { using U = unsigned long long; };

template <class T>
__device__ __forceinline__ T load1(const T* p) {
  using U = typename Word<sizeof(T)>::U;
  const U u = __ldcg(reinterpret_cast<const U*>(p));
  T t;
  __builtin_memcpy(&t, &u, sizeof(T));
  return t;
}
template <class T>
__device__ __forceinline__ void store1(T* p, T t) {
  using U = typename Word<sizeof(T)>::U;
  U u;
  __builtin_memcpy(&u, &t, sizeof(T));
  __stcg(reinterpret_cast<U*>(p), u);
}

template <class T, RedOp Op>
__device__ __forceinline__ uint4 combine16(uint4 a, uint4 b, int div) {
  constexpr int K = 16 / sizeof(T);
  T x[K], y[K];
  __builtin_memcpy(x, &a, 16);
  __builtin_memcpy(y, &b, 16);
#pragma unroll
  for (int k = 0; k < K; ++k) x[k] = combine<T, Op>(x[k], y[k], div);
  uint4 r;
  __builtin_memcpy(&r, x, 16);
  return r;
}

// kUnroll (shape.h): 16-byte loads per input in flight per thread in the vector loops; four hide
// the latency of peer memory (NVLink/PCIe) better than one, as in NCCL's unrolled reduce/copy loops.

// Cooperative over threads [tid, nthreads) of one block:
//   kReduce: d0[i] = a[i] op b[i] (divided by div when div > 1), else d0[i] = a[i];
//   d1 (may be null) receives the same values, in the same pass.
// Vectorized (16 bytes) where all pointers share their alignment mod 16: scalar head up to the
// first aligned element, vector body, scalar tail. Otherwise element by element (still coalesced).
template <class T, RedOp Op, bool kReduce>
__device__ RR_NOINLINE void span_op(T* d0, T* d1, const T* a, const T* b, int64_t n, int div,
                                    int tid, int nthreads) {
  if (n <= 0) return;
  constexpr int K = 16 / sizeof(T);
  const uintptr_t m = reinterpret_cast<uintptr_t>(a) & 15;
  const bool same = m % sizeof(T) == 0 && (reinterpret_cast<uintptr_t>(d0) & 15) == m &&
                    (!kReduce || (reinterpret_cast<uintptr_t>(b) & 15) == m) &&
                    (d1 == nullptr || (reinterpret_cast<uintptr_t>(d1) & 15) == m);
  int64_t head = n;
  if (same) {
    head = static_cast<int64_t>(((16 - m) & 15) / sizeof(T));
    if (head > n) head = n;
  }
  const int64_t nv = (n - head) / K;
  auto one = [&](int64_t i) {
    const T v = kReduce ? combine<T, Op>(load1(a + i), load1(b + i), div) : load1(a + i);
    store1(d0 + i, v);
    if (d1) store1(d1 + i, v);
  };
  for (int64_t i = tid; i < head; i += nthreads) one(i);
  for (int64_t i = head + nv * K + tid; i < n; i += nthreads) one(i);
  if (nv == 0) return;

  const uint4* av = reinterpret_cast<const uint4*>(a + head);
  const uint4* bv = kReduce ? reinterpret_cast<const uint4*>(b + head) : nullptr;
  uint4* dv0 = reinterpret_cast<uint4*>(d0 + head);
  uint4* dv1 = d1 ? reinterpret_cast<uint4*>(d1 + head) : nullptr;
  int64_t i = tid;
  for (; i + (kUnroll - 1) * static_cast<int64_t>(nthreads) < nv; i += kUnroll * nthreads) {
    uint4 x[kUnroll], y[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) x[u] = __ldcg(av + i + u * nthreads);
    if constexpr (kReduce) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) y[u] = __ldcg(bv + i + u * nthreads);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      uint4 r = x[u];
      if constexpr (kReduce) r = combine16<T, Op>(x[u], y[u], div);
      __stcg(dv0 + i + u * nthreads, r);
      if (dv1) __stcg(dv1 + i + u * nthreads, r);
    }
  }
  for (; i < nv; i += nthreads) {
    uint4 r = __ldcg(av + i);
    if constexpr (kReduce) r = combine16<T, Op>(r, __ldcg(bv + i), div);
    __stcg(dv0 + i, r);
    if (dv1) __stcg(dv1 + i, r);
  }
}

// Cooperative over the threads of one block, for the direct algorithms:
//   v[i] = src(0)[i] op src(1)[i] op ... op src(ns-1)[i], in that order, accumulated in the compute
//   type and rounded once (divided by div when div > 1); ns == 1 copies. v[i] is stored to every
//   dst[0..nd). Sources in rank order give every rank the same bits, whatever the slicing.
// src: a callable, q -> const T* (so that any number of sources fits, computed where loaded: the
// nccl transport's from its slot layout, the p2p kernels' SlotSources and lambdas). dst may be one of the sources (the same
// address: each element is read before it is written, by the same thread), never a partial overlap.
// Vectorized (16 bytes) where every pointer has the same alignment mod 16, else element by element.
// dst: anything that dst[d] gives the d-th destination of (an array, or an object that computes
// it, so that pointers need not sit in an array in local memory).
template <class T, RedOp Op, class Src, class Dst>
__device__ void span_fold(Dst dst, int nd, Src src, int ns, int64_t n, int div, int tid,
                          int nthreads) {
  if (n <= 0) return;
  using N = Num<T>;
  using C = typename N::C;
  constexpr int K = 16 / sizeof(T);
  const uintptr_t m = reinterpret_cast<uintptr_t>(src(0)) & 15;
  bool same = m % sizeof(T) == 0;
  for (int q = 1; q < ns; ++q) same = same && (reinterpret_cast<uintptr_t>(src(q)) & 15) == m;
  for (int d = 0; d < nd; ++d) same = same && (reinterpret_cast<uintptr_t>(dst[d]) & 15) == m;
  int64_t head = n;
  if (same) {
    head = static_cast<int64_t>(((16 - m) & 15) / sizeof(T));
    if (head > n) head = n;
  }
  const int64_t nv = (n - head) / K;
  auto one = [&](int64_t i) {
    C acc = N::up(load1(src(0) + i));
    for (int q = 1; q < ns; ++q) acc = apply<Op>(acc, N::up(load1(src(q) + i)));
    if (div > 1) {
      if constexpr (std::is_integral_v<C>) acc = static_cast<C>(static_cast<int64_t>(acc) / div);
      else acc = acc / static_cast<C>(div);
    }
    const T v = N::down(acc);
    for (int d = 0; d < nd; ++d) store1(dst[d] + i, v);
  };
  for (int64_t i = tid; i < head; i += nthreads) one(i);
  for (int64_t i = head + nv * K + tid; i < n; i += nthreads) one(i);
  // U vector indices per thread per pass: U independent 16-byte loads of each source are in flight
  // before their arithmetic (one at a time left every load's latency exposed: the direct kernels
  // read peers' memory, whose latency is a link's), and those of source q + 1 are issued before
  // source q is folded: 2U loads in flight, two sources' loads per wait where there was one (nvcc
  // unrolls the loop by two and hoists both loads; sm_90 SASS checked). A copy (ns == 1) keeps U.
  // U keeps the accumulators near 32 registers.
  constexpr int U = K >= 16 ? kUnroll / 2 : kUnroll;
  auto finish = [&](C (&acc)[K]) {
    T x[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      C c = acc[k];
      if (div > 1) {
        if constexpr (std::is_integral_v<C>) c = static_cast<C>(static_cast<int64_t>(c) / div);
        else c = c / static_cast<C>(div);
      }
      x[k] = N::down(c);
    }
    uint4 v;
    __builtin_memcpy(&v, x, 16);
    return v;
  };
  auto vsrc = [&](int q) { return reinterpret_cast<const uint4*>(src(q) + head); };
  // One loop body for the whole vector part (the last pass predicated per lane): a second, plain
  // loop for the remainder made the kernels' build a third slower.
  for (int64_t i = tid; i < nv; i += U * static_cast<int64_t>(nthreads)) {
    bool in[U];
#pragma unroll
    for (int u = 0; u < U; ++u) in[u] = i + u * static_cast<int64_t>(nthreads) < nv;
    auto load = [&](uint4 (&x)[U], int q) {
      const uint4* sq = vsrc(q);
#pragma unroll
      for (int u = 0; u < U; ++u) x[u] = in[u] ? __ldcg(sq + i + u * nthreads) : uint4{};
    };
    C acc[U][K];
    uint4 v[U], w[U];
    load(v, 0);
    if (ns > 1) load(w, 1);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      T x[K];
      __builtin_memcpy(x, &v[u], 16);
#pragma unroll
      for (int k = 0; k < K; ++k) acc[u][k] = N::up(x[k]);
    }
    for (int q = 1; q < ns; ++q) {  // w: source q, in flight
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = w[u];
      if (q + 1 < ns) load(w, q + 1);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        T x[K];
        __builtin_memcpy(x, &v[u], 16);
#pragma unroll
        for (int k = 0; k < K; ++k) acc[u][k] = apply<Op>(acc[u][k], N::up(x[k]));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (!in[u]) continue;
      const uint4 r = finish(acc[u]);
      for (int d = 0; d < nd; ++d) __stcg(reinterpret_cast<uint4*>(dst[d] + head) + i + u * nthreads, r);
    }
  }
}

// The sources of a direct kernel's fold, computed where they are loaded (registers) rather than
// kept in an array (local memory, one more dependent load before each source's data): source q is
// `own` at q == own_at, else base + q * stride bytes (the slots of this rank's buffer).
template <class T>
struct SlotSources {
  const T* own;
  const char* base;
  uint64_t stride;
  int own_at;
  __device__ const T* operator()(int q) const {
    return q == own_at ? own : reinterpret_cast<const T*>(base + static_cast<uint64_t>(q) * stride);
  }
};

// span_fold for the p2p direct kernels, out of line (inlined at their call sites, the fold's
// unrolled body made the kernels' file the build's longest step): up to kMaxSpanPtrs
// destinations, from an array.
constexpr int kMaxSpanPtrs = 17;  // a rank's own output plus kMaxPeers destinations
template <class T, RedOp Op>
__device__ RR_NOINLINE void span_multi(T* const* dst, int nd, SlotSources<T> src, int ns,
                                       int64_t n, int div, int tid, int nthreads) {
  span_fold<T, Op>(dst, nd, src, ns, n, div, tid, nthreads);
}

// Host-side dispatch: f(T{}) for the element type of t.
template <class F>
void dispatch_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: return f(float{});
    case DType::F64: return f(double{});
    case DType::F16: return f(F16{});
    case DType::BF16: return f(BF16{});
    case DType::I8: return f(int8_t{});
    case DType::U8: return f(uint8_t{});
    case DType::I32: return f(int32_t{});
    case DType::I64: return f(int64_t{});
    default: return;
  }
}

template <RedOp Op> using OpTag = std::integral_constant<RedOp, Op>;

// f(OpTag<op>{}); AVG runs as SUM (the division is the divisor argument of the last step).
template <class F>
void dispatch_op(RedOp op, F&& f) {
  switch (op) {
    case RedOp::Sum:
    case RedOp::Avg: return f(OpTag<RedOp::Sum>{});
    case RedOp::Min: return f(OpTag<RedOp::Min>{});
    case RedOp::Max: return f(OpTag<RedOp::Max>{});
    case RedOp::Prod: return f(OpTag<RedOp::Prod>{});
    default: return;
  }
}

}  // namespace ringreduce::cuda
