// The p2p transport's plan (csrc/cuda/p2p/plan.h) as the arithmetic it is: compiled without CUDA
// and checked over sizes, worlds, collectives and options, with the area's layout; the nccl
// transport's (cuda/nccl/plan.h) by its values. What a plan means on the device is the emulated
// device's tests (test_p2p_*_emu); here only what every plan must satisfy.
#include <cstdint>
#include <stdexcept>
#include <string>

#include "check.h"
#include "cuda/nccl/plan.h"
#include "cuda/p2p/area_layout.h"
#include "cuda/p2p/plan.h"

namespace rr = ringreduce;
using namespace ringreduce::cuda::p2p;

namespace {

rr::Call call(rr::Coll coll, int64_t numel, rr::DType t = rr::DType::F32, rr::Wire w = rr::Wire::None) {
  return rr::Call{coll, t, rr::RedOp::Sum, numel, nullptr, nullptr, w};
}

Options options(int n) {
  Options o;
  o.rank = 0;
  o.nranks = n;
  return o;
}

// Every plan: blocks within the caps, pieces or slices that cover the span exactly once.
void test_invariants() {
  for (int n : {2, 3, 4, 8, 16})
    for (int max_blocks : {0, 4, 132})
      for (rr::Coll coll : {rr::Coll::AllReduce, rr::Coll::ReduceScatter, rr::Coll::AllGather})
        for (int64_t numel : {int64_t{16} * n, int64_t{1024} * n, int64_t{1} << 20, int64_t{1} << 26}) {
          Options o = options(n);
          o.max_blocks = max_blocks;
          const rr::Call c = call(coll, numel);
          const Plan p = plan(c, o, true);
          const int cap = max_blocks > 0 ? max_blocks : kMaxBlocks;
          CHECK(p.blocks >= 1 && p.blocks <= cap && p.blocks <= o.sym_blocks, "n=%d numel=%lld blocks=%d",
                n, (long long)numel, p.blocks);
          CHECK(p.algo == rr::Algo::OneShot || p.algo == rr::Algo::TwoShot || p.algo == rr::Algo::LL,
                "auto ran %s", rr::algo_name(p.algo));
          // the LL one-shot: all_reduce up to its reach, one piece of the whole tensor
          CHECK((p.algo == rr::Algo::LL) == (coll == rr::Coll::AllReduce && numel * 4 <= static_cast<int64_t>(ll_max_bytes(n))),
                "n=%d %s numel=%lld ran %s (LL reach %zu B)", n, rr::coll_name(coll), (long long)numel,
                rr::algo_name(p.algo), ll_max_bytes(n));
          const int64_t span = coll == rr::Coll::AllReduce ? numel : numel / n;
          CHECK(p.slice_elems * p.steps >= span && (p.steps - 1) * p.slice_elems < span,
                "n=%d numel=%lld: %lld pieces of %lld do not cover %lld once", n, (long long)numel,
                (long long)p.steps, (long long)p.slice_elems, (long long)span);
          CHECK(static_cast<size_t>(p.slice_elems) * 4 <= o.chunk_bytes, "a piece larger than a half");
          // the same call, the same plan, on every rank
          Options other = o;
          other.rank = n - 1;
          const Plan q = plan(c, other, true);
          CHECK(q.algo == p.algo && q.blocks == p.blocks && q.slice_elems == p.slice_elems &&
                q.steps == p.steps, "rank %d plans differently from rank 0", n - 1);
          // without every mapping, the ring
          const Plan r = plan(c, o, false);
          CHECK(r.algo == rr::Algo::Ring && r.blocks >= 1 && r.blocks <= o.channels, "not direct: %s",
                rr::algo_name(r.algo));
        }
}

void test_auto_threshold_and_forced() {
  Options o = options(2);
  CHECK(oneshot_max_bytes(2) == size_t{1} << 20, "world 2 threshold %zu", oneshot_max_bytes(2));
  for (int n = 3; n <= 16; ++n)
    CHECK(oneshot_max_bytes(n) <= oneshot_max_bytes(n - 1), "threshold grows from %d to %d", n - 1, n);
  CHECK(plan(call(rr::Coll::AllReduce, 1024), o, true).algo == rr::Algo::LL, "4 KiB not LL");
  for (int n = 2; n <= 16; ++n)
    CHECK(ll_max_bytes(n) >= 4096 && ll_max_bytes(n) % 16 == 0 && ll_max_bytes(n) <= ll_max_bytes(2),
          "LL reach %zu at world %d", ll_max_bytes(n), n);
  o.ll_max = 0;  // LL off: one-shot's threshold
  CHECK(plan(call(rr::Coll::AllReduce, 1024), o, true).algo == rr::Algo::OneShot, "4 KiB not one-shot");
  CHECK(plan(call(rr::Coll::AllReduce, 1024), o, true).blocks == 1, "4 KiB on more than one block");
  CHECK(plan(call(rr::Coll::AllReduce, 1 << 22), o, true).algo == rr::Algo::TwoShot, "16 MiB not two-shot");
  o.tuned = true;
  o.oneshot_max = 0;  // a measured table saying never
  CHECK(plan(call(rr::Coll::AllReduce, 1024), o, true).algo == rr::Algo::TwoShot, "tuned 0 ran one-shot");
  o = options(4);
  o.algo = rr::Algo::OneShot;  // one-shot of a reduce_scatter is two-shot's half
  CHECK(plan(call(rr::Coll::ReduceScatter, 4096), o, true).algo == rr::Algo::TwoShot, "forced one-shot rs");
  o.algo = rr::Algo::Ring;
  CHECK(plan(call(rr::Coll::AllReduce, 4096), o, true).algo == rr::Algo::Ring, "forced ring ignored");
  o.algo = rr::Algo::Copy;
  const Plan cp = plan(call(rr::Coll::AllReduce, 1 << 24), o, true);
  CHECK(cp.algo == rr::Algo::Copy && cp.slice_elems * 4 == static_cast<int64_t>(o.copy_slot_bytes) &&
        cp.steps == (int64_t{1} << 26) / static_cast<int64_t>(o.copy_slot_bytes), "copy pieces");
}

void test_deterministic() {
  rr::set_deterministic(true);
  Options o = options(4);
  o.algo = rr::Algo::Ring;  // gives way: the ring starts each chunk at another rank
  CHECK(plan(call(rr::Coll::AllReduce, 4096), o, true).algo != rr::Algo::Ring, "deterministic ran the ring");
  bool threw = false;
  try {
    plan(call(rr::Coll::AllReduce, 4096), o, false);
  } catch (const rr::RingError&) {
    threw = true;
  }
  CHECK(threw, "deterministic without the workspace did not refuse");
  CHECK(plan(call(rr::Coll::AllGather, 4096), o, false).algo == rr::Algo::Ring, "all_gather needs no order");
  rr::set_deterministic(false);
}

void test_wire() {
  Options o = options(2);
  bool threw = false;
  try {
    plan(call(rr::Coll::AllReduce, 4096, rr::DType::I32, rr::Wire::BF16), o, true);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw, "a wire on int32 planned");
  const Plan p = plan(call(rr::Coll::AllReduce, 1 << 20, rr::DType::F32, rr::Wire::E4M3), o, true);
  CHECK(p.algo == rr::Algo::OneShot || p.algo == rr::Algo::TwoShot, "wire ran %s", rr::algo_name(p.algo));
  CHECK(p.slice_elems % rr::kWireBlock == 0, "wire piece of %lld elements: not whole blocks",
        (long long)p.slice_elems);
}

// The nccl plan's thresholds and choices, value by value (the model's: one-shot up to
// oneshot_max_bytes, two-shot up to kTwoShotMaxBytes, the ring above), and the mode as an argument.
void test_nccl() {
  namespace nc = rr::cuda::nccl;
  const size_t want[][2] = {{1, 1 << 20}, {2, 1 << 20}, {3, 256 << 10}, {4, 128 << 10}, {5, 64 << 10},
                            {8, 32 << 10}, {16, 16 << 10}, {64, 4 << 10}};
  for (const auto& w : want)
    CHECK(nc::oneshot_max_bytes(static_cast<int>(w[0])) == w[1], "nccl threshold at world %zu: %zu, not %zu",
          w[0], nc::oneshot_max_bytes(static_cast<int>(w[0])), w[1]);
  nc::Options o;
  o.nranks = 8;
  const int64_t one = (32 << 10) / 4, two = nc::kTwoShotMaxBytes / 4;
  const struct {
    rr::Coll coll;
    int64_t numel;
    rr::Algo algo, det;
  } cases[] = {
      {rr::Coll::AllReduce, one, rr::Algo::OneShot, rr::Algo::OneShot},
      {rr::Coll::AllReduce, one + 1, rr::Algo::TwoShot, rr::Algo::TwoShot},
      {rr::Coll::AllReduce, two, rr::Algo::TwoShot, rr::Algo::TwoShot},
      {rr::Coll::AllReduce, two + 8, rr::Algo::Ring, rr::Algo::TwoShot},
      {rr::Coll::ReduceScatter, 8, rr::Algo::TwoShot, rr::Algo::TwoShot},
      {rr::Coll::ReduceScatter, two + 8, rr::Algo::Ring, rr::Algo::TwoShot},
      {rr::Coll::AllGather, two + 8, rr::Algo::Ring, rr::Algo::Ring},
  };
  rr::set_deterministic(true);  // the plan reads its argument, never the process's mode
  for (const auto& k : cases) {
    const rr::Algo a = nc::plan(call(k.coll, k.numel), o, false), d = nc::plan(call(k.coll, k.numel), o, true);
    CHECK(a == k.algo && d == k.det, "nccl %s numel=%lld: %s and %s (deterministic), not %s and %s",
          rr::coll_name(k.coll), (long long)k.numel, rr::algo_name(a), rr::algo_name(d),
          rr::algo_name(k.algo), rr::algo_name(k.det));
  }
  rr::set_deterministic(false);
  o.algo = rr::Algo::Ring;
  CHECK(nc::plan(call(rr::Coll::AllReduce, one), o, false) == rr::Algo::Ring, "nccl forced ring ignored");
  CHECK(nc::plan(call(rr::Coll::AllReduce, one), o, true) == rr::Algo::OneShot, "nccl deterministic ran the ring");
  // Staging too small for one element per piece: the ring, or in deterministic mode an error.
  o.algo = rr::Algo::TwoShot;
  o.staging_bytes = 16;
  CHECK(nc::plan(call(rr::Coll::AllReduce, 1024, rr::DType::F64), o, false) == rr::Algo::Ring,
        "nccl two-shot without room did not fall back to the ring");
  bool threw = false;
  try {
    nc::plan(call(rr::Coll::AllReduce, 1024, rr::DType::F64), o, true);
  } catch (const rr::RingError&) {
    threw = true;
  }
  CHECK(threw, "nccl deterministic two-shot without room did not refuse");
  o.nranks = 1;
  CHECK(nc::plan(call(rr::Coll::AllReduce, 1024), o, true) == rr::Algo::Ring, "nccl world 1");
}

// The area's layout (area_layout.h): the parts in order, none overlapping, aligned, and present
// exactly where the group can run what uses them; every rank computes the same.
void test_area_layout() {
  CHECK(area_layout(options(1)).bytes() == 0, "world 1 has an area");
  for (int n : {2, 3, 8, 9, 16})
    for (rr::Algo algo : {rr::Algo::Auto, rr::Algo::Ring, rr::Algo::Copy})
      for (bool direct : {true, false})
        for (int64_t ll : {int64_t{-1}, int64_t{0}}) {
          Options o = options(n);
          o.algo = algo;
          o.direct = direct;
          o.ll_max = ll;
          const AreaLayout l = area_layout(o);
          const bool sym = direct && n <= kMaxPeers;
          CHECK((l.fifo > 0) == (!sym || algo == rr::Algo::Ring), "n=%d fifo %zu", n, l.fifo);
          CHECK((l.half > 0) == sym, "n=%d half %zu", n, l.half);
          CHECK((l.inbox > 0) == (algo == rr::Algo::Copy && n <= kMaxPeers), "n=%d inbox %zu", n, l.inbox);
          CHECK((l.ll_slot > 0) == (sym && ll != 0), "n=%d ll slot %zu", n, l.ll_slot);
          CHECK(l.half == 0 || l.half >= o.chunk_bytes + 2 * kVecBytes * kMaxPeers, "half %zu too small", l.half);
          CHECK(l.ll_reach() >= (ll != 0 && sym ? ll_limit(o) : 0), "LL slots hold %zu < reach", l.ll_reach());
          CHECK(l.fifo_at() >= sizeof(Area) && l.workspace_at() == l.fifo_at() + l.fifo &&
                    l.inbox_at() == l.workspace_at() + 2 * l.half && l.ll_at() == l.inbox_at() + l.inbox &&
                    l.bytes() == l.ll_at() + 2 * static_cast<size_t>(n) * l.ll_slot,
                "n=%d parts out of order", n);
          for (size_t at : {l.fifo_at(), l.workspace_at(), l.inbox_at(), l.ll_at()})
            CHECK(at % kLine == 0, "n=%d part at %zu not line-aligned", n, at);
        }
}

// Where the tensor lies (Memory) decides Registered and Imported, inside p2p::plan: only an
// in-place all_reduce above auto's one-shot threshold, under Auto, in a group that maps every rank.
void test_in_place_memory() {
  const int n = 4;
  Options o = options(n);
  static float buf[1];
  const int64_t big = int64_t{4} << 20, small = 1024;
  auto in_place = [&](int64_t numel) {
    rr::Call c = call(rr::Coll::AllReduce, numel);
    c.in = c.out = buf;
    return c;
  };
  Memory reg;
  reg.reg = 2;
  reg.reg_offset = 4096;
  Memory board;
  board.board = true;
  Plan p = plan(in_place(big), o, true, reg);
  CHECK(p.algo == rr::Algo::Registered && p.reg == 2 && p.reg_offset == 4096 && p.steps == 1 &&
            p.slice_elems == big && p.in_place,
        "registered: %s reg %d offset %llu", rr::algo_name(p.algo), p.reg, (unsigned long long)p.reg_offset);
  CHECK(plan(in_place(big), o, true, board).algo == rr::Algo::Imported, "board: not imported");
  CHECK(plan(in_place(small), o, true, reg).algo != rr::Algo::Registered, "small tensor registered");
  CHECK(plan(in_place(small), o, true, board).algo != rr::Algo::Imported, "small tensor imported");
  CHECK(plan(in_place(big), o, false, reg).algo == rr::Algo::Ring, "no direct access, yet %s",
        rr::algo_name(plan(in_place(big), o, false, reg).algo));
  rr::Call apart = in_place(big);
  apart.out = buf + 1;
  CHECK(!plan(apart, o, true, reg).in_place && !plan(apart, o, true, board).in_place, "out of place in place");
  rr::Call wire = in_place(big);
  wire.wire = rr::Wire::BF16;
  CHECK(!plan(wire, o, true, board).in_place, "a wire call imported");
  CHECK(!plan(in_place(big), o, true).in_place, "no memory, yet in place");
  Options forced = o;
  forced.algo = rr::Algo::TwoShot;
  CHECK(plan(in_place(big), forced, true, reg).algo == rr::Algo::TwoShot, "a forced algorithm lost its meaning");
}

void test_check_options() {
  auto message = [](const Options& o) -> std::string {
    try {
      check_options(o);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "";
  };
  CHECK(message(options(4)).empty(), "defaults refused: %s", message(options(4)).c_str());
  Options o = options(4);
  o.channels = 0;
  CHECK(message(o).find("channels") != std::string::npos, "channels 0: '%s'", message(o).c_str());
  o = options(4);
  o.sym_blocks = kMaxSymBlocks + 1;
  CHECK(message(o).find("sym_blocks") != std::string::npos, "sym_blocks: '%s'", message(o).c_str());
  o = options(4);
  o.rank = 4;
  CHECK(message(o).find("rank 4") != std::string::npos, "rank 4: '%s'", message(o).c_str());
}

}  // namespace

int main() {
  test_invariants();
  test_auto_threshold_and_forced();
  test_deterministic();
  test_wire();
  test_nccl();
  test_area_layout();
  test_in_place_memory();
  test_check_options();
  return finish("test_plan");
}
