// What a shared-memory ring is configured with (the binding fills it from the environment and the
// measured table), and the names its algorithm settings may take.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ring/call.h"

namespace ringreduce {
namespace shm {

// Slice size: 128 KiB keeps one rank's 8 slots (1 MiB) cache-resident on this machine's L2/L3;
// measured in benchmarks/shm_allreduce.py (64 KiB .. 512 KiB within 10% at 64 MiB).
constexpr size_t kDefaultSliceBytes = 128 << 10;

using ringreduce::Algo;  // the shared names (ring/call.h); this transport runs Auto to Wire
using ringreduce::algo_name;

// Auto above one-shot's threshold: an all-reduce of at least from_bytes runs algo (ring, twoshot or
// cma), the last step it reaches; below the first step, the ring. Measured per machine (the table
// ringreduce/cpu_tuning.json); none: the ring at every size. Every rank must have the same steps.
struct Step {
  uint64_t from_bytes;
  Algo algo;
  bool cma_whole = false;  // cma only (the step's name kCmaWholeStep): whole-chunk reads
};

// The step name of cma reading whole chunks (Options::cma_block_bytes = 0 for that step only).
constexpr const char* kCmaWholeStep = "cmawhole";

// The algorithms RINGREDUCE_ALGO may force, and those an auto step may name (Python reads both
// as _C.SHM_ALGOS and _C.SHM_STEP_ALGOS; the binding parses names against them).
constexpr Algo kForcedAlgos[] = {Algo::Auto, Algo::Ring, Algo::OneShot, Algo::TwoShot, Algo::Cma};
constexpr Algo kStepAlgos[] = {Algo::Ring, Algo::TwoShot, Algo::Cma};

struct Options {
  int rank = 0;
  int nranks = 1;
  double timeout_s = 300.0;  // RINGREDUCE_TIMEOUT: per wait
  int64_t spin_ns = 20000;   // busy-poll this long before sleeping on the futex
  int64_t yield_ns = 0;      // then poll with sched_yield this long (ranks > cores: hands the core
                             // to the rank being waited for at once), then sleep on the futex
  Algo algo = Algo::Auto;    // RINGREDUCE_ALGO
  size_t oneshot_max_bytes = 0;  // Auto picks one-shot for all-reduces up to this size
  std::vector<Step> steps;       // and these above it
  // RINGREDUCE_CMA_BLOCK_BYTES: cma reads a peer's chunk this many bytes at a time (whole elements,
  // at least one), a process_vm_readv each, and folds every block before the next. 0: the whole
  // chunk in one read into a chunk-sized scratch ((N-1)/N of the tensor, kept for later calls), as
  // Open MPI does: fewer calls, but the scratch stays in cache only on a large L3. Python passes
  // the slice by default (the block before it was an option). Local to the reading rank: the
  // fold is in rank order whatever the block, so the bits do not depend on it.
  uint64_t cma_block_bytes = kDefaultSliceBytes;
  // RINGREDUCE_STREAM: how data other ranks read is written (slots, pool tensors), from
  // kStreamMinBytes up: Auto copies with ordinary stores and switches to non-temporal ones for a
  // while when copies run slower than kSlowBytesPerNs (a VM's slow state: Writer::put);
  // Never/Always force one way.
  enum class Stream : uint8_t { Auto = 0, Never = 1, Always = 2 } stream = Stream::Auto;
};

}  // namespace shm
}  // namespace ringreduce
