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
// A kernel block rounds 16 wire blocks at a time through shared memory (an fp8 scale needs its
// block's largest magnitude before any element is rounded); a thread moves the wire 16 bytes at a
// time (kGroup), as the float32 kernels move their data.
#include "cuda/p2p/device.cuh"
#include "cuda/p2p/sym_barrier.cuh"
#include "cuda/wire.cuh"

namespace ringreduce::cuda::p2p {
namespace {

constexpr int kTileBlocks = 16;
constexpr int kTile = kTileBlocks * static_cast<int>(kWireBlock);

struct TileMem {
  float v[kTile];                        // the tile's values before rounding
  uint32_t amax[kTileBlocks];            // each wire block's largest magnitude (bits)
  float inv[kTileBlocks], out_scale[kTileBlocks];
  float scale[kMaxPeers][kTileBlocks];   // the sources' scales of the tile's wire blocks
};

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
  // The first element of the piece's wire block b.
  __device__ E* elem(int64_t b) const {
    return reinterpret_cast<E*>(base + wire_data_at(wire_scaled(W), cap)) + (b - first) * kWireBlock;
  }
};

// Wire elements a thread moves at once: one 16-byte load or store (16 fp8 or 8 bf16/fp16 values,
// within one wire block: 128 is a multiple of both; wire blocks start on 16 bytes in a span).
// A tile's last group may be short (the tensor's end): element by element there.
template <Wire W>
constexpr int kGroup = 16 / static_cast<int>(sizeof(typename WireElem<W>::E));

// Group g of a tile of ne elements: f(first element, elements, whole) for this thread's groups.
template <Wire W, class F>
__device__ void groups(int64_t ne, F f) {
  constexpr int K = kGroup<W>;
  for (int64_t i = threadIdx.x * static_cast<int64_t>(K); i < ne; i += blockDim.x * static_cast<int64_t>(K))
    f(i, ring::min64(K, ne - i), i + K <= ne);
}

// K wire elements at p (16-byte aligned) and their values (fp8: times scale).
template <Wire W>
__device__ __forceinline__ void get_group(const typename WireElem<W>::E* p, float scale, float* v) {
  constexpr int K = kGroup<W>;
  const uint4 u = __ldcg(reinterpret_cast<const uint4*>(p));
  typename WireElem<W>::E e[K];
  __builtin_memcpy(e, &u, 16);
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = wire_get<W>(e[k], scale);
}

// s.amax of the tile's nblk wire blocks from s.v[0, ne): one shared atomic per group (its
// elements lie in one wire block), not per element.
template <Wire W>
__device__ void measure(TileMem& s, int nblk, int64_t ne) {
  if constexpr (!wire_scaled(W)) return;
  __syncthreads();  // s.v written, the previous readers of s.amax done
  for (int t = threadIdx.x; t < nblk; t += blockDim.x) s.amax[t] = 0;
  __syncthreads();
  groups<W>(ne, [&](int64_t i, int64_t m, bool) {
    uint32_t a = 0;
    for (int64_t k = 0; k < m; ++k) {
      const uint32_t x = wire::bits(s.v[i + k]) & 0x7fffffffu;
      a = x > a ? x : a;
    }
    atomicMax(&s.amax[i / kWireBlock], a);
  });
}

// Rounds s.v[0, ne) onto the wire: into dst at its wire block b (dst.base null: nowhere), and
// hands each rounded value to out(i, value). Returns whether this thread rounded a finite value
// beyond fp16's range.
template <Wire W, class Out>
__device__ bool round_tile(TileMem& s, int nblk, int64_t ne, const WSpan<W>& dst, int64_t b, Out out) {
  __syncthreads();  // s.v and s.amax complete
  if constexpr (wire_scaled(W)) {
    for (int t = threadIdx.x; t < nblk; t += blockDim.x) {
      float inv, sc;
      wire::fp8_scale<Fp8Of<W>>(s.amax[t], &inv, &sc);
      s.inv[t] = inv;
      s.out_scale[t] = sc;
      if (dst.base) store1(dst.scale(b + t), sc);
    }
    __syncthreads();
  }
  bool over = false;
  constexpr int K = kGroup<W>;
  groups<W>(ne, [&](int64_t i, int64_t m, bool whole) {
    float inv = 0.0f, sc = 0.0f;
    if constexpr (wire_scaled(W)) inv = s.inv[i / kWireBlock], sc = s.out_scale[i / kWireBlock];
    typename WireElem<W>::E e[K];
    for (int64_t k = 0; k < m; ++k) {
      const float x = s.v[i + k];
      if constexpr (W == Wire::F16) over |= wire::over_f16(x) != 0;
      e[k] = wire_put<W>(x, inv);
      out(i + k, wire_get<W>(e[k], sc));
    }
    if (!dst.base) return;
    if (whole) {  // one 16-byte store
      uint4 u;
      __builtin_memcpy(&u, e, 16);
      __stcg(reinterpret_cast<uint4*>(dst.elem(b) + i), u);
    } else {
      for (int64_t k = 0; k < m; ++k) store1(dst.elem(b) + i + k, e[k]);
    }
  });
  return over;
}

// The tiles of `blocks` (wire blocks of a piece of `count` elements): f(first wire block, blocks, elements).
template <class F>
__device__ void tiles(ring::Span blocks, int64_t count, F f) {
  for (int64_t b = blocks.begin; b < blocks.begin + blocks.count; b += kTileBlocks) {
    const int nblk = static_cast<int>(ring::min64(kTileBlocks, blocks.begin + blocks.count - b));
    f(b, nblk, ring::min64(nblk * kWireBlock, count - b * kWireBlock));
  }
}

// x[0, count) (a piece of the tensor) onto the wire span dst, its wire blocks `blocks`.
template <class T, Wire W>
__device__ bool put_part(TileMem& s, const T* x, int64_t count, ring::Span blocks, const WSpan<W>& dst) {
  bool over = false;
  tiles(blocks, count, [&](int64_t b, int nblk, int64_t ne) {
    __syncthreads();  // the previous tile's readers of s.v done
    for (int64_t i = threadIdx.x; i < ne; i += blockDim.x) s.v[i] = Num<T>::up(load1(x + b * kWireBlock + i));
    measure<W>(s, nblk, ne);
    over |= round_tile<W>(s, nblk, ne, dst, b, [](int64_t, float) {});
  });
  return over;
}

// The rank-order fold of the n sources' wire blocks `blocks` into out (the piece's first element;
// AVG: divided by div). dst set: the sum rounded onto the wire again, into *dst unless its base is
// null, and out gets the rounded values; null: out gets the fp32 sum.
template <class T, Wire W, class Src>
__device__ bool fold_part(TileMem& s, Src src, int n, int64_t count, ring::Span blocks, int div,
                          const WSpan<W>* dst, T* out) {
  bool over = false;
  tiles(blocks, count, [&](int64_t b, int nblk, int64_t ne) {
    __syncthreads();  // the previous tile's readers of s.scale and s.v done
    if constexpr (wire_scaled(W))
      for (int x = threadIdx.x; x < n * nblk; x += blockDim.x)
        s.scale[x / nblk][x % nblk] = load1(src(x / nblk).scale(b + x % nblk));
    __syncthreads();
    const int64_t at = b * kWireBlock;  // the tile's first element in the piece
    constexpr int K = kGroup<W>;
    groups<W>(ne, [&](int64_t i, int64_t m, bool whole) {
      const int t = static_cast<int>(i / kWireBlock);
      float acc[K], v[K];
      // Every source's group in one 16-byte load (the tail element by element), folded in rank order.
      for (int q = 0; q < n; ++q) {
        if (whole) {
          get_group<W>(src(q).elem(b) + i, s.scale[q][t], v);
        } else {
          for (int64_t k = 0; k < m; ++k) v[k] = wire_get<W>(load1(src(q).elem(b) + i + k), s.scale[q][t]);
        }
        for (int64_t k = 0; k < m; ++k) acc[k] = q == 0 ? v[k] : add_rn(acc[k], v[k]);
      }
      for (int64_t k = 0; k < m; ++k) {
        if (div > 1) acc[k] = div_rn(acc[k], static_cast<float>(div));
        if (dst) s.v[i + k] = acc[k];
        else store1(out + at + i + k, Num<T>::down(acc[k]));
      }
    });
    if (!dst) return;
    measure<W>(s, nblk, ne);
    over |= round_tile<W>(s, nblk, ne, *dst, b, [&](int64_t i, float v) { store1(out + at + i, Num<T>::down(v)); });
  });
  return over;
}

// out[...] = the values of src's wire blocks `blocks` (another rank's reduced chunk).
template <class T, Wire W>
__device__ void get_part(TileMem& s, const WSpan<W>& src, int64_t count, ring::Span blocks, T* out) {
  tiles(blocks, count, [&](int64_t b, int nblk, int64_t ne) {
    __syncthreads();
    if constexpr (wire_scaled(W))
      for (int t = threadIdx.x; t < nblk; t += blockDim.x) s.scale[0][t] = load1(src.scale(b + t));
    __syncthreads();
    const int64_t at = b * kWireBlock;
    constexpr int K = kGroup<W>;
    groups<W>(ne, [&](int64_t i, int64_t m, bool whole) {
      const float sc = s.scale[0][i / kWireBlock];
      float v[K];
      if (whole) get_group<W>(src.elem(b) + i, sc, v);
      else for (int64_t k = 0; k < m; ++k) v[k] = wire_get<W>(load1(src.elem(b) + i + k), sc);
      for (int64_t k = 0; k < m; ++k) store1(out + at + i + k, Num<T>::down(v[k]));
    });
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
  __shared__ TileMem s;
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
        o |= put_part<T, W>(s, in + j * C, count_of(j), cpart(j, c), at(j, r, 0));
      tell_overflow<W>(at(j, r, 0), o);
    };
    put_in(0);
    bool ok = barrier(a, epoch(0), kStart, 0, a.wire_span, &s_claim);
    for (int64_t j = 0; ok && j < a.pieces; ++j) {
      const int64_t begin = j * C, count = count_of(j);
      auto src = [&](int q) { return at(j, q, 0); };
      over |= heard_overflow<W>(src, n);
      const WSpan<W> reduced = one ? WSpan<W>{nullptr, cap} : reduced_at(j, r);
      const bool o = fold_part<T, W>(s, src, n, count, cpart(j, one ? 0 : r), a.divisor, &reduced, out + begin);
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
        if (c != r) get_part<T, W>(s, reduced_at(j, c), count, cpart(j, c), out + begin);
    }
  } else {  // reduce_scatter: span c of the half holds this piece of chunk c
    for (int64_t j = 0; j < a.pieces; ++j) {
      const int64_t begin = j * C, count = count_of(j);
      const ring::Span P = mine(j, 0, cap);
      bool o = false;
      for (int c = 0; c < n; ++c) o |= put_part<T, W>(s, in + c * m + begin, count, P, at(j, r, c));
      for (int c = 0; c < n; ++c) tell_overflow<W>(at(j, r, c), o);
      if (!barrier(a, epoch(j), kStart, j, a.wire_span, &s_claim)) break;
      auto src = [&](int q) { return at(j, q, r); };
      over |= heard_overflow<W>(src, n);
      fold_part<T, W>(s, src, n, count, P, a.divisor, static_cast<const WSpan<W>*>(nullptr), out + begin);
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
  __shared__ TileMem s;
  const int64_t nblk = (numel + kWireBlock - 1) / kWireBlock;
  const WSpan<W> nowhere{nullptr, 0};
  bool over = false;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(kTileBlocks); b < nblk; b += gridDim.x * static_cast<int64_t>(kTileBlocks)) {
    const int nt = static_cast<int>(ring::min64(kTileBlocks, nblk - b));
    const int64_t ne = ring::min64(nt * kWireBlock, numel - b * kWireBlock), at = b * kWireBlock;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < ne; i += blockDim.x) s.v[i] = Num<T>::up(load1(in + at + i));
    measure<W>(s, nt, ne);
    if (twice) {  // each thread rewrites its own elements of s.v
      over |= round_tile<W>(s, nt, ne, nowhere, 0, [&](int64_t i, float v) { s.v[i] = v; });
      measure<W>(s, nt, ne);
    }
    over |= round_tile<W>(s, nt, ne, nowhere, 0, [&](int64_t i, float v) { store1(out + at + i, Num<T>::down(v)); });
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
      RR_LAUNCH(kernel, a.blocks, kThreads, stream, a);
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

void launch_wire_local(const Call& c, uint64_t* overflow_seq, uint64_t op_seq, cudaStream_t stream) {
  if (c.numel <= 0) return;
  const int64_t tiles = (c.numel + kTile - 1) / kTile;
  // No peer to spin with: as many blocks as the device holds at once.
  const int blocks = static_cast<int>(ring::min64(tiles, 2 * std::max(1, sm_count())));
  const bool twice = c.coll == Coll::AllReduce;
  dispatch_wire_dtype(c.dtype, [&](auto tag) {
    using T = decltype(tag);
    dispatch_wire(c.wire, [&](auto wtag) {
      constexpr auto kernel = &wire_local_kernel<T, decltype(wtag)::value>;
      RR_LAUNCH(kernel, blocks, kThreads, stream, static_cast<const T*>(c.in), static_cast<T*>(c.out),
                c.numel, twice, overflow_seq, op_seq);
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringreduce::cuda::p2p
