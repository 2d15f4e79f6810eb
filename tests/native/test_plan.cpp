// The p2p transport's plan (csrc/cuda/p2p/plan.h) as the arithmetic it is: compiled without CUDA
// and checked over sizes, worlds, collectives and options. What a plan means on the device is the
// emulated device's tests (test_p2p_*_emu); here only what every plan must satisfy.
#include <cstdint>
#include <stdexcept>

#include "check.h"
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

}  // namespace

int main() {
  test_invariants();
  test_auto_threshold_and_forced();
  test_deterministic();
  test_wire();
  return finish("test_plan");
}
