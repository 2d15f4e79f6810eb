// Device code shared by the transport's kernels (csrc/cuda/p2p/ring_kernel.cu: ring and copy;
// csrc/cuda/p2p/sym_kernel.cu: the symmetric workspace): call headers, stop records, the abort words.
// Included by those .cu files only.
#pragma once
#include "cuda/host.h"
#include "cuda/shape.h"
#include "cuda/p2p/launch.h"
#include "cuda/platform.cuh"

namespace ringreduce::cuda::p2p {
namespace {

// Flag polls between checks of the abort words and the clock (NCCL checks its abort flag every few
// hundred spins; these checks read local and host-mapped memory).
constexpr uint32_t kPollsPerCheck = 64;

enum Barrier : int { kStart = 0, kMiddle = 1, kEnd = 2 };
// The value a block's barrier b of piece `epoch` writes into its peers' arrived words: increasing
// through a block's pieces and barriers, call after call, so a poll compares with >= and a peer
// already one barrier further passes it too. (The LL one-shot writes its start value too, so that
// a peer in a barrier of the same epoch finds its header: ll_kernel.cu.)
__device__ __forceinline__ uint64_t barrier_value(uint64_t epoch, int b) { return epoch * 4 + b + 1; }

// Where a block is in the schedule (for error records).
struct Where {
  int phase, step;
  int64_t slice;
};

__device__ MsgHeader my_header(const KernelBase& a, uint64_t nbytes, uint32_t index) {
  MsgHeader h;
  h.op_seq = a.op_seq;
  h.numel = a.numel;
  h.nbytes = nbytes;
  h.index = index;
  h.coll = a.coll;
  h.dtype = a.dtype;
  h.op = static_cast<uint8_t>(a.op | a.wire << 4);
  h.algo = a.algo;
  return h;
}

// Headers move as two 16-byte words through L2, like the data (the emulator counts them as data).
static_assert(sizeof(MsgHeader) == 32, "MsgHeader is two 16-byte words");
__device__ inline void put_header(MsgHeader* dst, const MsgHeader& h) {
  uint4 w[2];
  __builtin_memcpy(w, &h, sizeof h);
  __stcg(reinterpret_cast<uint4*>(dst), w[0]);
  __stcg(reinterpret_cast<uint4*>(dst) + 1, w[1]);
}
__device__ inline MsgHeader get_header(const MsgHeader* src) {
  uint4 w[2];
  w[0] = __ldcg(reinterpret_cast<const uint4*>(src));
  w[1] = __ldcg(reinterpret_cast<const uint4*>(src) + 1);
  MsgHeader h;
  __builtin_memcpy(&h, w, sizeof h);
  return h;
}

// A plain store, not an atomic: system-scope atomics on a peer's memory need native P2P atomics,
// which PCIe peers may lack. The first cause usually stays (a word already there is kept); a race
// between two causes keeps one of them, enough for the peer's waits to stop.
__device__ void notify(Area* peer, uint32_t word) {
  if (peer && ld_relaxed_sys(&peer->abort) == 0u) st_relaxed_sys(&peer->abort, word);
}

// The copy algorithm's stream waits of the whole group, released after the group's abort word.
__device__ void release_copy_waits(const KernelBase& a, uint32_t word) {
  if (!a.cctl) return;
  atomicCAS_system(&a.cctl->abort, 0u, word);
  __threadfence_system();
  for (int q = 0; q < a.nranks && q < kMaxPeers; ++q)
    for (int s = 0; s < a.nranks && s < kMaxPeers; ++s) st_relaxed_sys(&a.cctl->arrived[q][s].value, kReleased);
}

// Thread 0: records the first stop of this block for the host and writes the abort word into
// every peer this rank can reach, so that their waits (on their own memory) stop too.
__device__ void record_stop(const KernelBase& a, uint32_t word, bool local, int peer, const Where& w,
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
// The device word: every host abort is mirrored into it (Endpoint::abort_locked), on a stream, so a
// kernel may start before it lands. Outside a graph that
// only delays the stop (the peers' memory lives until every rank has synchronized); a graph's
// replay may come after close(), when a peer may have freed its memory, so a captured launch
// (KernelBase::graph) also reads the host's word, which close() sets first: as the copy of it
// that the graph makes into this rank's area just before the kernel (Area::host_abort), not across
// PCIe in every block (the emulator's cost report counts such reads: gpu_cost.py's host_reads).
// A wait reads the host word itself, once it has polled long.
// epoch (the workspace kernels): also loads *epoch into *s_epoch, in flight with the abort word's
// load (one memory round trip at the start, not two); the barrier below publishes it.
__device__ bool broken_at_start(const KernelBase& a, const uint64_t* epoch = nullptr,
                                uint64_t* s_epoch = nullptr) {
  __shared__ uint32_t s_broken;
  if (threadIdx.x == 0) {
    uint32_t word = ld_relaxed_sys(&a.self->abort);
    if (epoch) *s_epoch = ld_relaxed_sys(epoch);
    if (!word && a.graph && ld_relaxed_sys(&a.self->host_abort)) word = abort_word(kHostAbort, a.rank);
    s_broken = word;
    if (word)
      record_stop(a, word, abort_rank(word) == a.rank, -1, Where{-1, 0, 0}, false, my_header(a, 0, 0),
                  nullptr);
  }
  __syncthreads();
  return s_broken != 0;
}

// At a kernel's end: this rank's epochs, every block's entry (the next call may run another
// number of blocks), all equal, and every rank ends a call at the same epoch (a stopped call
// leaves the group broken).
__device__ inline void end_epochs(const SymArgs& a, uint64_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0)
    for (int k = blockIdx.x; k < kMaxSymBlocks; k += gridDim.x) a.self->sym[k].epoch.value = epoch;
}

}  // namespace
}  // namespace ringreduce::cuda::p2p
