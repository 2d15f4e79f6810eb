// The ring and copy kernels of the p2p transport (the symmetric workspace's are in sym_kernel.cu).
// Data is pushed: a rank writes into the memory of the rank that needs the data (16-byte stores)
// and raises a flag there; every wait polls the waiting rank's own memory (relaxed loads, one
// acquire fence after success), so no wait crosses the link.
//   ring: one block per channel runs the schedule of csrc/ring/schedule.h on its part of every
//         chunk; each message goes from the sender's input or FIFO straight into the receiver's
//         FIFO. The receiver's FIFO is the one copy left (user tensors are not mapped by the
//         peers): all-gather copies each arriving slice from it into the output. It walks the
//         schedule itself rather than through ring/loop.h (the host transports' loop): its
//         primitives are a block's threads polling device flags, which a host loop cannot call,
//         and one launch runs every step of a call.
//   copy: see copy_kernel.
// Every message carries the call's header, checked against this rank's call from local memory.
#include "cuda/p2p/device.cuh"
#include "cuda/reduce.cuh"

namespace ringreduce::cuda::p2p {
namespace {

// Thread 0: waits until *ctr (in this rank's memory) >= target. Returns 0, or the abort word that
// ended the wait; *local tells whether this wait saw the cause itself (host abort, timeout) or
// learned of it from the abort word a peer or another block wrote here. *seen: the value read.
__device__ uint32_t wait_ge(const Args& a, const uint64_t* ctr, uint64_t target, bool* local,
                            uint64_t* seen = nullptr) {
  *local = true;
  uint64_t v = ld_relaxed_sys(ctr);
  if (v < target) {
    const uint64_t t0 = globaltimer_ns();
    for (uint32_t polls = 1;; ++polls) {
      v = ld_relaxed_sys(ctr);
      if (v >= target) break;
      spin_hint();
      if (polls % kPollsPerCheck) continue;
      // The host's word across PCIe, less often (sym_wait's reasons).
      if ((polls / kPollsPerCheck) % 16 == 0 && ld_relaxed_sys(&a.ctl->abort)) return abort_word(kHostAbort, a.rank);
      if (globaltimer_ns() - t0 > a.timeout_ns) return abort_word(kTimeout, a.rank);
      const uint32_t w = ld_relaxed_sys(&a.self->abort);
      if (w) {
        *local = false;
        return w;
      }
    }
  }
  fence_acq_rel_sys();
  note_wait(ctr);
  if (seen) *seen = v;
  return 0;
}

// ---- ring ------------------------------------------------------------------------------------------

struct Chan {
  uint64_t sent, received;
  uint64_t credits;  // thread 0: the last credit count read (NCCL caches its peer's tail the same way)
  uint32_t index;    // message index within the call
};

// Thread 0 waits for what the step needs: a message in this rank's FIFO (and checks its header)
// and/or a free slot in downstream's FIFO (a credit). The block learns the outcome; false: stop.
__device__ bool step_begin(const Args& a, Chan& c, bool recv, bool send, uint64_t expect_bytes,
                           const Where& w) {
  __shared__ uint32_t s_stop;
  if (threadIdx.x == 0) {
    const int k = blockIdx.x;
    const int up = (a.rank + a.nranks - 1) % a.nranks, down = (a.rank + 1) % a.nranks;
    MsgHeader mine = my_header(a, expect_bytes, 0);
    uint32_t stop = 0;
    bool local = true;
    if (recv) {
      stop = wait_ge(a, &a.self->ring[k].posted.value, c.received + 1, &local);
      if (stop) {
        record_stop(a, stop, local, up, w, false, mine, nullptr);
      } else {
        const MsgHeader got = get_header(&a.self->ring_hdr[k][c.received % kSlots]);
        mine.index = got.index;  // the ring numbers messages per sender; the schedule checks sizes
        const uint32_t cause = check_header(got, mine);
        if (cause != kOk) {
          stop = abort_word(cause, a.rank);
          record_stop(a, stop, true, up, w, false, mine, &got);
        }
      }
    }
    const uint64_t need = c.sent + 1 > static_cast<uint64_t>(kSlots) ? c.sent + 1 - kSlots : 0;
    if (!stop && send && c.credits < need) {
      stop = wait_ge(a, &a.self->ring[k].credits.value, need, &local, &c.credits);
      if (stop) record_stop(a, stop, local, down, w, true, mine, nullptr);
    }
    s_stop = stop;
  }
  __syncthreads();
  return s_stop == 0;
}

// After the block has moved the data: thread 0 writes the header into downstream's FIFO and raises
// its posted count, and/or returns the slot to upstream (a credit). The barrier orders every
// thread's accesses before them; one system fence (the release of both) orders them before the
// flags: the block's remote stores land first, and its reads of the slot end first.
__device__ void step_end(const Args& a, Chan& c, bool recv, bool send, uint64_t send_bytes) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const int k = blockIdx.x;
    if (send) put_header(&a.down->ring_hdr[k][c.sent % kSlots], my_header(a, send_bytes, c.index));
    fence_acq_rel_sys();
    if (send) st_relaxed_sys(&a.down->ring[k].posted.value, c.sent + 1);
    if (recv) st_relaxed_sys(&a.up->ring[k].credits.value, c.received + 1);
  }
  if (send) ++c.sent, ++c.index;
  if (recv) ++c.received;
}

template <class T>
__device__ __forceinline__ T* slot_at(const Args& a, char* fifo, uint64_t msg, int64_t begin) {
  const uint64_t slot = static_cast<uint64_t>(blockIdx.x) * kSlots + msg % kSlots;
  const uint64_t shift = (static_cast<uint64_t>(begin) * sizeof(T)) & (kVecBytes - 1);
  return reinterpret_cast<T*>(fifo + slot * a.slot_stride + shift);
}

template <class T, RedOp Op>
__global__ void __launch_bounds__(kThreads) ring_kernel(Args a) {
  const int n = a.nranks, r = a.rank, tid = threadIdx.x, nt = blockDim.x;
  const Coll coll = static_cast<Coll>(a.coll);
  const bool ar = coll == Coll::AllReduce;
  const bool rs = coll != Coll::AllGather, ag = coll != Coll::ReduceScatter;
  const int64_t m = a.numel / n, S = a.slice_elems;
  auto part = [&](int c, int64_t j) {
    const ring::Span ch = ar ? ring::chunk(a.numel, n, c) : ring::Span{c * m, m};
    return ring::slice(ring::channel_part(ch, a.blocks, blockIdx.x), j, S);
  };
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  // Reduce-scatter's output holds only chunk r; all-gather's input holds only chunk r.
  const int64_t out_shift = coll == Coll::ReduceScatter ? r * m : 0;
  const int64_t in_shift = coll == Coll::AllGather ? r * m : 0;
  const uint64_t es = sizeof(T);
  if (broken_at_start(a)) return;

  // Where this channel's FIFOs stand: this rank's own counts (every earlier kernel of this group
  // has finished: one stream). Read from memory, not passed at launch, so that a CUDA graph
  // replaying this launch goes on from where the ring is now, not from where it was when captured.
  __shared__ uint64_t s_sent, s_received, s_credits;
  RingFlags* f = &a.self->ring[blockIdx.x];
  if (tid == 0) {
    s_sent = ld_relaxed_sys(&f->sent.value);
    s_received = ld_relaxed_sys(&f->received.value);
    s_credits = 0;  // unknown: the first send that needs one reads it
  }
  __syncthreads();
  Chan c{s_sent, s_received, s_credits, 0};
  char* mine = a.self_data;
  char* theirs = a.down_data;
  bool ok = true;
  for (int64_t j = 0; ok && j < a.steps; ++j) {
    if (rs) {
      Where w{0, 0, j};
      const ring::Span sp = part(ring::rs_send_chunk(r, 0, n), j);
      if (!(ok = step_begin(a, c, false, true, 0, w))) break;
      span_op<T, RedOp::Sum, false>(slot_at<T>(a, theirs, c.sent, sp.begin), nullptr, in + sp.begin,
                                    nullptr, sp.count, 1, tid, nt);
      step_end(a, c, false, true, sp.count * es);
      for (int s = 0; s < n - 1; ++s) {
        w.step = s;
        const ring::Span rp = part(ring::rs_recv_chunk(r, s, n), j);
        const bool last = s == n - 2, send = !last || ag;
        if (!(ok = step_begin(a, c, true, send, rp.count * es, w))) break;
        const T* src = slot_at<T>(a, mine, c.received, rp.begin);
        T* fwd = send ? slot_at<T>(a, theirs, c.sent, rp.begin) : nullptr;
        if (!last)  // recv, reduce, send
          span_op<T, Op, true>(fwd, nullptr, src, in + rp.begin, rp.count, 1, tid, nt);
        else  // recv, reduce, copy (the chunk is final here) and send it on for the all-gather
          span_op<T, Op, true>(out + (rp.begin - out_shift), fwd, src, in + rp.begin, rp.count,
                               a.divisor, tid, nt);
        step_end(a, c, true, send, rp.count * es);
      }
      if (!ok) break;
    }
    if (ag) {
      Where w{1, 0, j};
      if (!rs) {  // all-gather alone: this rank's chunk comes from the input
        const ring::Span sp = part(r, j);
        const T* src = in + (sp.begin - in_shift);
        if (!(ok = step_begin(a, c, false, true, 0, w))) break;
        span_op<T, RedOp::Sum, false>(slot_at<T>(a, theirs, c.sent, sp.begin),
                                      src != out + sp.begin ? out + sp.begin : nullptr, src, nullptr,
                                      sp.count, 1, tid, nt);
        step_end(a, c, false, true, sp.count * es);
      }
      for (int t = 0; t < n - 1; ++t) {
        w.step = t;
        const ring::Span rp = part(ring::ag_recv_chunk(r, t, n), j);
        const bool send = t < n - 2;  // recv, copy, send; the last step only copies
        if (!(ok = step_begin(a, c, true, send, rp.count * es, w))) break;
        const T* src = slot_at<T>(a, mine, c.received, rp.begin);
        span_op<T, RedOp::Sum, false>(out + rp.begin, send ? slot_at<T>(a, theirs, c.sent, rp.begin)
                                                           : nullptr,
                                      src, nullptr, rp.count, 1, tid, nt);
        step_end(a, c, true, send, rp.count * es);
      }
    }
  }
  // Where the FIFOs stand for the next launch (also after a stop: the group is broken then).
  __syncthreads();
  if (tid == 0) {
    f->sent.value = c.sent;
    f->received.value = c.received;
  }
}

// ---- copy ------------------------------------------------------------------------------------------

// One piece of a copy-algorithm call (Endpoint::run_copy): every peer's part is in this rank's inbox
// (the stream waited for it), so no block waits for anything. Thread 0 of each block checks the
// abort words and every source's header first; a block that finds the group stopped or the calls
// mismatched records it and does nothing else (every block decides for itself and records, so a
// call is never reported done with part of it skipped). Then the blocks fold (all_reduce,
// reduce_scatter: every rank's part in rank order, as one-shot and two-shot do: the same bits) or
// copy (all_gather) their part of the piece.
template <class T, RedOp Op>
__global__ void __launch_bounds__(kThreads) copy_kernel(Args a) {
  const int n = a.nranks, r = a.rank;
  const int64_t es = sizeof(T);
  __shared__ uint32_t s_stop;
  if (threadIdx.x == 0) {
    const MsgHeader mine = my_header(a, a.piece_count * es, a.piece_index);
    MsgHeader got{};
    int peer = -1;
    uint32_t stop = ld_relaxed_sys(&a.self->abort);
    if (!stop && a.cctl) stop = ld_relaxed_sys(&a.cctl->abort);
    bool local = stop && abort_rank(stop) == r;
    if (!stop && ld_relaxed_sys(&a.ctl->abort)) {
      stop = abort_word(kHostAbort, r);
      local = true;
    }
    for (int q = 0; q < n && !stop; ++q) {
      if (q == r) continue;
      got = get_header(&a.self->copy_hdr[a.copy_slot][q]);
      const uint32_t cause = check_header(got, mine);
      if (cause != kOk) {
        stop = abort_word(cause, r);
        local = true;
        peer = q;
      }
    }
    if (stop)
      record_stop(a, stop, local, peer, Where{2, 0, a.piece_index}, false, mine,
                  peer >= 0 ? &got : nullptr);
    s_stop = stop;
  }
  __syncthreads();
  if (s_stop) return;
  const int64_t m = a.numel / n;
  const bool ag = a.coll == static_cast<uint8_t>(Coll::AllGather);
  const bool rs = a.coll == static_cast<uint8_t>(Coll::ReduceScatter);
  const ring::Span P = ring::channel_part(ring::Span{0, a.piece_count}, gridDim.x, blockIdx.x);
  const int64_t at = a.piece_begin + P.begin;  // in the span the pieces cut
  // Each source's slot is aligned as its destination (Endpoint::run_copy): all_gather's chunks may
  // start anywhere mod 16 in the output.
  auto inbox = [&](int q) {
    const int64_t at_out = ag ? q * m + a.piece_begin : a.piece_begin;
    const uint64_t shift = (static_cast<uint64_t>(at_out) * sizeof(T)) & (kVecBytes - 1);
    return reinterpret_cast<const T*>(a.self_data + (a.copy_slot * n + q) * a.slot_stride + shift) + P.begin;
  };
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  if (ag) {
    for (int q = 0; q < n; ++q) {
      const T* src = q == r ? in + at : inbox(q);
      T* dst = out + q * m + at;
      if (src != dst)
        span_op<T, RedOp::Sum, false>(dst, nullptr, src, nullptr, P.count, 1, threadIdx.x, blockDim.x);
    }
  } else {
    const T* mine = in + (rs ? r * m : 0) + at;
    T* dst[1] = {out + at};
    span_fold<T, Op>(dst, 1, [&](int q) { return q == r ? mine : inbox(q); }, n, P.count, a.divisor,
                     threadIdx.x, blockDim.x);
  }
  // A release (host abort, dead peer, timeout elsewhere) lets the peers' streams go on and copy
  // their next pieces into this rank's slots, perhaps while this block read them: the abort word
  // is written before any release, so a stop seen now marks this piece (and call) failed rather
  // than done with mixed data.
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_acq_rel_sys();
    uint32_t w = ld_relaxed_sys(&a.self->abort);
    if (!w && a.cctl) w = ld_relaxed_sys(&a.cctl->abort);
    if (!w && ld_relaxed_sys(&a.ctl->abort)) w = abort_word(kHostAbort, r);
    if (w)
      record_stop(a, w, abort_rank(w) == r, -1, Where{2, 0, a.piece_index}, false,
                  my_header(a, a.piece_count * es, a.piece_index), nullptr);
  }
}

}  // namespace

void launch_copy(const Args& a, int blocks, cudaStream_t stream) {
  if (a.nranks < 2 || a.nranks > kMaxPeers || blocks < 1 || blocks > kMaxBlocks ||
      a.copy_slot < 0 || a.copy_slot >= kCopyDepth)
    throw std::invalid_argument("ringreduce: p2p copy launch: bad block or rank count");
  dispatch_dtype(static_cast<DType>(a.dtype), [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(static_cast<RedOp>(a.op), [&](auto optag) {
      constexpr auto kernel = &copy_kernel<T, decltype(optag)::value>;
      RR_LAUNCH(kernel, blocks, kThreads, stream, a);
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

void launch(const Args& a, cudaStream_t stream) {
  if (a.nranks < 2 || a.blocks < 1 || a.blocks > kMaxChannels || static_cast<Algo>(a.algo) != Algo::Ring)
    throw std::invalid_argument("ringreduce: p2p ring launch: bad algorithm, block or rank count");
  dispatch_dtype(static_cast<DType>(a.dtype), [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(static_cast<RedOp>(a.op), [&](auto optag) {
      constexpr auto kernel = &ring_kernel<T, decltype(optag)::value>;
      RR_LAUNCH(kernel, a.blocks, kThreads, stream, a);
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringreduce::cuda::p2p
