// Where each part of a rank's area lies, in bytes from its start: pure arithmetic on the group's
// options, the same on every rank (a kernel addresses a peer's area by this rank's layout). The
// header (Area: counters, flags, barriers) comes first, then the ring's FIFO, the workspace's two
// halves, the copy algorithm's inbox and the LL slots; a part a group cannot run takes no bytes.
// Tested alone by tests/native/test_plan.cpp. No CUDA.
#pragma once
#include <cstddef>

#include "cuda/p2p/plan.h"

namespace ringreduce::cuda::p2p {

struct AreaLayout {
  int nranks = 1;
  size_t fifo = 0;     // the ring's FIFO: channels x kSlots slots; 0 where the ring cannot run
  size_t half = 0;     // one half of the symmetric workspace; 0 without one
  size_t inbox = 0;    // the copy algorithm's inbox: kCopyDepth x nranks slots; 0 without it
  size_t ll_slot = 0;  // one LL slot (two per source); 0 without the LL one-shot

  size_t fifo_at() const { return data_offset(); }
  size_t workspace_at() const { return fifo_at() + fifo; }
  size_t inbox_at() const { return workspace_at() + 2 * half; }
  size_t ll_at() const { return inbox_at() + inbox; }
  size_t ll_bytes() const { return 2 * static_cast<size_t>(nranks) * ll_slot; }
  size_t bytes() const { return nranks > 1 ? ll_at() + ll_bytes() : 0; }  // world 1: no area
  // The most bytes of a tensor the LL slots hold (a header, then 8 bytes a 4-byte word).
  size_t ll_reach() const { return ll_slot ? (ll_slot / 8 - kLLHeaderWords) * 4 : 0; }
};

// The layout a group with these options allocates (at construction: a later set_ll_max lowers the
// LL reach, never the slots).
inline AreaLayout area_layout(const Options& o) {
  AreaLayout l;
  l.nranks = o.nranks;
  if (o.nranks < 2) return l;
  const bool symmetric = o.direct && o.nranks <= kMaxPeers;
  if (!symmetric || o.algo == Algo::Ring)
    l.fifo = static_cast<size_t>(o.channels) * kSlots * slot_stride(o.slice_bytes);
  // The inbox needs no mapping of every peer (the copy algorithm writes to each through its own).
  if (o.algo == Algo::Copy && o.nranks <= kMaxPeers)
    l.inbox = static_cast<size_t>(kCopyDepth) * o.nranks * slot_stride(o.copy_slot_bytes);
  if (!symmetric) return l;
  // A piece of chunk_bytes laid out as the tensor mod 16; reduce_scatter's n regions each start
  // on 16 bytes (sym_kernel.cu's Layout): 32 bytes of slack per region.
  l.half = round_up(o.chunk_bytes + 2 * kVecBytes * kMaxPeers, 256);
  const size_t limit = ll_limit(o);
  if (limit > 0) l.ll_slot = round_up((kLLHeaderWords + (limit + 3) / 4) * 8, 256);
  return l;
}

}  // namespace ringreduce::cuda::p2p
