// The nccl transport's plan (plan.h): pure arithmetic, compiled without CUDA for its native test.
#include "cuda/nccl/plan.h"

#include "ring/crossover.h"

namespace ringreduce::cuda::nccl {

size_t oneshot_max_bytes(int n) {
  constexpr double kAlphaS = 10e-6;       // one group round trip (settle + NCCL's p2p latency)
  constexpr double kNetBytesPerS = 25e9;  // a 200 Gb/s NIC
  return ring::oneshot_crossover(n, kAlphaS, kNetBytesPerS, 1 << 20);
}

Algo plan(const Call& c, const Options& o, bool deterministic) {
  const int n = o.nranks;
  if (n < 2) return Algo::Ring;  // run() copies; nothing moves
  const size_t es = dtype_size(c.dtype), bytes = static_cast<size_t>(c.numel) * es;
  const size_t region = 2 * o.staging_bytes;
  // Deterministic reductions: only the direct algorithms reduce in rank order (the ring starts
  // each chunk at another rank), so a forced ring and the ring of large sizes give way to them.
  const bool det = deterministic && c.coll != Coll::AllGather;
  Algo a = o.algo;
  if (det && a == Algo::Ring) a = Algo::Auto;
  if (a == Algo::Auto)
    a = c.coll == Coll::AllReduce && bytes <= oneshot_max_bytes(n) ? Algo::OneShot
        : bytes <= kTwoShotMaxBytes || det                         ? Algo::TwoShot
                                                                   : Algo::Ring;
  if (a == Algo::OneShot &&
      (c.coll != Coll::AllReduce || (n - 1) * round_up(bytes, kSlotAlign) > region))
    a = Algo::TwoShot;
  // Two-shot's reduce-scatter receives pieces of region / (N-1) bytes: at least one element.
  if (a == Algo::TwoShot && c.coll != Coll::AllGather &&
      region / (n - 1) / kSlotAlign * kSlotAlign < es) {
    if (det) {
      // 2 x staging cut into N-1 pieces of 16 bytes at least (the widest element, aligned).
      const size_t need = kSlotAlign / 2 * (n - 1);
      throw RingError("ringreduce: deterministic " + std::string(coll_name(c.coll)) +
                      " (RINGREDUCE_DETERMINISTIC=1) on the nccl transport cannot run with " +
                      std::to_string(n) + " ranks and " + std::to_string(o.staging_bytes) +
                      " bytes of staging: its rank-order algorithms receive every rank's piece "
                      "into the staging at once, which needs at least " + std::to_string(need) +
                      " bytes; raise RINGREDUCE_NCCL_STAGING_BYTES on every rank, or turn "
                      "deterministic mode off");
    }
    a = Algo::Ring;
  }
  return a;
}

}  // namespace ringreduce::cuda::nccl
