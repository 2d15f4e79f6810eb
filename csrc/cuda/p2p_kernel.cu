// The ring kernel of the p2p transport: one block per channel runs the schedule of Ring::run in
// csrc/shm/protocol.cpp on its part of every chunk. Thread 0 waits and checks headers; the block
// moves the data; thread 0 posts. Flags are release/acquire at system scope.
#include "cuda/kernels.h"
#include "cuda/p2p.h"
#include "cuda/platform.cuh"
#include "cuda/reduce.cuh"

namespace ringreduce::cuda::p2p {
namespace {

// Flag polls between checks of abort words and the clock: an abort check reads peer memory, so it
// is done every 64 polls (NCCL checks its abort flag every few hundred spins for the same reason).
constexpr uint32_t kPollsPerCheck = 64;

// Where a block is in the schedule (for error records).
struct Where {
  int phase, step;
  int64_t slice;
};

struct Chan {
  uint64_t sent, received;
  uint32_t index;  // message index within the call
};

__device__ MsgHeader my_header(const RingArgs& a, uint64_t nbytes, uint32_t index) {
  MsgHeader h;
  h.op_seq = a.op_seq;
  h.numel = a.numel;
  h.nbytes = nbytes;
  h.index = index;
  h.coll = a.coll;
  h.dtype = a.dtype;
  h.op = a.op;
  h.pad = 0;
  return h;
}

// Thread 0: waits until *ctr >= target. Returns 0, or the abort word that ended the wait; *local
// tells whether this wait saw the cause itself (host abort, timeout) or learned of it.
__device__ uint32_t wait_ge(const RingArgs& a, const uint64_t* ctr, uint64_t target,
                            const Area* peer, bool* local) {
  *local = true;
  if (ld_acquire_sys(ctr) >= target) return 0;
  const uint64_t t0 = globaltimer_ns();
  for (uint32_t polls = 1;; ++polls) {
    if (ld_acquire_sys(ctr) >= target) return 0;
    spin_hint();
    if (polls % kPollsPerCheck) continue;
    if (ld_relaxed_sys(&a.ctl->abort)) return abort_word(kHostAbort, a.rank);
    if (globaltimer_ns() - t0 > a.timeout_ns) return abort_word(kTimeout, a.rank);
    *local = false;
    uint32_t w = ld_relaxed_sys(&a.self->abort);  // another channel of this rank stopped
    if (w) return w;
    w = ld_relaxed_sys(&peer->abort);  // the neighbour stopped
    if (w) return w;
    *local = true;
  }
}

// Thread 0: records the first stop of this channel for the host and tells the neighbours.
__device__ void record_stop(const RingArgs& a, uint32_t word, bool local, int peer, const Where& w,
                            bool slot, const MsgHeader& mine, const MsgHeader* got) {
  // System scope: the neighbours poll this word from other GPUs (ld.relaxed.sys); a plain
  // atomicCAS is device scope only and not guaranteed to become visible to them.
  atomicCAS_system(&a.self->abort, 0u, word);
  volatile ErrorRecord* e = &a.ctl->err[blockIdx.x];
  if (e->word) return;
  e->local = local;
  e->peer = peer;
  e->phase = w.phase;
  e->step = w.step;
  e->waiting_for_slot = slot;
  e->slice = w.slice;
  *const_cast<MsgHeader*>(&e->mine) = mine;
  if (got) *const_cast<MsgHeader*>(&e->got) = *got;
  __threadfence_system();
  e->word = word;
}

// Thread 0 waits for what the step needs: a message from upstream (and checks its header) and/or
// a free slot at downstream. The block learns the outcome; false: stop.
__device__ bool step_begin(const RingArgs& a, const Chan& c, bool recv, bool send,
                           uint64_t expect_bytes, const Where& w) {
  __shared__ uint32_t s_stop;
  if (threadIdx.x == 0) {
    const int k = blockIdx.x;
    const int up = (a.rank + a.nranks - 1) % a.nranks, down = (a.rank + 1) % a.nranks;
    const MsgHeader mine = my_header(a, expect_bytes, c.index);
    uint32_t stop = 0;
    bool local = true;
    if (recv) {
      stop = wait_ge(a, &a.up->ch[k].posted.value, c.received + 1, a.up, &local);
      if (stop) {
        record_stop(a, stop, local, up, w, false, mine, nullptr);
      } else {
        MsgHeader got;
        const volatile MsgHeader* h = &a.up->hdr[k][c.received % kSlots];
        got.op_seq = h->op_seq;
        got.numel = h->numel;
        got.nbytes = h->nbytes;
        got.index = h->index;
        got.coll = h->coll;
        got.dtype = h->dtype;
        got.op = h->op;
        got.pad = 0;
        uint32_t cause = kOk;
        if (got.op_seq != mine.op_seq || got.coll != mine.coll || got.dtype != mine.dtype ||
            got.op != mine.op || got.numel != mine.numel)
          cause = kMismatch;
        else if (got.nbytes != expect_bytes)
          cause = kBadSize;
        if (cause != kOk) {
          stop = abort_word(cause, a.rank);
          record_stop(a, stop, true, up, w, false, mine, &got);
        }
      }
    }
    if (!stop && send && c.sent + 1 > static_cast<uint64_t>(kSlots)) {
      stop = wait_ge(a, &a.down->ch[k].consumed.value, c.sent + 1 - kSlots, a.down, &local);
      if (stop) record_stop(a, stop, local, down, w, true, mine, nullptr);
    }
    s_stop = stop;
  }
  __syncthreads();
  return s_stop == 0;
}

// After the block has moved the data: thread 0 publishes the message (header, then posted) and/or
// frees the upstream slot (consumed). The barrier orders every thread's accesses before them.
__device__ void step_end(const RingArgs& a, Chan& c, bool recv, bool send, uint64_t send_bytes) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const int k = blockIdx.x;
    if (send) {
      volatile MsgHeader* h = &a.self->hdr[k][c.sent % kSlots];
      const MsgHeader m = my_header(a, send_bytes, c.index);
      h->op_seq = m.op_seq;
      h->numel = m.numel;
      h->nbytes = m.nbytes;
      h->index = m.index;
      h->coll = m.coll;
      h->dtype = m.dtype;
      h->op = m.op;
      st_release_sys(&a.self->ch[k].posted.value, c.sent + 1);
    }
    if (recv) st_release_sys(&a.self->ch[k].consumed.value, c.received + 1);
  }
  if (send) ++c.sent, ++c.index;
  if (recv) ++c.received;
}

template <class T>
__device__ __forceinline__ T* slot_at(const RingArgs& a, const char* data, uint64_t msg,
                                      int64_t begin) {
  const uint64_t slot = static_cast<uint64_t>(blockIdx.x) * kSlots + msg % kSlots;
  const uint64_t shift = (static_cast<uint64_t>(begin) * sizeof(T)) & (kVecBytes - 1);
  return reinterpret_cast<T*>(const_cast<char*>(data) + slot * a.slot_stride + shift);
}

template <class T, RedOp Op>
__global__ void __launch_bounds__(kThreads) ring_kernel(RingArgs a) {
  const int n = a.nranks, r = a.rank, tid = threadIdx.x, nt = blockDim.x;
  const Coll coll = static_cast<Coll>(a.coll);
  const bool ar = coll == Coll::AllReduce;
  const bool rs = coll != Coll::AllGather, ag = coll != Coll::ReduceScatter;
  const int64_t m = a.numel / n, S = a.slice_elems;
  auto part = [&](int c, int64_t j) {
    const ring::Span ch = ar ? ring::chunk(a.numel, n, c) : ring::Span{c * m, m};
    return ring::slice(ring::channel_part(ch, a.nch, blockIdx.x), j, S);
  };
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  // Reduce-scatter's output holds only chunk r; all-gather's input holds only chunk r.
  const int64_t out_shift = coll == Coll::ReduceScatter ? r * m : 0;
  const int64_t in_shift = coll == Coll::AllGather ? r * m : 0;
  const uint64_t es = sizeof(T);

  // A ring broken before this kernel started stops it here, and records that this call failed too
  // (the host tells a call's success by the first failed op_seq).
  __shared__ uint32_t s_broken;
  if (tid == 0) {
    const uint32_t word = ld_relaxed_sys(&a.self->abort);
    s_broken = word | ld_relaxed_sys(&a.ctl->abort);
    if (s_broken) {
      const uint32_t w = word ? word : abort_word(kHostAbort, r);
      record_stop(a, w, abort_rank(w) == r, -1, Where{-1, 0, 0}, false, my_header(a, 0, 0), nullptr);
    }
  }
  __syncthreads();
  if (s_broken) return;

  // Where this channel's FIFO stands: its own counters (every earlier kernel of this ring has
  // finished: one stream). Read from memory, not passed at launch, so that a CUDA graph replaying
  // this launch goes on from where the ring is now, not from where it was when captured.
  __shared__ uint64_t s_sent, s_received;
  if (tid == 0) {
    s_sent = ld_acquire_sys(&a.self->ch[blockIdx.x].posted.value);
    s_received = ld_acquire_sys(&a.self->ch[blockIdx.x].consumed.value);
  }
  __syncthreads();
  Chan c{s_sent, s_received, 0};
  for (int64_t j = 0; j < a.num_slices; ++j) {
    if (rs) {
      Where w{0, 0, j};
      const ring::Span sp = part(ring::rs_send_chunk(r, 0, n), j);
      if (!step_begin(a, c, false, true, 0, w)) return;
      span_op<T, RedOp::Sum, false>(slot_at<T>(a, a.self_data, c.sent, sp.begin), nullptr, in + sp.begin,
                            nullptr, sp.count, 1, tid, nt);
      step_end(a, c, false, true, sp.count * es);
      for (int s = 0; s < n - 1; ++s) {
        w.step = s;
        const ring::Span rp = part(ring::rs_recv_chunk(r, s, n), j);
        const bool last = s == n - 2, send = !last || ag;
        if (!step_begin(a, c, true, send, rp.count * es, w)) return;
        const T* src = slot_at<T>(a, a.up_data, c.received, rp.begin);
        T* fwd = send ? slot_at<T>(a, a.self_data, c.sent, rp.begin) : nullptr;
        if (!last)  // recv, reduce, send
          span_op<T, Op, true>(fwd, nullptr, src, in + rp.begin, rp.count, 1, tid, nt);
        else  // recv, reduce, copy (the chunk is final here) and send it on for the all-gather
          span_op<T, Op, true>(out + (rp.begin - out_shift), fwd, src, in + rp.begin, rp.count,
                               a.divisor, tid, nt);
        step_end(a, c, true, send, rp.count * es);
      }
    }
    if (ag) {
      Where w{1, 0, j};
      if (!rs) {  // all-gather alone: this rank's chunk comes from the input
        const ring::Span sp = part(r, j);
        const T* src = in + (sp.begin - in_shift);
        if (!step_begin(a, c, false, true, 0, w)) return;
        span_op<T, RedOp::Sum, false>(slot_at<T>(a, a.self_data, c.sent, sp.begin),
                              src != out + sp.begin ? out + sp.begin : nullptr, src, nullptr,
                              sp.count, 1, tid, nt);
        step_end(a, c, false, true, sp.count * es);
      }
      for (int t = 0; t < n - 1; ++t) {
        w.step = t;
        const ring::Span rp = part(ring::ag_recv_chunk(r, t, n), j);
        const bool send = t < n - 2;  // recv, copy, send; the last step only copies
        if (!step_begin(a, c, true, send, rp.count * es, w)) return;
        const T* src = slot_at<T>(a, a.up_data, c.received, rp.begin);
        span_op<T, RedOp::Sum, false>(out + rp.begin,
                              send ? slot_at<T>(a, a.self_data, c.sent, rp.begin) : nullptr, src,
                              nullptr, rp.count, 1, tid, nt);
        step_end(a, c, true, send, rp.count * es);
      }
    }
  }
}

}  // namespace

void launch_ring(const RingArgs& a, cudaStream_t stream) {
  if (a.nch < 1 || a.nch > kMaxChannels || a.nranks < 2)
    throw std::invalid_argument("ringreduce: launch_ring: bad channel or rank count");
  dispatch_dtype(static_cast<DType>(a.dtype), [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(static_cast<RedOp>(a.op), [&](auto optag) {
      constexpr auto kernel = &ring_kernel<T, decltype(optag)::value>;
      RR_LAUNCH(kernel, a.nch, kThreads, stream, a);
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringreduce::cuda::p2p
