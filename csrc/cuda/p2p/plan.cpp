// The p2p transport's plan (plan.h): pure arithmetic, compiled without CUDA for its native test.
#include "cuda/p2p/plan.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "ring/crossover.h"

namespace ringreduce::cuda::p2p {

// The alpha-beta model's figures for H100 NVLink (benchmarks/gpu_cost.py cites their sources): a
// remote round trip, and the bandwidth of one direction of a GPU's links.
constexpr double kModelRttS = 1e-6;
constexpr double kModelLinkBytesPerS = 450e9;
// The copy algorithm's kernel: a block per this many bytes of a piece.
constexpr size_t kCopyBytesPerBlock = 64 << 10;
// As many as before the workspace's cap went to 64 (the copy algorithm's kernels are unmeasured
// above 32).
constexpr int kMaxCopyBlocks = 32;

size_t oneshot_max_bytes(int n) {
  // One-shot reads (n-1) x size per rank against two-shot's 2(n-1)/n x size, and saves one of
  // two-shot's two barriers: half a round trip.
  return ring::oneshot_crossover(n, 0.5 * kModelRttS, kModelLinkBytesPerS, 1 << 20);
}

void check_sym_blocks(int blocks) {
  if (blocks < 1 || blocks > kMaxSymBlocks)
    throw std::invalid_argument("ringreduce: p2p sym_blocks must be 1.." + std::to_string(kMaxSymBlocks) +
                                ", got " + std::to_string(blocks));
}

void check_options(const Options& o) {
  if (o.nranks < 1 || o.rank < 0 || o.rank >= o.nranks)
    throw std::invalid_argument("ringreduce: rank " + std::to_string(o.rank) + " out of range for " +
                                std::to_string(o.nranks) + " ranks");
  if (o.channels < 1 || o.channels > kMaxChannels)
    throw std::invalid_argument("ringreduce: channels must be 1.." + std::to_string(kMaxChannels) +
                                ", got " + std::to_string(o.channels));
  if (o.slice_bytes < kVecBytes || o.slice_bytes % kVecBytes)
    throw std::invalid_argument("ringreduce: p2p slice_bytes must be a positive multiple of 16, got " +
                                std::to_string(o.slice_bytes));
  if (o.chunk_bytes < kVecBytes || o.chunk_bytes % kVecBytes)
    throw std::invalid_argument("ringreduce: p2p chunk_bytes must be a positive multiple of 16, got " +
                                std::to_string(o.chunk_bytes));
  if (o.max_blocks < 0)
    throw std::invalid_argument("ringreduce: p2p max_blocks must be >= 0 (0: this device's SM count), got " +
                                std::to_string(o.max_blocks));
  check_sym_blocks(o.sym_blocks);
  if (o.copy_slot_bytes < kVecBytes || o.copy_slot_bytes % kVecBytes)
    throw std::invalid_argument("ringreduce: p2p copy_slot_bytes must be a positive multiple of 16, got " +
                                std::to_string(o.copy_slot_bytes));
}

size_t ll_max_bytes(int nranks) {
  return std::max<size_t>(4 << 10, (64 << 10) / static_cast<size_t>(std::max(1, nranks)) / 16 * 16);
}

size_t ll_limit(const Options& o) {
  return o.ll_max >= 0 ? static_cast<size_t>(o.ll_max) : ll_max_bytes(o.nranks);
}

int copy_blocks(int64_t piece_bytes) {
  // These blocks never wait for another rank's, so no residency cap.
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(kMaxCopyBlocks, piece_bytes / static_cast<int64_t>(kCopyBytesPerBlock))));
}

// The narrow wire (sym_wire.cu): one-shot or two-shot on the workspace, in pieces of whole wire
// blocks whose spans fit a half (all_reduce: two spans, every rank's input and the reduced chunks;
// reduce_scatter: one per chunk). A forced ring or copy gives way, as in deterministic mode; a
// group whose ranks cannot all map each other cannot run it.
namespace {

Plan wire_plan(const Call& c, const Options& o, bool direct) {
  const int n = o.nranks;
  const std::string what = std::string("ringreduce: ") + coll_name(c.coll) + " with wire_dtype=" + wire_name(c.wire);
  if (c.coll == Coll::AllGather || !wire_takes(c.op) || !wire_takes(c.dtype))
    throw std::invalid_argument(what + ": needs all_reduce or reduce_scatter of a " + wire_takes_text() +
                                ", got " + dtype_name(c.dtype) + " and " + op_name(c.op));
  if (!direct)
    throw RingError(what + " cannot run on the p2p transport of this group: it needs the one-shot or "
                    "two-shot algorithm, which reads every rank's memory, and " +
                    (n > kMaxPeers ? "the group has " + std::to_string(n) + " ranks, more than the " +
                                         std::to_string(kMaxPeers) + " those algorithms address"
                                   : std::string("not every pair of its ranks can map each other's "
                                                 "memory through CUDA IPC (peer access)")));
  const int64_t es = static_cast<int64_t>(dtype_size(c.dtype));
  const size_t bytes = static_cast<size_t>(c.numel) * es;
  Algo algo = o.algo == Algo::OneShot || o.algo == Algo::TwoShot ? o.algo : Algo::Auto;
  const size_t oneshot_max = o.tuned ? o.oneshot_max : oneshot_max_bytes(n);
  if (algo == Algo::Auto)
    algo = c.coll == Coll::AllReduce && bytes <= oneshot_max ? Algo::OneShot : Algo::TwoShot;
  if (c.coll != Coll::AllReduce) algo = Algo::TwoShot;
  // A half holds a piece's inputs (cap wire blocks), two-shot's reduced chunk beside them (cap / n
  // blocks), or reduce_scatter's n chunks' inputs.
  const bool scaled = wire_scaled(c.wire);
  const uint64_t eb = wire_elem_bytes(c.wire);
  auto need = [&](int64_t cap) -> uint64_t {
    const uint64_t span = workspace_wire_bytes(scaled, eb, cap);
    if (c.coll == Coll::ReduceScatter) return n * span;
    return algo == Algo::OneShot ? span : span + workspace_wire_bytes(scaled, eb, (cap + n - 1) / n);
  };
  const double per_block = (c.coll == Coll::ReduceScatter ? n : algo == Algo::OneShot ? 1.0 : 1.0 + 1.0 / n) *
                           static_cast<double>(kWireBlock * eb + 4);
  int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(static_cast<double>(o.chunk_bytes) / per_block));
  while (need(cap + 1) <= o.chunk_bytes) ++cap;
  while (cap > 1 && need(cap) > o.chunk_bytes) --cap;
  if (need(cap) > o.chunk_bytes + 2 * kVecBytes * kMaxPeers)
    throw std::invalid_argument(what + ": the workspace (chunk_bytes " + std::to_string(o.chunk_bytes) +
                                ") cannot hold one wire block per span");
  Plan p{algo, 1, cap * kWireBlock, 1};
  const int64_t span = c.coll == Coll::AllReduce ? c.numel : c.numel / n;
  const int64_t blocks = (span + kWireBlock - 1) / kWireBlock;
  p.steps = std::max<int64_t>(1, (blocks + cap - 1) / cap);
  // Pieces of equal size in whole wire blocks, as plan()'s.
  p.slice_elems = std::max<int64_t>(1, (blocks + p.steps - 1) / p.steps) * kWireBlock;
  const int resident = o.max_blocks > 0 ? o.max_blocks : kMaxBlocks;
  const int most = std::min(kMaxSymBlocks, resident);
  if (o.exact) {
    p.blocks = std::min(o.channels, most);
  } else {
    const int64_t piece_bytes = std::min(span, cap * kWireBlock) * es;
    p.blocks = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>(std::min(most, o.sym_blocks), piece_bytes / static_cast<int64_t>(kSymBytesPerBlock))));
  }
  return p;
}

// Every call's plan but those that run in the tensor's own memory.
Plan plain_plan(const Call& c, const Options& o, bool direct) {
  if (c.wire != Wire::None) return wire_plan(c, o, direct);
  const int n = o.nranks;
  const int64_t es = static_cast<int64_t>(dtype_size(c.dtype));
  const size_t bytes = static_cast<size_t>(c.numel) * es;
  // Deterministic reductions: only the symmetric workspace algorithms reduce in rank order (the
  // ring starts each chunk at another rank), so a forced ring gives way to them; where they cannot
  // run, the call fails rather than run the ring with other bits. direct is the same on every
  // rank, so every rank throws alike.
  const bool det = c.deterministic && c.coll != Coll::AllGather && n > 1;
  if (det && !direct)
    throw RingError(
        std::string("ringreduce: deterministic ") + coll_name(c.coll) +
        " (RINGREDUCE_DETERMINISTIC=1) cannot run on the p2p transport of this group: it needs the "
        "one-shot or two-shot algorithm, which reads every rank's memory, and " +
        (n > kMaxPeers ? "the group has " + std::to_string(n) + " ranks, more than the " +
                             std::to_string(kMaxPeers) + " those algorithms address"
                       : std::string("not every pair of its ranks can map each other's memory "
                                     "through CUDA IPC (peer access)")) +
        "; use RINGREDUCE_TRANSPORT=nccl, whose rank-order algorithms need no mapping, or turn "
        "deterministic mode off");
  Algo algo = o.algo;
  if (det && algo == Algo::Ring) algo = Algo::Auto;
  // The LL one-shot: the smallest all_reduces, no barrier (Auto, or forced where it reaches).
  if ((algo == Algo::Auto || algo == Algo::LL) && direct && n > 1 && n <= kMaxPeers &&
      c.coll == Coll::AllReduce && c.numel > 0 && bytes <= ll_limit(o)) {
    const int cap = std::min(kMaxSymBlocks, o.max_blocks > 0 ? o.max_blocks : kMaxBlocks);
    const int blocks = o.exact ? std::min(o.channels, cap)
                               : static_cast<int>(std::max<int64_t>(
                                     1, std::min<int64_t>(std::min(cap, o.sym_blocks),
                                                          static_cast<int64_t>(bytes / kLLBytesPerBlock))));
    return Plan{Algo::LL, blocks, c.numel, 1};
  }
  if (algo == Algo::LL) algo = Algo::Auto;  // beyond its reach: as auto
  const size_t oneshot_max = o.tuned ? o.oneshot_max : oneshot_max_bytes(n);
  if (algo == Algo::Auto)
    algo = c.coll == Coll::AllReduce && bytes <= oneshot_max ? Algo::OneShot : Algo::TwoShot;
  // One-shot of a reduce-scatter or an all-gather is two-shot's half of it.
  if (algo == Algo::OneShot && c.coll != Coll::AllReduce) algo = Algo::TwoShot;
  if (!direct) algo = Algo::Ring;
  const int64_t max_chunk = c.coll == Coll::AllReduce ? (c.numel + n - 1) / n : c.numel / n;
  auto div_up = [](int64_t x, int64_t y) { return (x + y - 1) / y; };
  Plan p{algo, 1, 1, 1};
  // The span the pieces cut: the tensor (all_reduce) or one chunk.
  const int64_t span = c.coll == Coll::AllReduce ? c.numel : c.numel / n;
  if (algo == Algo::Copy) {
    p.slice_elems = std::max<int64_t>(1, static_cast<int64_t>(o.copy_slot_bytes) / es);
    p.steps = div_up(span, p.slice_elems);
    p.blocks = copy_blocks(std::min(span, p.slice_elems) * es);  // of the largest piece's kernel
    return p;
  }
  // Every block resident beside the peers' (Options::max_blocks); 0: no cap known.
  const int resident = o.max_blocks > 0 ? o.max_blocks : kMaxBlocks;
  if (algo == Algo::Ring) {
    int64_t slice = static_cast<int64_t>(o.slice_bytes);
    const int channels = std::min(o.channels, resident);
    if (o.exact) {
      p.blocks = channels;
    } else {
      const int64_t want = max_chunk * es / static_cast<int64_t>(kChannelBytes);
      p.blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, channels)));
      const int64_t part_bytes = div_up(max_chunk, p.blocks) * es;
      const int64_t s = static_cast<int64_t>(round_up(div_up(part_bytes, kSlicesInFlight), kVecBytes));
      slice = std::min(slice, std::max<int64_t>(s, kMinSliceBytes));
    }
    p.slice_elems = std::max<int64_t>(1, slice / es);
    p.steps = ring::num_slices(div_up(max_chunk, p.blocks), p.slice_elems);
    return p;
  }
  // The symmetric workspace: pieces of at most chunk_bytes per rank (reduce_scatter: a piece of
  // each of the n chunks), a block per kSymBytesPerBlock of a piece. A piece is a multiple of 16
  // bytes, so that every piece of a call lies in the workspace at the same offset mod 16 and each
  // block's share of a half is the same bytes in every piece (sym_kernel.cu).
  const int64_t rs_bytes = std::max<int64_t>(kVecBytes, static_cast<int64_t>(o.chunk_bytes / n / kVecBytes * kVecBytes));
  p.slice_elems = (c.coll == Coll::ReduceScatter ? rs_bytes : static_cast<int64_t>(o.chunk_bytes)) / es;
  p.steps = std::max<int64_t>(1, div_up(span, p.slice_elems));
  // Pieces of equal size (the last short by less than 16 bytes), not the workspace's size and a
  // remainder: two-shot cuts each piece's chunks from its full size, so a tensor far below the
  // workspace would leave the last ranks' chunks empty and the first ranks reducing all of it.
  const int64_t align = static_cast<int64_t>(kVecBytes) / es, most = p.slice_elems;
  p.slice_elems = std::max<int64_t>(align, div_up(div_up(span, p.steps), align) * align);
  const int cap = std::min(kMaxSymBlocks, resident);
  if (o.exact) {
    p.blocks = std::min(o.channels, cap);
  } else {
    // the bytes of a piece of the span each block's cut applies to (reduce_scatter: per chunk),
    // as large as the workspace allows
    const int64_t piece_bytes = std::min(span, most) * es;
    p.blocks = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>(std::min(cap, o.sym_blocks),
                             piece_bytes / static_cast<int64_t>(kSymBytesPerBlock))));
  }
  return p;
}

}  // namespace

Plan plan(const Call& c, const Options& o, bool direct, const Memory& m) {
  Plan p = plain_plan(c, o, direct);
  const size_t bytes = static_cast<size_t>(c.numel) * dtype_size(c.dtype);
  // Up to auto's one-shot threshold one-shot stays: one barrier against the in-place kernels' two,
  // and its copy into the workspace is small.
  const size_t oneshot_max = o.tuned ? o.oneshot_max : oneshot_max_bytes(o.nranks);
  if (o.algo != Algo::Auto || !direct || c.coll != Coll::AllReduce || c.wire != Wire::None || c.in != c.out ||
      c.numel <= 0 || o.nranks < 2 || bytes <= oneshot_max)
    return p;
  if (m.reg >= 0) {
    // Blocks as the workspace's two-shot: a block reads its part of chunk r from all n copies.
    p.algo = Algo::Registered;
    p.slice_elems = c.numel;
    p.steps = 1;
    p.reg = m.reg;
    p.reg_offset = m.reg_offset;
    p.in_place = true;
  } else if (m.board && p.algo == Algo::TwoShot) {
    p.algo = Algo::Imported;  // the two-shot plan for the calls that go through the workspace
    p.in_place = true;
  }
  return p;
}

}  // namespace ringreduce::cuda::p2p
