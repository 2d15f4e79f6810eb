// The narrow wire on the symmetric workspace (rr.all_reduce(..., wire_dtype=) of a CUDA tensor):
// the copy into the workspace rounds each rank's input onto the wire (fp8: a scale per wire block
// of 128 elements), the pull decodes every rank's copy and folds in fp32 in rank order, and the
// all_reduce rounds the sum once more for the all-gather: the definition of cpu/wire.h, bit for
// bit. Barriers, halves and the cut between blocks are sym_kernel.cu's, in whole wire blocks:
//   one-shot all_reduce:  round in, start barrier, fold all n, round again into the output.    1
//   two-shot all_reduce:  round in, start barrier, fold chunk r and round it again into the
//                         output and the workspace (span 1), the next piece's round in (span 0)
//                         and start barrier, which is this one's middle barrier too, decode the
//                         other chunks (pipelined as sym_kernel.cu's; span 0 and span 1 of a
//                         half are disjoint, which the overlap of a round in with the peers'
//                         decoding of the piece two back needs).                             1 (+1)
//   reduce_scatter:       round in (every chunk), start barrier, fold chunk r into the output.  1
// A warp rounds a wire block (128 elements) at a time, 4 elements a lane, in one pass: the loads,
// the block's largest magnitude (one warp reduction: an fp8 scale needs it before any element is
// rounded), the encode or decode in registers, the stores. No shared memory, no block barrier
// inside a piece. A warp keeps kBatch wire blocks in flight (a fold: of two sources at a time, as
// the float32 kernels' span_fold), so a thread has as many elements in flight as theirs.
#include "cuda/p2p/device.cuh"
#include "cuda/p2p/sym_barrier.cuh"
#include "cuda/wire.cuh"

namespace ringreduce::cuda::p2p {
namespace {

constexpr int kLanes = 32;
constexpr int kPer = static_cast<int>(kWireBlock) / kLanes;  // a lane's elements of a wire block
constexpr int kBatch = 4;                                    // wire blocks a warp has in flight
static_assert(kPer == 4 && kThreads % kLanes == 0, "a warp moves a wire block, 4 elements a lane");

__device__ __forceinline__ int lane() { return static_cast<int>(threadIdx.x % kLanes); }
// The lane's first element of wire block b (of a piece).
__device__ __forceinline__ int64_t lane_at(int64_t b) { return b * kWireBlock + lane() * kPer; }

// A wire span in some rank's workspace (layout.h: workspace_wire_bytes): room for `cap` wire blocks of
// the piece from its block `first` (a piece's inputs: all of it; a reduced chunk: its own).
template <Wire W>
struct WSpan {
  using E = typename WireElem<W>::E;
  char* base;
  int64_t cap;
  int64_t first = 0;
  __device__ uint32_t* count(int k) const { return reinterpret_cast<uint32_t*>(base) + k; }
  __device__ float* scale(int64_t b) const {
    return reinterpret_cast<float*>(base + kWireCountBytes) + (b - first);
  }
  // The lane's first element of the piece's wire block b (wire blocks start on 16 bytes).
  __device__ E* elem(int64_t b) const {
    return reinterpret_cast<E*>(base + wire_data_at(wire_scaled(W), cap)) + (b - first) * kWireBlock +
           lane() * kPer;
  }
};

// A lane's group (kPer elements of E) as one access: 16 bytes of float32, 8 of 16-bit, 4 of fp8.
template <int Bytes> struct Group;
template <> struct Group<16> { using U = uint4; };
template <> struct Group<8> { using U = uint2; };
template <> struct Group<4> { using U = uint32_t; };
template <class E> using GroupOf = typename Group<kPer * static_cast<int>(sizeof(E))>::U;

template <class E>
__device__ __forceinline__ bool aligned(const E* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(GroupOf<E>) == 0;
}
// The group at p, `left` of its elements present (>= kPer: all): one access when all are and p
// is aligned (vec), else one per present element; absent ones are 0.
template <class E>
__device__ __forceinline__ void get_group(const E* p, int64_t left, bool vec, E (&e)[kPer]) {
  if (vec && left >= kPer) {
    const GroupOf<E> u = __ldcg(reinterpret_cast<const GroupOf<E>*>(p));
    __builtin_memcpy(e, &u, sizeof u);
    return;
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) e[k] = k < left ? load1(p + k) : E{};
}
template <class E>
__device__ __forceinline__ void put_group(E* p, int64_t left, bool vec, const E (&e)[kPer]) {
  if (vec && left >= kPer) {
    GroupOf<E> u;
    __builtin_memcpy(&u, e, sizeof u);
    __stcg(reinterpret_cast<GroupOf<E>*>(p), u);
    return;
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k)
    if (k < left) store1(p + k, e[k]);
}

// This warp's batches of the wire blocks `blocks`: f(first block, how many of the batch's kBatch
// blocks are in `blocks`). The same in every lane: warp_max and warp_gather need the whole warp.
template <class F>
__device__ void batches(ring::Span blocks, F f) {
  const int64_t end = blocks.begin + blocks.count, step = static_cast<int64_t>(blockDim.x / kLanes) * kBatch;
  for (int64_t b = blocks.begin + static_cast<int64_t>(threadIdx.x / kLanes) * kBatch; b < end; b += step)
    f(b, static_cast<int>(ring::min64(kBatch, end - b)));
}
// The lane's elements present in batch block u (of nb in the part; the piece has count elements).
__device__ __forceinline__ int64_t left_of(int64_t b0, int u, int nb, int64_t count) {
  return u < nb ? count - lane_at(b0 + u) : 0;
}

// The scales of a batch's blocks in up to two sources (fp8): lane s * kBatch + u loads source s's
// scale of block b0 + u, and the warp shares them: one load per scale, not one per lane.
template <Wire W, class Src>
__device__ __forceinline__ void get_scales(Src src, int qs, int64_t b0, int nb, float (&sc)[2][kBatch]) {
  if constexpr (wire_scaled(W)) {
    const int s = lane() / kBatch, u = lane() % kBatch;
    const float mine = s < qs && u < nb ? load1(src(s).scale(b0 + u)) : 0.0f;
    uint32_t all[2 * kBatch];
    warp_gather(wire::bits(mine), all);
#pragma unroll
    for (int k = 0; k < 2 * kBatch; ++k) sc[k / kBatch][k % kBatch] = wire::from_bits(all[k]);
  }
}

// Rounds v (the lane's values of a batch's blocks) onto the wire: an fp8 block's scale from its
// largest magnitude over the warp's present elements; the wire elements into dst (unless its base
// is null), the values they stand for back into v. Returns whether this lane rounded a finite
// value beyond fp16's range.
template <Wire W>
__device__ bool round_batch(float (&v)[kBatch][kPer], int64_t b0, int nb, int64_t count, const WSpan<W>& dst) {
  using E = typename WireElem<W>::E;
  float inv[kBatch] = {}, sc[kBatch] = {};
  if constexpr (wire_scaled(W)) {
    uint32_t amax[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const int64_t left = left_of(b0, u, nb, count);
      amax[u] = 0;
#pragma unroll
      for (int k = 0; k < kPer; ++k) {
        const uint32_t x = k < left ? wire::bits(v[u][k]) & 0x7fffffffu : 0u;
        amax[u] = x > amax[u] ? x : amax[u];
      }
    }
    warp_max(amax);
#pragma unroll
    for (int u = 0; u < kBatch; ++u) wire::fp8_scale<Fp8Of<W>>(amax[u], &inv[u], &sc[u]);
  }
  bool over = false;
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    const int64_t left = left_of(b0, u, nb, count);
    if (left <= 0) continue;
    E e[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      if constexpr (W == Wire::F16) over |= k < left && wire::over_f16(v[u][k]) != 0;
      e[k] = wire_put<W>(v[u][k], inv[u]);
      v[u][k] = wire_get<W>(e[k], sc[u]);
    }
    if (!dst.base) continue;
    put_group(dst.elem(b0 + u), left, true, e);
    if (wire_scaled(W) && lane() == 0) store1(dst.scale(b0 + u), sc[u]);  // lane 0 has an element
  }
  return over;
}

// The lane's values of a batch's blocks from x (the piece's first element); absent ones 0.
template <class T>
__device__ __forceinline__ void get_values(const T* x, bool vec, float (&v)[kBatch][kPer], int64_t b0, int nb,
                                           int64_t count) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    T e[kPer];
    get_group(x + lane_at(b0 + u), left_of(b0, u, nb, count), vec, e);
#pragma unroll
    for (int k = 0; k < kPer; ++k) v[u][k] = Num<T>::up(e[k]);
  }
}
// v's present elements into out (the piece's first element).
template <class T>
__device__ __forceinline__ void put_values(T* out, bool vec, const float (&v)[kBatch][kPer], int64_t b0,
                                           int nb, int64_t count) {
#pragma unroll
  for (int u = 0; u < kBatch; ++u) {
    T e[kPer];
#pragma unroll
    for (int k = 0; k < kPer; ++k) e[k] = Num<T>::down(v[u][k]);
    put_group(out + lane_at(b0 + u), left_of(b0, u, nb, count), vec, e);
  }
}

// x[0, count) (a piece of the tensor) onto the wire span dst, its wire blocks `blocks`.
template <class T, Wire W>
__device__ bool put_part(const T* x, int64_t count, ring::Span blocks, const WSpan<W>& dst) {
  const bool vec = aligned(x);
  bool over = false;
  batches(blocks, [&](int64_t b0, int nb) {
    float v[kBatch][kPer];
    get_values(x, vec, v, b0, nb, count);
    over |= round_batch<W>(v, b0, nb, count, dst);
  });
  return over;
}

// The rank-order fold of the n sources' wire blocks `blocks` into out (the piece's first element;
// AVG: divided by div). dst set: the sum rounded onto the wire again, into *dst unless its base is
// null, and out gets the rounded values; null: out gets the fp32 sum.
template <class T, Wire W, class Src>
__device__ bool fold_part(Src src, int n, int64_t count, ring::Span blocks, int div, const WSpan<W>* dst,
                          T* out) {
  using E = typename WireElem<W>::E;
  const bool vec = aligned(out);
  bool over = false;
  batches(blocks, [&](int64_t b0, int nb) {
    float acc[kBatch][kPer];
    for (int q = 0; q < n; q += 2) {
      const int qs = n - q < 2 ? 1 : 2;
      auto two = [&](int s) { return src(q + (s < qs ? s : 0)); };
      // every load of both sources issued before any value is used
      E e[2][kBatch][kPer];
      float sc[2][kBatch] = {};
#pragma unroll
      for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int u = 0; u < kBatch; ++u) get_group(two(s).elem(b0 + u), s < qs ? left_of(b0, u, nb, count) : 0, true, e[s][u]);
      get_scales<W>(two, qs, b0, nb, sc);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        if (s >= qs) break;
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
#pragma unroll
          for (int k = 0; k < kPer; ++k) {
            const float x = wire_get<W>(e[s][u][k], sc[s][u]);
            acc[u][k] = q + s == 0 ? x : add_rn(acc[u][k], x);
          }
      }
    }
    if (div > 1)
#pragma unroll
      for (int u = 0; u < kBatch; ++u)
#pragma unroll
        for (int k = 0; k < kPer; ++k) acc[u][k] = div_rn(acc[u][k], static_cast<float>(div));
    if (dst) over |= round_batch<W>(acc, b0, nb, count, *dst);
    put_values(out, vec, acc, b0, nb, count);
  });
  return over;
}

// out[...] = the values of src's wire blocks `blocks` (another rank's reduced chunk).
template <class T, Wire W>
__device__ void get_part(const WSpan<W>& src, int64_t count, ring::Span blocks, T* out) {
  using E = typename WireElem<W>::E;
  const bool vec = aligned(out);
  batches(blocks, [&](int64_t b0, int nb) {
    E e[kBatch][kPer];
    float sc[2][kBatch] = {};
#pragma unroll
    for (int u = 0; u < kBatch; ++u) get_group(src.elem(b0 + u), left_of(b0, u, nb, count), true, e[u]);
    get_scales<W>([&](int) { return src; }, 1, b0, nb, sc);
    float v[kBatch][kPer];
#pragma unroll
    for (int u = 0; u < kBatch; ++u)
#pragma unroll
      for (int k = 0; k < kPer; ++k) v[u][k] = wire_get<W>(e[u][k], sc[0][u]);
    put_values(out, vec, v, b0, nb, count);
  });
}

// This block's fp16 overflow flag into span's word for it, or the peers' words read: whether any is set.
template <Wire W>
__device__ void tell_overflow(const WSpan<W>& span, bool over) {
  if (!(W == Wire::F16)) return;
  const int any = __syncthreads_or(over);
  if (threadIdx.x == 0) store1(span.count(blockIdx.x), static_cast<uint32_t>(any));
}
template <Wire W, class Src>
__device__ bool heard_overflow(Src src, int n) {
  bool over = false;
  if (W == Wire::F16)
    for (int q = threadIdx.x; q < n; q += blockDim.x) over |= load1(src(q).count(blockIdx.x)) != 0u;
  return over;
}

template <class T, Wire W>
__global__ void __launch_bounds__(kThreads) sym_wire_kernel(const __grid_constant__ SymArgs a) {
  const int n = a.nranks, r = a.rank, nb = gridDim.x;
  const bool one = static_cast<Algo>(a.algo) == Algo::OneShot;
  const bool all_reduce = static_cast<Coll>(a.coll) == Coll::AllReduce;
  __shared__ unsigned s_claim;
  __shared__ uint64_t s_epoch;
  if (threadIdx.x == 0) s_claim = 0;
  // its barrier publishes s_claim and s_epoch too
  if (broken_at_start(a, &a.self->sym[blockIdx.x].epoch.value, &s_epoch)) return;
  const uint64_t e0 = s_epoch;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const int64_t m = a.numel / n, C = a.chunk_elems, cap = C / kWireBlock;
  const int64_t span = all_reduce ? a.numel : m;
  const int64_t SB = (cap + n - 1) / n;  // two-shot: wire blocks per chunk of a piece
  bool over = false;
  // Piece j: its epoch, first element, length in elements and wire blocks, and its half.
  auto epoch = [&](int64_t j) { return e0 + 1 + static_cast<uint64_t>(j); };
  auto count_of = [&](int64_t j) { return ring::min64(C, span - j * C); };
  auto half_of = [&](int64_t j) { return (epoch(j) & 1) * a.half_bytes; };
  // Span i of rank q's half for piece j: reduce_scatter: chunk i; all_reduce: 0 every input, 1
  // the chunk q reduced (two-shot).
  auto at = [&](int64_t j, int q, int i) { return WSpan<W>{a.data[q] + half_of(j) + i * a.wire_span, cap}; };
  auto reduced_at = [&](int64_t j, int q) { return WSpan<W>{a.data[q] + half_of(j) + a.wire_span, SB, q * SB}; };
  // This block's wire blocks of [lo, lo + len) of piece j: the cut of a full piece, clipped to
  // this one (sym_kernel.cu's `mine`, in wire blocks).
  auto mine = [&](int64_t j, int64_t lo, int64_t len) {
    const int64_t nblk = (count_of(j) + kWireBlock - 1) / kWireBlock;
    const ring::Span p = ring::channel_part(ring::Span{lo, len}, nb, blockIdx.x);
    const int64_t b = ring::min64(p.begin, nblk), f = ring::min64(p.begin + p.count, nblk);
    return ring::Span{b, f - b};
  };
  if (all_reduce) {
    // One-shot: one barrier per piece. Two-shot pipelined as sym_kernel.cu's: piece j + 1's
    // inputs are encoded in between piece j's fold and the barrier after it (one per piece, and
    // one to start).
    auto cpart = [&](int64_t j, int c) { return one ? mine(j, 0, cap) : mine(j, c * SB, SB); };
    auto put_in = [&](int64_t j) {
      bool o = false;
      for (int c = 0; c < (one ? 1 : n); ++c)
        o |= put_part<T, W>(in + j * C, count_of(j), cpart(j, c), at(j, r, 0));
      tell_overflow<W>(at(j, r, 0), o);
    };
    put_in(0);
    bool ok = barrier(a, epoch(0), kStart, 0, a.wire_span, &s_claim);
    for (int64_t j = 0; ok && j < a.pieces; ++j) {
      const int64_t begin = j * C, count = count_of(j);
      auto src = [&](int q) { return at(j, q, 0); };
      over |= heard_overflow<W>(src, n);
      const WSpan<W> reduced = one ? WSpan<W>{nullptr, cap} : reduced_at(j, r);
      const bool o = fold_part<T, W>(src, n, count, cpart(j, one ? 0 : r), a.divisor, &reduced, out + begin);
      over |= o;
      if (!one) tell_overflow<W>(reduced, o);
      if (j + 1 < a.pieces) {
        put_in(j + 1);
        ok = barrier(a, epoch(j + 1), kStart, j + 1, a.wire_span, &s_claim);
      } else if (!one) {
        ok = barrier(a, epoch(j), kMiddle, j, a.wire_span, &s_claim);
      }
      if (!ok || one) continue;
      auto red = [&](int q) { return reduced_at(j, q); };
      over |= heard_overflow<W>(red, n);
      for (int c = 0; c < n; ++c)
        if (c != r) get_part<T, W>(reduced_at(j, c), count, cpart(j, c), out + begin);
    }
  } else {  // reduce_scatter: span c of the half holds this piece of chunk c
    for (int64_t j = 0; j < a.pieces; ++j) {
      const int64_t begin = j * C, count = count_of(j);
      const ring::Span P = mine(j, 0, cap);
      bool o = false;
      for (int c = 0; c < n; ++c) o |= put_part<T, W>(in + c * m + begin, count, P, at(j, r, c));
      for (int c = 0; c < n; ++c) tell_overflow<W>(at(j, r, c), o);
      if (!barrier(a, epoch(j), kStart, j, a.wire_span, &s_claim)) break;
      auto src = [&](int q) { return at(j, q, r); };
      over |= heard_overflow<W>(src, n);
      fold_part<T, W>(src, n, count, P, a.divisor, static_cast<const WSpan<W>*>(nullptr), out + begin);
    }
  }
  end_epochs(a, e0 + a.pieces);
  if (W == Wire::F16 && __syncthreads_or(over) && threadIdx.x == 0)
    *reinterpret_cast<volatile uint64_t*>(&a.ctl->wire_overflow[a.op_seq % kWireOverflowSlots]) = a.op_seq;
}

// World 1: the tensor rounded as a group of one rounds it (all_reduce: twice, new scales).
template <class T, Wire W>
__global__ void __launch_bounds__(kThreads) wire_local_kernel(const T* in, T* out, int64_t numel,
                                                             bool twice, uint64_t* overflow_seq,
                                                             uint64_t op_seq) {
  const int64_t nblk = (numel + kWireBlock - 1) / kWireBlock;
  const WSpan<W> nowhere{nullptr, 0};
  const bool vin = aligned(in), vout = aligned(out);
  bool over = false;
  // the grid's warps over the tensor's wire blocks, a batch each at a time
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kLanes);
  const int64_t w = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kLanes) + threadIdx.x / kLanes;
  for (int64_t b0 = w * kBatch; b0 < nblk; b0 += warps * kBatch) {
    const int nb = static_cast<int>(ring::min64(kBatch, nblk - b0));
    float v[kBatch][kPer];
    get_values(in, vin, v, b0, nb, numel);
    if (twice) over |= round_batch<W>(v, b0, nb, numel, nowhere);
    over |= round_batch<W>(v, b0, nb, numel, nowhere);
    put_values(out, vout, v, b0, nb, numel);
  }
  if (W == Wire::F16 && __syncthreads_or(over) && threadIdx.x == 0)
    *reinterpret_cast<volatile uint64_t*>(overflow_seq) = op_seq;
}

}  // namespace

void launch_sym_wire(const SymArgs& a, cudaStream_t stream) {
  const Algo algo = static_cast<Algo>(a.algo);
  if (a.nranks < 2 || a.nranks > kMaxPeers || a.blocks < 1 || a.blocks > kMaxSymBlocks ||
      (algo != Algo::OneShot && algo != Algo::TwoShot) ||
      (algo == Algo::OneShot && a.coll != static_cast<uint8_t>(Coll::AllReduce)) ||
      (a.coll == static_cast<uint8_t>(Coll::AllGather)) || a.chunk_elems < kWireBlock ||
      a.chunk_elems % kWireBlock || a.pieces < 1 ||
      (static_cast<RedOp>(a.op) != RedOp::Sum && static_cast<RedOp>(a.op) != RedOp::Avg))
    throw std::invalid_argument("ringreduce: p2p narrow wire launch: bad algorithm, collective, "
                                "operator, block or piece count");
  dispatch_wire_dtype(static_cast<DType>(a.dtype), [&](auto tag) {
    using T = decltype(tag);
    dispatch_wire(static_cast<Wire>(a.wire), [&](auto wtag) {
      constexpr auto kernel = &sym_wire_kernel<T, decltype(wtag)::value>;
      RR_LAUNCH_WARPS(kernel, a.blocks, kThreads, stream, a);
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

void launch_wire_local(const Call& c, uint64_t* overflow_seq, uint64_t op_seq, cudaStream_t stream) {
  if (c.numel <= 0) return;
  const int64_t per_block = (kThreads / kLanes) * kBatch * kWireBlock;  // elements a block's warps take at once
  // No peer to spin with: as many blocks as the device holds at once.
  const int blocks = static_cast<int>(ring::min64((c.numel + per_block - 1) / per_block, 2 * std::max(1, sm_count())));
  const bool twice = c.coll == Coll::AllReduce;
  dispatch_wire_dtype(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_wire(c.wire, [&](auto wtag) {
      constexpr auto kernel = &wire_local_kernel<T, decltype(wtag)::value>;
      RR_LAUNCH_WARPS(kernel, blocks, kThreads, stream, static_cast<const T*>(c.in), static_cast<T*>(c.out),
                c.numel, twice, overflow_seq, op_seq);
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringreduce::cuda::p2p
