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
// The data path (a warp per wire block, in registers): cuda/p2p/wire_warp.cuh.
// Why a kernel of its own beside sym_kernel.cu (issue 82 asked for one kernel over the word format
// where that costs nothing): the schedule is shared already (sym_barrier.cuh: the barriers, the
// halves, the per-block cut); what differs is the unit of work. Here a warp owns a wire block (128
// elements: a shuffle reduction for the fp8 scale, then each lane's encode or decode), and pieces
// are cut in whole wire blocks; there a thread owns a 16-byte vector with no step across threads,
// and pieces are cut at 16 bytes. One kernel templated on the format would carry the warp's
// block structure into the vector path's loop (or a branch per vector into both). Not tried and
// not measured on the emulated counts (benchmarks/gpu_cost.py): the reason is the design's.
#include "cuda/p2p/sym_barrier.cuh"
#include "cuda/p2p/wire_warp.cuh"

namespace ringreduce::cuda::p2p {
namespace {

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
