// How one call of the p2p transport runs (algorithm, blocks, slices, pieces): pure arithmetic on
// the call and the group's options, the same on every rank. No CUDA, no host state.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cuda/p2p/layout.h"

namespace ringreduce::cuda::p2p {

// The algorithms RINGREDUCE_CUDA_ALGO may force (Python reads them as _C.P2P_ALGOS).
constexpr Algo kForcedAlgos[] = {Algo::Auto, Algo::Ring, Algo::OneShot, Algo::TwoShot, Algo::Copy, Algo::LL};

struct Options {
  int rank = 0;
  int nranks = 1;
  // Whether every rank will map every other (Endpoint::connect gets every handle) and the group has at
  // most kMaxPeers ranks: the symmetric workspace algorithms, and the workspace; else the ring
  // only. The same on every rank.
  bool direct = true;
  int channels = kDefaultChannels;  // the most ring channels a call uses
  size_t slice_bytes = kDefaultSliceBytes;  // the largest ring slice (a FIFO slot)
  // The largest piece of a symmetric workspace call (bytes per rank and half of the workspace).
  // Test knob: a tiny value makes many pieces (barriers, halves reused) per call.
  size_t chunk_bytes = kDefaultChunkBytes;
  // The most blocks one call's kernel may use: every block of every rank's kernel spins until its
  // peers' blocks run, so all must be resident at once. One block of these kernels fills an SM
  // (512 threads of up to 128 registers), so: the SM count over the ranks sharing a device, the
  // least over the group (the same on every rank: plans must agree). 0: unknown; Endpoint takes this
  // device's SM count (one rank per device).
  int max_blocks = 0;
  // The most blocks a workspace call uses below that cap (RINGREDUCE_CUDA_SYM_BLOCKS), 1 to
  // kMaxSymBlocks: what blocks buy at large sizes differs by GPU (measured per device: gpu_tune.py).
  int sym_blocks = kDefaultSymBlocks;
  // Test knob: every ring call uses exactly `channels` and `slice_bytes`, and every symmetric
  // workspace call min(channels, kMaxSymBlocks) blocks (no plan by size), so that tiny slices force
  // many pipeline steps at every size.
  bool exact = false;
  Algo algo = Algo::Auto;  // RINGREDUCE_CUDA_ALGO
  // Auto's threshold (bytes of the full tensor): one-shot up to oneshot_max (all_reduce), two-shot
  // above; used when `tuned` (0 then means never), else the model's (oneshot_max_bytes()). Set
  // from a table measured on a GPU (benchmarks/gpu_tune.py, ringreduce/gpu_tuning.json).
  bool tuned = false;
  size_t oneshot_max = 0;
  double timeout_s = 300.0;  // RINGREDUCE_TIMEOUT: per wait
  size_t copy_slot_bytes = kDefaultCopySlotBytes;  // RINGREDUCE_CUDA_COPY_BYTES: the largest piece
  // The LL one-shot (ll_kernel.cu): all_reduce up to this many bytes under Auto (or forced), and
  // the size of its buffers; -1: ll_max_bytes(nranks); 0: never. The same on every rank.
  int64_t ll_max = -1;
};

// Throws std::invalid_argument naming the option that is out of range (the endpoint's constructor).
void check_options(const Options& o);
void check_sym_blocks(int blocks);

// How one call runs: ringreduce::Plan (ring/call.h): the algorithm, its blocks, the ring's slice or
// a workspace call's piece in elements (SymArgs::chunk_elems; copy: its piece), slices per channel
// or pieces, and a Registered call's buffer and byte offset.
using Plan = ringreduce::Plan;
// Where a call's tensor lies, as the endpoint found it (the same on every rank for the same call):
// in registered buffer `reg` at byte `reg_offset` (-1: in none), and whether the group's imported
// memory board is attached (an ordinary tensor may then be imported).
struct Memory {
  int reg = -1;
  uint64_t reg_offset = 0;
  bool board = false;
};
// The same inputs give the same plan on every rank. direct: the symmetric workspace algorithms are
// possible (every rank maps every other, nranks <= kMaxPeers); where they are not, every call runs
// the ring. Auto: one-shot up to the threshold (all_reduce), else two-shot; the ring only when
// forced. Deterministic mode (Call::deterministic): an all_reduce or reduce_scatter never
// runs the ring (a forced ring runs as Auto); where the others are impossible (!direct) plan throws
// RingError saying why and what to use instead.
// An all_reduce in place of a tensor larger than auto's one-shot threshold, under Auto, runs in
// the tensor's own memory where it can (Plan::in_place): Registered in a registered buffer (m.reg),
// else Imported where the board is attached and the call would run two-shot.
Plan plan(const Call& c, const Options& o, bool direct, const Memory& m = {});

// Auto's one-shot threshold (bytes of the full tensor) from the alpha-beta model of
// benchmarks/gpu_cost.py (not from GPU timings): one-shot while its extra remote bytes, (n-1) x
// size against two-shot's 2(n-1)/n x size, cost less than the barrier it saves.
size_t oneshot_max_bytes(int nranks);

// The LL one-shot's default reach (bytes of the full tensor): 64 KiB / nranks, at least 4 KiB. A
// guess, not a measurement (none has been made on a GPU): an LL call sends every byte twice (a
// flag word beside each data word) to (n - 1) peers and waits for no barrier; one-shot sends once
// and waits for one. Its buffers hold this much: ll_limit().
size_t ll_max_bytes(int nranks);
size_t ll_limit(const Options& o);

// Blocks of the copy algorithm's kernel for a piece of this many bytes.
int copy_blocks(int64_t piece_bytes);

}  // namespace ringreduce::cuda::p2p
