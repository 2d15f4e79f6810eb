// Which algorithm the nccl transport runs a call with: pure arithmetic on the call, the group's
// options and the mode, the same on every rank. No NCCL, CUDA or global state (tested alone by
// tests/native/test_plan.cpp).
#pragma once
#include <cstddef>
#include <string>

#include "cuda/nccl/defaults.h"
#include "ring/call.h"

namespace ringreduce::cuda::nccl {

using ringreduce::Algo;  // the shared names (ring/call.h); this transport runs Auto to TwoShot
using ringreduce::algo_name;

// The direct algorithms (one-shot, two-shot) receive N-1 pieces into both staging buffers as one
// region of 2 x staging_bytes, each piece at a multiple of this (the kernels' widest load).
constexpr size_t kSlotAlign = 16;
// Two-shot up to here (bytes of the full tensor), the ring above. Both move 2(N-1)/N of the tensor
// per rank; two-shot saves 2(N-1) - 2 group round trips (~10-20 us each: ncclGroupEnd settling plus
// NCCL's p2p latency), which matter up to about this size at network speed (16 MiB x 2 x 7/8 at
// 25 GB/s ~ 1.2 ms against ~0.2 ms of round trips at N = 8); above it the ring's one flow per rank
// to its neighbour is what links between hosts carry best. A model, not yet
// measured on GPUs.
constexpr size_t kTwoShotMaxBytes = 16 << 20;

struct Options {
  int rank = 0;
  int nranks = 1;
  double timeout_s = 300.0;  // RINGREDUCE_TIMEOUT: setup, each NCCL call, and each collective
  size_t staging_bytes = kDefaultStagingBytes;
  std::string lib;
  // Test knob: force an algorithm (Auto: by size). Where impossible it falls back: one-shot of a
  // reduce-scatter or an all-gather, or one whose N-1 inputs do not fit the staging, to two-shot;
  // two-shot whose pieces would be under one element (tiny staging, many ranks) to the ring.
  // Deterministic mode: a forced ring runs as Auto, and Auto never picks the ring.
  Algo algo = Algo::Auto;
};

// One-shot up to here (bytes of the full tensor): it sends (N-1) x size per rank against
// two-shot's 2(N-1)/N x size and saves one group round trip (alpha ~10 us); worth it while the
// extra bytes, (N-1)(N-2)/N x size, take less than alpha at network speed (25 GB/s). Rounded down
// to a power of two, at most 1 MiB (N = 2: no extra bytes). From this model, not from GPU timings.
size_t oneshot_max_bytes(int nranks);
// The algorithm of call c: the same on every rank for the same call, options and mode. In
// deterministic mode an all_reduce or reduce_scatter gets one-shot or two-shot, never the ring;
// where two-shot's pieces would be under one element (staging under 8 x (N-1) bytes) it throws
// RingError saying so, where the default mode falls back to the ring.
Algo plan(const Call& c, const Options& o, bool deterministic);

}  // namespace ringreduce::cuda::nccl
