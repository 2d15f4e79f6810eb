// The symmetric workspace kernel of the p2p transport: every rank maps every other rank's
// workspace, so a call copies its input into its own workspace, meets its peers once, and then
// pulls what it needs from theirs with 16-byte loads, folding in rank order (every rank gets the
// same bits, whatever the sizes). Barriers per piece of a call (Endpoint::sym_args cuts the pieces):
//   one-shot all_reduce:  copy in, start barrier, fold all n inputs into the output.        1
//   two-shot all_reduce:  copy in, start barrier, fold chunk r into the output and the workspace,
//                         (the next piece's copy in and start barrier, which is this one's
//                         middle barrier too), copy the other chunks from their owners.  1 (+1)
//   reduce_scatter:       copy in, start barrier, fold chunk r into the output.              1
//   all_gather:           copy in, start barrier, copy every peer's chunk into the output.   1
//   registered (an all_reduce of a tensor in a buffer every rank maps: nothing copied): start
//                         barrier, fold chunk r from the n copies into all n, end barrier.   2
//   imported (an ordinary tensor whose peers' memory each rank predicted): start barrier with
//                         the predictions; all right: as registered                          2
//                         else two-shot through the workspace after it             1 + two-shot's
// No end barrier where the workspace is ours: pieces alternate between its two halves (by epoch
// parity), and a rank writes a region of a half again only after a barrier with every peer that
// came after the peers' reads of that region (pipelined two-shot: see there). Within a call, block b touches only part b of each piece on every
// rank (the same cut everywhere), so per-block barriers order all of it; across calls, a peer's
// block at the next call's start barrier means that peer's previous kernel has ended (stream order).
// A registered tensor is the user's: its end barrier keeps the peers' reads before our return.
// The other one-shots (the narrow wire: sym_wire.cu; LL: ll_kernel.cu) say why they are kernels
// of their own.
#include "cuda/p2p/device.cuh"
#include "cuda/p2p/sym_barrier.cuh"
#include "cuda/reduce.cuh"

namespace ringreduce::cuda::p2p {
namespace {

// Where each rank keeps element i (of the span the pieces cut, whose piece starts at `begin`) in
// its workspace half: laid out as the tensor is mod 16 (global: the element's index in the full
// tensor), so that 16-byte aligned tensors and the workspace share their alignment and every copy
// and fold runs on 16-byte vectors.
struct Layout {
  uint64_t half;    // byte offset of the piece's half
  int64_t begin;    // the piece's first element in the span
  int64_t global;   // the element index in the full tensor of the span's element `begin`
  uint64_t region;  // reduce_scatter: bytes per chunk region (0: one region)
  __device__ uint64_t at(int64_t i, int region_index, uint64_t es) const {
    return half + region_index * region + ((static_cast<uint64_t>(global) * es) & (kVecBytes - 1)) +
           static_cast<uint64_t>(i - begin) * es;
  }
};

// Every rank's copy of one element range, computed where loaded (no pointer array): source q is
// `own` at q == own_at, else rank q's memory at byte offset `off`.
template <class T>
struct Sources {
  const T* own;
  int own_at;
  char* const* data;
  uint64_t off;
  __device__ const T* operator()(int q) const {
    return q == own_at ? own : reinterpret_cast<const T*>(data[q] + off);
  }
};
// Destinations: out (if set) and then this rank's memory at off; or, without out, every rank's.
template <class T>
struct Targets {
  T* out;
  char* const* data;
  uint64_t off;
  int rank;
  __device__ T* operator[](int d) const {
    return out ? (d == 0 ? out : reinterpret_cast<T*>(data[rank] + off))
               : reinterpret_cast<T*>(data[d] + off);
  }
};

// The fold, out of line: one body per type and operator for every call site. It takes nearly all
// of a thread's 128 registers (kThreads a block; alone, 97 for float and 113 for F16 on sm_90), so
// whatever a caller keeps in registers across it spills (hence two-shot's copies out of line too).
template <class T, RedOp Op>
__device__ RR_NOINLINE void fold(Targets<T> dst, int nd, Sources<T> src, int ns, int64_t n, int div) {
  span_fold<T, Op>(dst, nd, src, ns, n, div, threadIdx.x, blockDim.x);
}
template <class T>
__device__ __forceinline__ void copy(T* dst, const T* src, int64_t n) {
  if (dst != src) span_op<T, RedOp::Sum, false>(dst, nullptr, src, nullptr, n, 1, threadIdx.x, blockDim.x);
}

// The pieces of a call of the workspace algorithms, the same on every rank: piece j (of at most
// chunk_elems elements C of the span they cut, from j * C) runs at epoch e0 + 1 + j (barrier
// values, half parity) in that half of the workspace.
struct Pieces {
  const SymArgs& a;
  uint64_t e0;
  int64_t span;  // all_reduce: the tensor; reduce_scatter, all_gather: one chunk (numel / n)
  __device__ uint64_t epoch(int64_t j) const { return e0 + 1 + static_cast<uint64_t>(j); }
  // Where its elements lie in a half (global: the element index in the full tensor of the span's
  // element j * C).
  __device__ Layout layout(int64_t j, int64_t global, uint64_t region) const {
    return Layout{(epoch(j) & 1) * a.half_bytes, j * a.chunk_elems, global, region};
  }
  // This block's elements of [lo, lo + len) of piece j (lo relative to it), as absolute indices
  // of the span: a cut of the full piece, the same in every piece of the call and clipped to
  // this one, so that a block ahead of another (blocks do not wait for each other) never writes
  // where that one may still read in a piece two back, in the same half.
  __device__ ring::Span mine(int64_t j, int64_t lo, int64_t len) const {
    const int64_t C = a.chunk_elems, begin = j * C, count = ring::min64(C, span - begin);
    const ring::Span p = ring::channel_part(ring::Span{lo, len}, gridDim.x, blockIdx.x);
    const int64_t b = ring::min64(p.begin, count), f = ring::min64(p.begin + p.count, count);
    return ring::Span{begin + b, f - b};
  }
  // Two-shot's chunk c of piece j: of S elements, the same cut in every piece (the last may be short).
  __device__ ring::Span part(int64_t j, int c) const {
    const int64_t S = (a.chunk_elems + a.nranks - 1) / a.nranks;
    return mine(j, c * S, S);
  }
};

// Two-shot's copies, out of line: the kernel's loop then keeps only j and the epoch across the fold
// (inline, their cuts and layouts stayed in registers across it and spilled: 56/60 bytes of spill
// stores/loads, float SUM on sm_90, ptxas -v). Piece j's chunks of the other ranks into this rank's
// workspace, for them to fold (this rank's own chunk is folded from its input):
template <class T>
__device__ RR_NOINLINE void copy_in(const SymArgs& a, uint64_t e0, int64_t j) {
  const Pieces p{a, e0, a.numel};
  const T* in = static_cast<const T*>(a.in);
  const Layout L = p.layout(j, j * a.chunk_elems, 0);
  for (int c = 0; c < a.nranks; ++c) {
    if (c == a.rank) continue;
    const ring::Span P = p.part(j, c);
    copy(reinterpret_cast<T*>(a.data[a.rank] + L.at(P.begin, 0, sizeof(T))), in + P.begin, P.count);
  }
}
// and piece j's reduced chunks copied out of their owners.
template <class T>
__device__ RR_NOINLINE void copy_out(const SymArgs& a, uint64_t e0, int64_t j) {
  const Pieces p{a, e0, a.numel};
  T* out = static_cast<T*>(a.out);
  const Layout L = p.layout(j, j * a.chunk_elems, 0);
  for (int c = 0; c < a.nranks; ++c) {
    if (c == a.rank) continue;
    const ring::Span Q = p.part(j, c);
    copy(out + Q.begin, reinterpret_cast<const T*>(a.data[c] + L.at(Q.begin, 0, sizeof(T))), Q.count);
  }
}

template <class T, RedOp Op>
__global__ void __launch_bounds__(kThreads) sym_kernel(const __grid_constant__ SymArgs a) {
  const int n = a.nranks, r = a.rank, tid = threadIdx.x, nb = gridDim.x;
  const Coll coll = static_cast<Coll>(a.coll);
  const Algo algo = static_cast<Algo>(a.algo);
  const uint64_t es = sizeof(T);
  __shared__ unsigned s_claim;
  __shared__ uint64_t s_epoch;
  if (tid == 0) s_claim = 0;
  // its barrier publishes s_claim and s_epoch too
  if (broken_at_start(a, &a.self->sym[blockIdx.x].epoch.value, &s_epoch)) return;
  uint64_t e0 = s_epoch;
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  if (algo == Algo::Imported) {
    // The start barrier carries every rank's tag and prediction hash; every block of every rank
    // reads the same words, so all decide alike: in place where every rank predicted the same
    // tags (each prediction holds its rank's own tag, so the same is the right one), else
    // two-shot through the workspace, its pieces numbered after this barrier. In place (or
    // stopped), the call ends here: one piece.
    __shared__ int s_in_place;
    if (!barrier(a, e0 + 1, kStart, 0, 0, &s_claim, true)) return end_epochs(a, e0 + 1);
    if (tid == 0) {
      // Block 0 also writes what it saw, for the host's next prediction (Endpoint::learn): each
      // tag as it is read (an array of them took 128 bytes of stack), `seq` last.
      volatile HostCtl::Seen* seen = blockIdx.x == 0 ? &a.ctl->seen[a.op_seq % kSeenSlots] : nullptr;
      bool right = a.tag_hash != 0;
      for (int q = 0; q < n; ++q) {
        uint64_t tag = a.tag;
        if (q != r) {
          const uint4 w = __ldcg(reinterpret_cast<const uint4*>(a.self->sym_tag[(e0 + 1) & 1][blockIdx.x][q]));
          uint64_t tw[2];
          __builtin_memcpy(tw, &w, sizeof tw);
          tag = tw[0];
          right = right && tw[1] == a.tag_hash;
        }
        if (seen) seen->tags[q] = tag;
      }
      s_in_place = right;
      if (seen) {
        seen->in_place = right;
        __threadfence_system();
        seen->seq = a.op_seq;
      }
    }
    __syncthreads();
    if (s_in_place) {
      const ring::Span P = ring::channel_part(ring::chunk(a.numel, n, r), nb, blockIdx.x);
      const uint64_t off = static_cast<uint64_t>(P.begin) * es;
      fold<T, Op>(Targets<T>{nullptr, a.imp, off, r}, n, Sources<T>{nullptr, -1, a.imp, off}, n, P.count,
                  a.divisor);
      barrier(a, e0 + 1, kEnd, 0, 0, &s_claim);
      return end_epochs(a, e0 + 1);
    }
    ++e0;
  }
  if (algo == Algo::Registered) {
    const ring::Span P = ring::channel_part(ring::chunk(a.numel, n, r), nb, blockIdx.x);
    if (barrier(a, e0 + 1, kStart, 0, a.reg_tag, &s_claim)) {
      const uint64_t off = static_cast<uint64_t>(P.begin) * es;
      fold<T, Op>(Targets<T>{nullptr, a.data, off, r}, n, Sources<T>{nullptr, -1, a.data, off}, n,
                  P.count, a.divisor);
      barrier(a, e0 + 1, kEnd, 0, a.reg_tag, &s_claim);
    }
  } else {
    const int64_t C = a.chunk_elems, pieces = a.pieces;  // (Imported's two-shot too)
    const uint64_t nbytes = static_cast<uint64_t>(C) * es;
    const Pieces p{a, e0, coll == Coll::AllReduce ? a.numel : a.numel / n};
    if (coll == Coll::AllReduce && (algo == Algo::TwoShot || algo == Algo::Imported)) {
      // Pipelined: one barrier per piece (and one to start). Piece j + 1's inputs are copied in
      // between piece j's fold and the barrier after it, which then says both "my chunk of piece j
      // is reduced" and "my inputs of piece j + 1 are in"; piece j's reduced chunks are copied out
      // after it. Halves alternate by piece, so piece j + 1 reuses piece j - 1's half: its copy in
      // writes the other ranks' chunks there while the peers may still copy this rank's reduced
      // chunk r of piece j - 1 out of it (disjoint regions: copy_in must never write chunk r), and
      // its fold writes chunk r only after the barrier, which the peers reach after those copies.
      copy_in<T>(a, e0, 0);
      bool ok = barrier(a, p.epoch(0), kStart, 0, nbytes, &s_claim);
      for (int64_t j = 0; ok && j < pieces; ++j) {
        const Layout L = p.layout(j, j * C, 0);
        const ring::Span P = p.part(j, r);
        const uint64_t off = L.at(P.begin, 0, es);
        fold<T, Op>(Targets<T>{out + P.begin, a.data, off, r}, 2, Sources<T>{in + P.begin, r, a.data, off}, n,
                    P.count, a.divisor);
        if (j + 1 < pieces) {
          copy_in<T>(a, e0, j + 1);
          ok = barrier(a, p.epoch(j + 1), kStart, j + 1, nbytes, &s_claim);
        } else {
          ok = barrier(a, p.epoch(j), kMiddle, j, nbytes, &s_claim);
        }
        if (!ok) break;
        copy_out<T>(a, e0, j);
      }
    } else {
      const int64_t m = p.span;  // reduce_scatter, all_gather: the chunk
      for (int64_t j = 0; j < pieces; ++j) {
        const uint64_t e = p.epoch(j);
        const int64_t begin = j * C;
        if (coll == Coll::AllReduce) {  // one-shot
          const Layout L = p.layout(j, begin, 0);
          const ring::Span P = p.mine(j, 0, C);
          copy(reinterpret_cast<T*>(a.data[r] + L.at(P.begin, 0, es)), in + P.begin, P.count);
          if (!barrier(a, e, kStart, j, nbytes, &s_claim)) break;
          const uint64_t off = L.at(P.begin, 0, es);
          fold<T, Op>(Targets<T>{out + P.begin, a.data, off, r}, 1, Sources<T>{in + P.begin, r, a.data, off}, n,
                      P.count, a.divisor);
        } else if (coll == Coll::ReduceScatter) {
          // Region c of the half holds this piece of chunk c; the output is chunk r alone.
          const uint64_t region = nbytes + kVecBytes;
          const ring::Span P = p.mine(j, 0, C);
          for (int c = 0; c < n; ++c) {
            if (c == r) continue;
            const Layout L = p.layout(j, c * m + begin, region);
            copy(reinterpret_cast<T*>(a.data[r] + L.at(P.begin, c, es)), in + c * m + P.begin, P.count);
          }
          if (!barrier(a, e, kStart, j, nbytes, &s_claim)) break;
          const Layout L = p.layout(j, r * m + begin, region);
          const uint64_t off = L.at(P.begin, r, es);
          fold<T, Op>(Targets<T>{out + P.begin, a.data, off, r}, 1,
                      Sources<T>{in + r * m + P.begin, r, a.data, off}, n, P.count, a.divisor);
        } else {  // all_gather: the input is this rank's chunk of the output
          const ring::Span P = p.mine(j, 0, C);
          const Layout own = p.layout(j, r * m + begin, 0);
          copy(reinterpret_cast<T*>(a.data[r] + own.at(P.begin, 0, es)), in + P.begin, P.count);
          copy(out + r * m + P.begin, in + P.begin, P.count);
          if (!barrier(a, e, kStart, j, nbytes, &s_claim)) break;
          for (int q = 0; q < n; ++q) {
            if (q == r) continue;
            const Layout L = p.layout(j, q * m + begin, 0);
            copy(out + q * m + P.begin, reinterpret_cast<const T*>(a.data[q] + L.at(P.begin, 0, es)), P.count);
          }
        }
      }
    }
  }
  end_epochs(a, e0 + (algo == Algo::Registered ? 1 : a.pieces));
}

}  // namespace

void launch_sym(const SymArgs& a, cudaStream_t stream) {
  if (a.wire != static_cast<uint8_t>(Wire::None)) return launch_sym_wire(a, stream);
  const Algo algo = static_cast<Algo>(a.algo);
  if (algo == Algo::LL) return launch_ll(a, stream);
  if (a.nranks < 2 || a.nranks > kMaxPeers || a.blocks < 1 || a.blocks > kMaxSymBlocks ||
      (algo != Algo::OneShot && algo != Algo::TwoShot && algo != Algo::Registered && algo != Algo::Imported) ||
      (algo == Algo::OneShot && a.coll != static_cast<uint8_t>(Coll::AllReduce)) ||
      ((algo == Algo::Registered || algo == Algo::Imported) &&
       (a.coll != static_cast<uint8_t>(Coll::AllReduce) || a.in != a.out)) ||
      (algo != Algo::Registered && (a.chunk_elems < 1 || a.pieces < 1)))
    throw std::invalid_argument("ringreduce: p2p symmetric workspace launch: bad algorithm, block, "
                                "rank or piece count");
  dispatch_dtype(static_cast<DType>(a.dtype), [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(static_cast<RedOp>(a.op), [&](auto optag) {
      constexpr auto kernel = &sym_kernel<T, decltype(optag)::value>;
      RR_LAUNCH(kernel, a.blocks, kThreads, stream, a);
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringreduce::cuda::p2p
