// The kernels of the p2p transport. Data is pushed: a rank writes into the memory of the rank that
// needs the data (16-byte stores) and raises a flag there; every wait polls the waiting rank's own
// memory (relaxed loads, one acquire fence after success), so no wait crosses the link.
//   ring:     one block per channel runs the schedule of csrc/ring/schedule.h on its part of every
//             chunk; each message goes from the sender's input or FIFO straight into the
//             receiver's FIFO. The receiver's FIFO is the one copy left (user tensors are not
//             mapped by the peers): all-gather copies each arriving slice from it into the output.
//   one-shot: every rank writes its input into every peer's direct buffer; each reduces the n
//             inputs in rank order (bitwise identical on every rank).
//   two-shot: every rank writes chunk p of its input to rank p; rank p reduces chunk p in rank
//             order and writes the result into every rank's direct buffer, from which each copies
//             it into its output. Remote bytes as the ring's, two dependent hops instead of 2(n-1).
// Every message carries the call's header, checked against this rank's call from local memory.
#include "cuda/kernels.h"
#include "cuda/p2p.h"
#include "cuda/platform.cuh"
#include "cuda/reduce.cuh"

namespace ringreduce::cuda::p2p {
namespace {

// Flag polls between checks of the abort words and the clock (NCCL checks its abort flag every few
// hundred spins; these checks read local and host-mapped memory).
constexpr uint32_t kPollsPerCheck = 64;

// Where a block is in the schedule (for error records).
struct Where {
  int phase, step;
  int64_t slice;
};

__device__ MsgHeader my_header(const Args& a, uint64_t nbytes, uint32_t index) {
  MsgHeader h;
  h.op_seq = a.op_seq;
  h.numel = a.numel;
  h.nbytes = nbytes;
  h.index = index;
  h.coll = a.coll;
  h.dtype = a.dtype;
  h.op = a.op;
  h.algo = a.algo;
  return h;
}

// Headers move as two 16-byte words through L2, like the data (the emulator counts them as data).
static_assert(sizeof(MsgHeader) == 32, "MsgHeader is two 16-byte words");
__device__ void put_header(MsgHeader* dst, const MsgHeader& h) {
  uint4 w[2];
  __builtin_memcpy(w, &h, sizeof h);
  __stcg(reinterpret_cast<uint4*>(dst), w[0]);
  __stcg(reinterpret_cast<uint4*>(dst) + 1, w[1]);
}
__device__ MsgHeader get_header(const MsgHeader* src) {
  uint4 w[2];
  w[0] = __ldcg(reinterpret_cast<const uint4*>(src));
  w[1] = __ldcg(reinterpret_cast<const uint4*>(src) + 1);
  MsgHeader h;
  __builtin_memcpy(&h, w, sizeof h);
  return h;
}

// Whether upstream runs this very call (op_seq) as the ring while this rank runs a direct
// algorithm: its first message sits unconsumed in this rank's channel-0 FIFO. The ranks' plans
// differ (different sizes, or a shared_empty tensor on one rank only); the ring side would wait on
// a neighbour that never posts, and this side for posts that never come, until the timeout. Some
// ring rank's downstream runs a direct algorithm, so one rank sees it and stops every rank. A
// message of a later call is no mismatch: upstream may have finished this call already.
__device__ bool ring_runs_this_call(const Args& a, MsgHeader* got) {
  const uint64_t received = ld_relaxed_sys(&a.self->ring[0].received.value);
  if (ld_relaxed_sys(&a.self->ring[0].posted.value) <= received) return false;
  fence_acq_rel_sys();  // the header was written before the count
  *got = get_header(&a.self->ring_hdr[0][received % kSlots]);
  return got->op_seq == a.op_seq && got->algo == static_cast<uint8_t>(Algo::Ring);
}

// Thread 0: waits until *ctr (in this rank's memory) >= target. Returns 0, or the abort word that
// ended the wait; *local tells whether this wait saw the cause itself (host abort, timeout) or
// learned of it from the abort word a peer or another block wrote here. *seen: the value read.
// ring_call (direct waits): also ends with kMismatch when ring_runs_this_call, the ring's header
// in *ring_call.
__device__ uint32_t wait_ge(const Args& a, const uint64_t* ctr, uint64_t target, bool* local,
                            uint64_t* seen = nullptr, MsgHeader* ring_call = nullptr) {
  *local = true;
  uint64_t v = ld_relaxed_sys(ctr);
  if (v < target) {
    const uint64_t t0 = globaltimer_ns();
    for (uint32_t polls = 1;; ++polls) {
      v = ld_relaxed_sys(ctr);
      if (v >= target) break;
      spin_hint();
      if (polls % kPollsPerCheck) continue;
      if (ld_relaxed_sys(&a.ctl->abort)) return abort_word(kHostAbort, a.rank);
      if (globaltimer_ns() - t0 > a.timeout_ns) return abort_word(kTimeout, a.rank);
      const uint32_t w = ld_relaxed_sys(&a.self->abort);
      if (w) {
        *local = false;
        return w;
      }
      if (ring_call && ring_runs_this_call(a, ring_call)) return abort_word(kMismatch, a.rank);
    }
  }
  fence_acq_rel_sys();
  note_wait(ctr);
  if (seen) *seen = v;
  return 0;
}

__device__ void notify(Area* peer, uint32_t word) {
  if (peer) atomicCAS_system(&peer->abort, 0u, word);
}

// The copy algorithm's stream waits of the whole group, released after the group's abort word.
__device__ void release_copy_waits(const Args& a, uint32_t word) {
  if (!a.cctl) return;
  atomicCAS_system(&a.cctl->abort, 0u, word);
  __threadfence_system();
  for (int q = 0; q < a.nranks && q < kMaxPeers; ++q)
    for (int s = 0; s < a.nranks && s < kMaxPeers; ++s) st_relaxed_sys(&a.cctl->arrived[q][s].value, kReleased);
}

// Thread 0: records the first stop of this block for the host and writes the abort word into
// every peer this rank can reach, so that their waits (on their own memory) stop too.
__device__ void record_stop(const Args& a, uint32_t word, bool local, int peer, const Where& w,
                            bool slot, const MsgHeader& mine, const MsgHeader* got) {
  // System scope: the peers poll these words from other GPUs.
  atomicCAS_system(&a.self->abort, 0u, word);
  // A graph replaying this launch after the ring closed (kCtlClosed): the peers may have freed
  // their memory, so nothing is written into it.
  if (ld_relaxed_sys(&a.ctl->abort) != kCtlClosed) {
    notify(a.up, word);
    notify(a.down, word);
    for (int q = 0; q < a.nranks && q < kMaxPeers; ++q)
      if (q != a.rank) notify(a.peer[q], word);
    // Then every copy-algorithm wait of the group (stream waits never time out): a stream released
    // sees the abort word in its next kernel. Not after close: the counters may be unmapped.
    release_copy_waits(a, word);
  }
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

// Thread 0: the cause (kOk, kMismatch, kBadSize) of a header that should describe `mine`.
__device__ uint32_t check_header(const MsgHeader& got, const MsgHeader& mine) {
  if (got.op_seq != mine.op_seq || got.coll != mine.coll || got.dtype != mine.dtype ||
      got.op != mine.op || got.numel != mine.numel || got.algo != mine.algo)
    return kMismatch;
  if (got.nbytes != mine.nbytes || got.index != mine.index) return kBadSize;
  return kOk;
}

// A group broken before this kernel started stops it here, and records that this call failed too
// (the host tells a call's success by the first failed op_seq). Every thread returns the verdict.
__device__ bool broken_at_start(const Args& a) {
  __shared__ uint32_t s_broken;
  if (threadIdx.x == 0) {
    const uint32_t word = ld_relaxed_sys(&a.self->abort);
    s_broken = word | ld_relaxed_sys(&a.ctl->abort);
    if (s_broken) {
      const uint32_t w = word ? word : abort_word(kHostAbort, a.rank);
      record_stop(a, w, abort_rank(w) == a.rank, -1, Where{-1, 0, 0}, false, my_header(a, 0, 0),
                  nullptr);
    }
  }
  __syncthreads();
  return s_broken != 0;
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

// ---- one-shot and two-shot ----------------------------------------------------------------------

// Slot of `source`'s data for phase ph of this block's round `seq`, in the direct buffer at base
// (a rank's own, or a peer's).
template <class T>
__device__ __forceinline__ T* dslot(const Args& a, char* base, uint64_t seq, int ph, int source,
                                   int64_t begin) {
  const uint64_t slot =
      (((seq % kDirectDepth) * 2 + ph) * a.direct_blocks + blockIdx.x) * a.nranks + source;
  const uint64_t shift = (static_cast<uint64_t>(begin) * sizeof(T)) & (kVecBytes - 1);
  return reinterpret_cast<T*>(base + slot * a.slot_stride + shift);
}
__device__ __forceinline__ MsgHeader* dheader(Area* area, uint64_t seq, int ph, int source) {
  return &area->direct_hdr[seq % kDirectDepth][ph][blockIdx.x][source];
}

// Thread 0 publishes this block's phase-ph data of round `seq` (already written by the block into
// the peers' buffers: the barrier first) to every peer: headers, one system fence, then the flags.
// bytes_for(p): the bytes written to rank p; i: the round's index within the call.
template <class F>
__device__ void post_all(const Args& a, int ph, uint64_t seq, int64_t i, F bytes_for) {
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int p = 0; p < a.nranks; ++p)
      if (p != a.rank)
        put_header(dheader(a.peer[p], seq, ph, a.rank),
                   my_header(a, bytes_for(p), static_cast<uint32_t>(i)));
    fence_acq_rel_sys();
    for (int p = 0; p < a.nranks; ++p)
      if (p != a.rank) st_relaxed_sys(&a.peer[p]->direct[blockIdx.x].arrived[ph].from[a.rank], seq);
  }
}

// Thread 0 waits until every peer's phase-ph data of round `seq` has arrived here and checks their
// headers; bytes_for(q): what rank q must have sent. The block learns the outcome; false: stop.
// The outcome has a word per round parity: the same wait can come twice with no other barrier in
// between (the last rounds, which send nothing), and thread 0 must not overwrite round i's word
// while a thread still reads it; by round i + 2 every thread has passed round i + 1's barrier.
template <class F>
__device__ bool wait_all(const Args& a, int ph, uint64_t seq, int64_t i, F bytes_for) {
  __shared__ uint32_t s_stops[2];
  uint32_t& s_stop = s_stops[i & 1];
  if (threadIdx.x == 0) {
    uint32_t stop = 0;
    for (int k = 1; k < a.nranks && !stop; ++k) {
      const int q = (a.rank + k) % a.nranks;
      MsgHeader mine = my_header(a, bytes_for(q), static_cast<uint32_t>(i));
      const Where w{2 + ph, q, i};
      bool local = true;
      MsgHeader ring_call;
      ring_call.op_seq = 0;
      stop = wait_ge(a, &a.self->direct[blockIdx.x].arrived[ph].from[q], seq, &local, nullptr,
                     &ring_call);
      if (stop) {
        const bool ring = abort_cause(stop) == kMismatch && local;  // upstream's ring message
        record_stop(a, stop, local, ring ? (a.rank + a.nranks - 1) % a.nranks : q, w, false, mine,
                    ring ? &ring_call : nullptr);
        break;
      }
      const MsgHeader got = get_header(dheader(a.self, seq, ph, q));
      const uint32_t cause = check_header(got, mine);
      if (cause != kOk) {
        stop = abort_word(cause, a.rank);
        record_stop(a, stop, true, q, w, false, mine, &got);
      }
    }
    s_stop = stop;
  }
  __syncthreads();
  return s_stop == 0;
}

// A round i runs in up to three stages: send(i) writes this rank's data into the peers' slots and
// posts it (one-shot: the input to everyone; two-shot: chunk p to rank p; all-gather alone: its
// chunk to everyone, phase 1); reduce(i) waits for phase 0 and folds the n sources in rank order
// (two-shot all-reduce: into every peer's phase-1 slot too, posted); collect(i) waits for phase 1
// and copies the results out. With W = a.direct_ahead and L = W - 1: send(0 .. W-1), then per
// round reduce(i), send(i + W), collect(i - L) (all-gather alone: collect(i), send(i + W)), so
// that every wait is for a post made W or L rounds earlier. W = 1 is the lock step.
//
// Why D = kDirectDepth slots per (phase, block, source) suffice, without credits: writing round t
// into a peer's slot needs that peer done reading round t - D there.
// - One-shot, reduce-scatter (phase 0) and all-gather alone (phase 1): this rank sends round t
//   after finishing round t - W, which needed the peer's post of round t - W, sent after the peer
//   finished round t - 2W. D >= 2W.
// - Two-shot all-reduce, phase 1 of round t, written in reduce(t): after the peer's phase-0 post
//   of round t, sent in its iteration t - W after its collect(t - W - L - 1). Phase 0 of round t,
//   sent in iteration t - W: after this rank's collect(t - W - L - 1), which needed the peer's
//   phase-1 post of that round, made after it read phase 0 there (and after reduce(t - W), as
//   above: t - 2W). D >= W + L + 1 = 2W.
// Rounds count on from call to call per block (DirectFlags::seq), and every rank has finished
// every round of its earlier kernels (stream order) before any of a later one: across calls,
// collectives and algorithms the same holds.
template <class T, RedOp Op>
__global__ void __launch_bounds__(kThreads) direct_kernel(Args a) {
  const int n = a.nranks, r = a.rank, tid = threadIdx.x, nt = blockDim.x;
  const Coll coll = static_cast<Coll>(a.coll);
  const bool oneshot = static_cast<Algo>(a.algo) == Algo::OneShot;
  const bool ar = coll == Coll::AllReduce;
  const bool scatter = coll != Coll::AllGather, gather = coll != Coll::ReduceScatter;
  const int64_t m = a.numel / n;
  // The span this block moves in round i: of the whole tensor (one-shot) or of chunk c (two-shot).
  auto part = [&](int c, int64_t i) {
    const ring::Span ch = oneshot ? ring::Span{0, a.numel}
                                  : ar ? ring::chunk(a.numel, n, c) : ring::Span{c * m, m};
    return ring::slice(ring::channel_part(ch, a.blocks, blockIdx.x), i, a.slice_elems);
  };
  const T* in = static_cast<const T*>(a.in);
  T* out = static_cast<T*>(a.out);
  const int64_t out_shift = coll == Coll::ReduceScatter ? r * m : 0;
  const int64_t in_shift = coll == Coll::AllGather ? r * m : 0;
  const uint64_t es = sizeof(T);
  if (broken_at_start(a)) return;

  __shared__ uint64_t s_seq;
  DirectFlags* f = &a.self->direct[blockIdx.x];
  if (tid == 0) s_seq = ld_relaxed_sys(&f->seq.value);
  __syncthreads();
  const uint64_t seq0 = s_seq;  // round i of this call is round seq0 + 1 + i of this block
  T* dst[kMaxSpanPtrs];
  auto only = [](const T* p) { return SlotSources<T>{p, nullptr, 0, 0}; };
  // Every rank's data for phase ph of round seq at begin: this rank's own at r, else the slots.
  auto ranks = [&](uint64_t seq, int ph, int64_t begin, const T* own) {
    return SlotSources<T>{own, reinterpret_cast<const char*>(dslot<T>(a, a.self_data, seq, ph, 0, begin)),
                          a.slot_stride, r};
  };

  auto send = [&](int64_t i) {
    const uint64_t seq = seq0 + 1 + i;
    if (oneshot) {
      const ring::Span P = part(0, i);
      int nd = 0;
      for (int p = 0; p < n; ++p)
        if (p != r) dst[nd++] = dslot<T>(a, a.peer_data[p], seq, 0, r, P.begin);
      span_multi<T, RedOp::Sum>(dst, nd, only(in + P.begin), 1, P.count, 1, tid, nt);
      post_all(a, 0, seq, i, [&](int) { return P.count * es; });
    } else if (scatter) {
      for (int p = 0; p < n; ++p) {
        if (p == r) continue;
        const ring::Span sp = part(p, i);
        dst[0] = dslot<T>(a, a.peer_data[p], seq, 0, r, sp.begin);
        span_multi<T, RedOp::Sum>(dst, 1, only(in + sp.begin), 1, sp.count, 1, tid, nt);
      }
      post_all(a, 0, seq, i, [&](int p) { return part(p, i).count * es; });
    } else {  // all-gather alone: this rank's chunk from its input to every peer and its own output
      const ring::Span mine = part(r, i);
      int nd = 0;
      const T* s0 = in + (mine.begin - in_shift);
      for (int p = 0; p < n; ++p)
        if (p != r) dst[nd++] = dslot<T>(a, a.peer_data[p], seq, 1, r, mine.begin);
      if (s0 != out + mine.begin) dst[nd++] = out + mine.begin;
      span_multi<T, RedOp::Sum>(dst, nd, only(s0), 1, mine.count, 1, tid, nt);
      post_all(a, 1, seq, i, [&](int) { return mine.count * es; });
    }
  };
  auto reduce = [&](int64_t i) -> bool {
    const uint64_t seq = seq0 + 1 + i;
    if (oneshot) {  // all n inputs in rank order
      const ring::Span P = part(0, i);
      if (!wait_all(a, 0, seq, i, [&](int) { return P.count * es; })) return false;
      dst[0] = out + P.begin;
      span_multi<T, Op>(dst, 1, ranks(seq, 0, P.begin, in + P.begin), n, P.count, a.divisor, tid, nt);
      return true;
    }
    // Chunk r reduced in rank order, into the output and (all-reduce) every peer's phase 1.
    const ring::Span mine = part(r, i);
    if (!wait_all(a, 0, seq, i, [&](int) { return mine.count * es; })) return false;
    int nd = 0;
    dst[nd++] = out + (mine.begin - out_shift);
    if (gather)
      for (int p = 0; p < n; ++p)
        if (p != r) dst[nd++] = dslot<T>(a, a.peer_data[p], seq, 1, r, mine.begin);
    span_multi<T, Op>(dst, nd, ranks(seq, 0, mine.begin, in + mine.begin), n, mine.count, a.divisor, tid, nt);
    if (gather) post_all(a, 1, seq, i, [&](int) { return mine.count * es; });
    return true;
  };
  auto collect = [&](int64_t i) -> bool {
    const uint64_t seq = seq0 + 1 + i;
    if (!wait_all(a, 1, seq, i, [&](int q) { return part(q, i).count * es; })) return false;
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      const ring::Span sp = part(q, i);
      dst[0] = out + sp.begin;
      span_multi<T, RedOp::Sum>(dst, 1, only(dslot<T>(a, a.self_data, seq, 1, q, sp.begin)), 1, sp.count, 1, tid, nt);
    }
    return true;
  };

  const int64_t W = a.direct_ahead, L = W - 1;
  const bool collects = gather && !oneshot && scatter;  // two-shot all-reduce
  for (int64_t i = 0; i < W && i < a.steps; ++i) send(i);
  bool ok = true;
  for (int64_t i = 0; ok && i < a.steps; ++i) {
    if (!scatter) {
      ok = collect(i);
      if (ok && i + W < a.steps) send(i + W);
      continue;
    }
    ok = reduce(i);
    if (ok && i + W < a.steps) send(i + W);
    if (ok && collects && i >= L) ok = collect(i - L);
  }
  for (int64_t i = a.steps > L ? a.steps - L : 0; ok && collects && i < a.steps; ++i) ok = collect(i);
  // Every rank ends a call at the same round (a stopped call leaves the group broken).
  __syncthreads();
  if (tid == 0) f->seq.value = seq0 + a.steps;
}

// ---- registered buffers -----------------------------------------------------------------------

// An all_reduce in place of a tensor in a registered buffer (Ring::reg_alloc), which every rank
// maps: block b of rank r folds its part of chunk r from the n copies in rank order and writes
// the result into all n (in == out, peer_data[q]: rank q's copy at the tensor's offset). Nothing
// is staged: each element of each copy is read once and written once. Two handshakes, each a post
// to every peer and a wait for all of them (per block, paired by index as the direct kernels):
// phase 0, "my kernel runs", so everything before it on that rank's stream (its input, and its
// reads of its previous result) is done, before any read of a peer's copy; phase 1, "my writes
// into your copy are done", before this kernel ends. Every element of a copy is written by one
// rank's one block, after every rank's phase 0 and before its phase 1: no other access overlaps.
// Headers carry reg_tag (buffer and offset) as their size, so a rank whose tensor is elsewhere
// stops every rank with kBadSize instead of reading the wrong memory. One round per call: the
// block's round counter goes on by one, so the direct kernels' header slots stay in step.
template <class T>
struct Copies {
  const Args& a;
  int64_t begin;
  __device__ T* operator[](int q) const { return reinterpret_cast<T*>(a.peer_data[q]) + begin; }
};

template <class T, RedOp Op>
__global__ void __launch_bounds__(kThreads) reg_kernel(Args a) {
  const int n = a.nranks;
  const ring::Span P = ring::channel_part(ring::chunk(a.numel, n, a.rank), a.blocks, blockIdx.x);
  if (broken_at_start(a)) return;
  __shared__ uint64_t s_seq;
  DirectFlags* f = &a.self->direct[blockIdx.x];
  if (threadIdx.x == 0) s_seq = ld_relaxed_sys(&f->seq.value);
  __syncthreads();
  const uint64_t seq = s_seq + 1;
  auto tag = [&](int) { return a.reg_tag; };
  post_all(a, 0, seq, 0, tag);
  if (wait_all(a, 0, seq, 0, tag)) {
    // The copies computed from the kernel's parameters where they are used: no pointer array in
    // local memory (the direct kernels' dst[] is one).
    const Copies<T> copies{a, P.begin};
    span_fold<T, Op>(copies, n, [&](int q) { return copies[q]; }, n, P.count, a.divisor,
                     threadIdx.x, blockDim.x);
    post_all(a, 1, seq, 0, tag);
    wait_all(a, 1, seq, 0, tag);
  }
  __syncthreads();
  if (threadIdx.x == 0) f->seq.value = seq;
}

// ---- copy ------------------------------------------------------------------------------------------

// One piece of a copy-algorithm call (Ring::run_copy): every peer's part is in this rank's inbox
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
  // Each source's slot is aligned as its destination (Ring::run_copy): all_gather's chunks may
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
  const Algo algo = static_cast<Algo>(a.algo);
  const bool reg = algo == Algo::Registered;
  const bool direct = algo == Algo::OneShot || algo == Algo::TwoShot || reg;
  if (a.nranks < 2 || a.blocks < 1 || a.blocks > (direct ? std::min(a.direct_blocks, kMaxDirectBlocks) : kMaxChannels) ||
      (direct && (a.direct_ahead < 1 || 2 * a.direct_ahead > kDirectDepth)) ||
      (direct && a.nranks > kMaxPeers) || (!direct && algo != Algo::Ring) ||
      (reg && (a.coll != static_cast<uint8_t>(Coll::AllReduce) || a.in != a.out)))
    throw std::invalid_argument("ringreduce: p2p launch: bad algorithm, block or rank count");
  dispatch_dtype(static_cast<DType>(a.dtype), [&](auto tag) {
    using T = decltype(tag);
    dispatch_op(static_cast<RedOp>(a.op), [&](auto optag) {
      if (reg) {
        constexpr auto kernel = &reg_kernel<T, decltype(optag)::value>;
        RR_LAUNCH(kernel, a.blocks, kThreads, stream, a);
      } else if (direct) {
        constexpr auto kernel = &direct_kernel<T, decltype(optag)::value>;
        RR_LAUNCH(kernel, a.blocks, kThreads, stream, a);
      } else {
        constexpr auto kernel = &ring_kernel<T, decltype(optag)::value>;
        RR_LAUNCH(kernel, a.blocks, kThreads, stream, a);
      }
    });
  });
  RR_CUDA_CHECK(cudaGetLastError());
}

}  // namespace ringreduce::cuda::p2p
