// The barriers of the symmetric workspace kernels (csrc/cuda/p2p/sym_kernel.cu, sym_wire.cu): one
// 64-bit word per (block, peer), written by the peer's same block, carrying the piece and the
// barrier it reached; the call's header checked at each piece's start barrier. Included by those
// .cu files only.
#pragma once
#include "cuda/p2p/device.cuh"

namespace ringreduce::cuda::p2p {
namespace {


// Thread t: waits until *flag (this rank's memory) >= target. Returns 0 or the abort word that
// ended the wait (*local: this thread saw the cause itself). The abort word a host writes is
// mirrored into this rank's area (Endpoint::abort), so the poll reads device memory; the host flag
// (HostCtl::abort, across PCIe) only every 16th check, for a host abort whose mirror is stuck
// behind a spinning kernel on a shared hardware queue. The polls are acquire loads: the one that
// sees the flag orders the peer's data (released before it) before this thread's later loads, with
// no fence after it; a fence.acq_rel.sys there would also wait for this thread's own header and
// flag stores into the peer to land (a round trip over NVLink when the peer is already waiting).
__device__ uint32_t sym_wait(const SymArgs& a, const uint64_t* flag, uint64_t target, bool* local) {
  *local = true;
  if (ld_acquire_sys(flag) < target) {
    const uint64_t t0 = globaltimer_ns();
    for (uint32_t polls = 1;; ++polls) {
      if (ld_acquire_sys(flag) >= target) break;
      spin_hint();
      if (polls % kPollsPerCheck) continue;
      const uint32_t w = ld_relaxed_sys(&a.self->abort);
      if (w) {
        *local = abort_rank(w) == a.rank && abort_cause(w) == kHostAbort;
        return w;
      }
      if ((polls / kPollsPerCheck) % 16 == 0 && ld_relaxed_sys(&a.ctl->abort))
        return abort_word(kHostAbort, a.rank);
      if (globaltimer_ns() - t0 > a.timeout_ns) return abort_word(kTimeout, a.rank);
    }
  }
  note_wait(flag);
  return 0;
}

// Barrier b of piece `epoch` (its index `piece` in the call) between this block and the same block
// of every peer. Thread t serves peers t, t + blockDim.x, ...: it tells each (the call's header
// first, at a start barrier), then waits for each, and checks their headers. The __syncthreads
// before orders the block's accesses (its copy in, its reads of the peers) before the flags; the
// one after, the peers' data before the block's reads. Every thread returns false to stop: some
// wait failed, and one thread of the block recorded why (claim: the block's record is written once).
// tagged: at a start barrier, also writes the Imported tag and prediction hash (a.tag, a.tag_hash)
// beside the header.
__device__ bool barrier(const SymArgs& a, uint64_t epoch, int b, int64_t piece, uint64_t nbytes,
                        unsigned* claim, bool tagged = false) {
  const int n = a.nranks, r = a.rank, k = blockIdx.x;
  // The piece and the block count: ranks that cut a piece between another number of blocks would
  // read parts their peers' blocks have not written (kBadSize: inconsistent schedules).
  const uint32_t index = static_cast<uint32_t>(piece & 0xffffff) | (static_cast<uint32_t>(gridDim.x) << 24);
  const MsgHeader mine = my_header(a, nbytes, index);
  const uint64_t v = barrier_value(epoch, b);
  __syncthreads();
  for (int q = threadIdx.x; q < n; q += blockDim.x) {
    if (q == r) continue;
    if (b == kStart) put_header(&a.peer[q]->sym_hdr[epoch & 1][k][r], mine);
    if (b == kStart && tagged) {
      uint4 w;
      __builtin_memcpy(&w, &a.tag, 8);
      __builtin_memcpy(reinterpret_cast<char*>(&w) + 8, &a.tag_hash, 8);
      __stcg(reinterpret_cast<uint4*>(a.peer[q]->sym_tag[epoch & 1][k][r]), w);
    }
  }
  // Release (the block's earlier accesses, ordered before by the barrier, and the headers), then
  // the flags: by the threads that raise one.
  if (static_cast<int>(threadIdx.x) < n) fence_acq_rel_sys();
  for (int q = threadIdx.x; q < n; q += blockDim.x)
    if (q != r) st_relaxed_sys(&a.peer[q]->sym[k].arrived[r], v);
  // Every flag raised before any wait: a thread serving several peers (or, on the emulated
  // device, a thread whose wait ends first) must not hold back a post another block waits on.
  __syncthreads();
  uint32_t stop = 0;
  for (int q = threadIdx.x; q < n && !stop; q += blockDim.x) {
    if (q == r) continue;
    bool local = true;
    const MsgHeader* got = nullptr;
    MsgHeader theirs;
    stop = sym_wait(a, &a.self->sym[k].arrived[q], v, &local);
    if (!stop && b == kStart) {
      theirs = get_header(&a.self->sym_hdr[epoch & 1][k][q]);
      const uint32_t cause = check_header(theirs, mine);
      if (cause != kOk) {
        stop = abort_word(cause, r);
        got = &theirs;
      }
    }
    if (stop && atomicCAS(claim, 0u, 1u) == 0u)
      record_stop(a, stop, local, q, Where{2 + b, q, piece}, false, mine, got);
  }
  return __syncthreads_or(stop != 0) == 0;
}

}  // namespace
}  // namespace ringreduce::cuda::p2p
