// The host-driven ring loop, written once: reduce-scatter then all-gather over the schedule
// (ring/schedule.h), slice by slice, against a transport's primitives. The shared-memory ring
// (shm/protocol.cpp) and the NCCL ring (cuda/nccl/algorithms.cpp) run it; the p2p device kernel
// keeps its own loop over the same schedule (a loop on the device, one thread block per channel,
// cannot call host primitives). Header-only, no memory or threads.
//
// Primitives, named by their data flow as NCCL's (prims_simple.h), in the order the loop calls
// them; spans are byte pointers and element counts of the call's dtype. Every send is the next
// step's message to rank r+1, every receive the message from rank r-1, in the same order on every
// rank, so a transport may post a send when it is made (shm: into its slot) or pair it with the
// next receive (NCCL: one group of a send and a receive).
//   at(phase, step, slice)                  where the loop is (for error messages)
//   send(src, n)                            send n elements at src
//   recv_reduce_send(own, n)                receive, reduce with own, send the result
//   recv_reduce_copy(own, dst, n, div, snd) receive, reduce with own into dst (AVG: / div);
//                                           send dst on when snd
//   recv_copy(dst, n, snd)                  receive into dst; send it on when snd
//   copy(dst, src, n)                       a local copy (all-gather alone: the own chunk)
#pragma once
#include <cstddef>
#include <cstdint>

#include "ring/call.h"
#include "ring/schedule.h"

namespace ringreduce::ring {

// Call c of n ranks on rank r with slices of at most slice_elems elements (>= 1).
template <class Prims>
void run_ring(const Call& c, int n, int r, int64_t slice_elems, Prims& p) {
  const size_t es = dtype_size(c.dtype);
  const char* in = static_cast<const char*>(c.in);
  char* out = static_cast<char*>(c.out);
  const bool ar = c.coll == Coll::AllReduce;
  const bool rs = c.coll != Coll::AllGather, ag = c.coll != Coll::ReduceScatter;
  const int64_t m = c.numel / n;
  auto chunk_of = [&](int k) { return ar ? chunk(c.numel, n, k) : Span{k * m, m}; };
  const int64_t S = slice_elems;
  const int64_t ns = num_slices(ar ? (c.numel + n - 1) / n : m, S);
  // Reduce-scatter's output holds only chunk r; all-gather's input holds only chunk r.
  const int64_t out_shift = c.coll == Coll::ReduceScatter ? r * m : 0;
  const int64_t in_shift = c.coll == Coll::AllGather ? r * m : 0;
  const int divisor = c.op == RedOp::Avg ? n : 1;
  for (int64_t j = 0; j < ns; ++j) {
    if (rs) {
      p.at("reduce-scatter", 0, j);
      const Span sp = slice(chunk_of(rs_send_chunk(r, 0, n)), j, S);
      p.send(in + sp.begin * es, sp.count);
      for (int s = 0; s < n - 1; ++s) {
        p.at("reduce-scatter", s, j);
        const Span rp = slice(chunk_of(rs_recv_chunk(r, s, n)), j, S);
        const char* own = in + rp.begin * es;
        if (s < n - 2)
          p.recv_reduce_send(own, rp.count);
        else  // the chunk is final here: into the output, and on for the all-gather
          p.recv_reduce_copy(own, out + (rp.begin - out_shift) * es, rp.count, divisor, ag);
      }
    }
    if (ag) {
      p.at("all-gather", 0, j);
      if (!rs) {  // all-gather alone: this rank's chunk comes from the input
        const Span sp = slice(chunk_of(r), j, S);
        const char* src = in + (sp.begin - in_shift) * es;
        if (src != out + sp.begin * es) p.copy(out + sp.begin * es, src, sp.count);
        p.send(src, sp.count);
      }
      for (int t = 0; t < n - 1; ++t) {
        p.at("all-gather", t, j);
        const Span rp = slice(chunk_of(ag_recv_chunk(r, t, n)), j, S);
        p.recv_copy(out + rp.begin * es, rp.count, t < n - 2);
      }
    }
  }
}

}  // namespace ringreduce::ring
