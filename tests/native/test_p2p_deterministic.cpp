// Native test of deterministic mode on the p2p transport: every forced algorithm gives the bits of
// the rank-order reference (never the ring), its plans, and the error where the direct algorithms
// cannot run.
// Built against the emulated device in every CI run (test_p2p_deterministic_emu; ranks are threads,
// areas are shared through the emulated IPC) and by nvcc where a toolkit is found
// (test_p2p_deterministic; on a GPU, ranks are streams of one process). Exits 0 with a message when
// there is no CUDA device. `test_p2p_deterministic_emu NAME...` runs the tests whose names contain
// a NAME (weak_* only so); without names, all but weak_*.
#include "p2p_check.h"

// Deterministic mode on the p2p transport, worlds 2-5: every forced algorithm (the ring runs as
// auto) gives exactly the bits of the rank-order reference, with 64-byte direct slots (a call in
// many rounds) and 3 blocks; auto with the same slots picks blocks by size. Then the same
// communicator runs a default-mode call (the ring, when forced), in step with the direct rounds.
static void test_deterministic() {
  using rc::p2p::Algo;
  const auto t0 = Clock::now();
  int cases = 0;
  DetTeeth t16, t32;
  for (int n = 2; n <= 5; ++n)
    for (Algo algo : {Algo::Ring, Algo::OneShot, Algo::TwoShot, Algo::Auto, Algo::Copy}) {
      // The copy algorithm in pieces of 64 B: its fold runs per piece.
      Group g(n, 3, 64, 20.0, algo, algo != Algo::Auto, 64, false, 0, false, 64);
      char what[96];
      std::snprintf(what, sizeof what, "deterministic p2p n=%d %s slot=64", n, rc::p2p::algo_name(algo));
      {
        DeterministicScope det;
        for (int64_t numel : {int64_t{1}, int64_t{1000}, int64_t{1} << 20}) {
          const rc::p2p::Plan p = g.rings[0]->plan_of({rr::Coll::AllReduce, rr::DType::F32,
                                                       rr::RedOp::Sum, numel, nullptr, nullptr});
          const bool small = static_cast<size_t>(numel) * 4 <= rc::p2p::oneshot_max_bytes(n);
          const bool ll = static_cast<size_t>(numel) * 4 <= rc::p2p::ll_max_bytes(n);
          const Algo want = algo == Algo::Copy ? Algo::Copy
                            : (algo == Algo::Auto || algo == Algo::Ring) && ll ? Algo::LL
                            : algo == Algo::OneShot || (algo != Algo::TwoShot && small) ? Algo::OneShot
                                                                                        : Algo::TwoShot;
          EXPECT(p.algo == want, "%s: all_reduce of %lld floats planned %s", what, (long long)numel,
                 rc::p2p::algo_name(p.algo));
        }
        cases += deterministic_sweep(g.ranks, {1, 7, 333}, what, n >= 3 ? &t16 : nullptr,
                                     n >= 3 ? &t32 : nullptr);
      }
      check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F16, rr::RedOp::Sum, 1001, true, what);
      check_collective(g.ranks, rr::Coll::ReduceScatter, rr::DType::F32, rr::RedOp::Avg, 77 * n, false, what);
    }
  expect_teeth(t16, t32, "deterministic p2p");
  std::printf("deterministic p2p: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

static void test_deterministic_plan() {
  using rc::p2p::Algo;
  using rr::Coll;
  rc::p2p::Options o;
  o.nranks = 8;
  auto algo_of = [&](Coll c, int64_t numel, bool direct) {
    return rc::p2p::plan({c, rr::DType::F32, rr::RedOp::Sum, numel, nullptr, nullptr}, o, direct).algo;
  };
  const int64_t big = int64_t{1} << 26;  // 256 MiB
  EXPECT(algo_of(Coll::AllReduce, big, true) == Algo::TwoShot, "default: two-shot for large tensors");
  EXPECT(algo_of(Coll::AllReduce, big, false) == Algo::Ring, "default: the ring without direct access");
  {
    DeterministicScope det;
    for (Algo forced : {Algo::Auto, Algo::Ring, Algo::OneShot, Algo::TwoShot}) {
      o.algo = forced;
      for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{4096}, big}) {
        const Algo ar = algo_of(Coll::AllReduce, numel, true), rs = algo_of(Coll::ReduceScatter, numel, true);
        const bool small = static_cast<size_t>(numel) * 4 <= rc::p2p::oneshot_max_bytes(8);
        const bool ll = numel > 0 && static_cast<size_t>(numel) * 4 <= rc::p2p::ll_max_bytes(8);
        const Algo want = (forced == Algo::Auto || forced == Algo::Ring) && ll ? Algo::LL
                          : forced == Algo::OneShot || (forced != Algo::TwoShot && small) ? Algo::OneShot
                                                                                          : Algo::TwoShot;
        EXPECT(ar == want, "deterministic all_reduce of %lld floats, %s forced: %s, want %s",
               (long long)numel, rc::p2p::algo_name(forced), rc::p2p::algo_name(ar), rc::p2p::algo_name(want));
        EXPECT(rs == Algo::TwoShot, "deterministic reduce_scatter, %s forced: %s", rc::p2p::algo_name(forced),
               rc::p2p::algo_name(rs));
      }
    }
    o.algo = Algo::Ring;
    EXPECT(algo_of(Coll::AllGather, 4096, true) == Algo::Ring, "all_gather is not deterministic's");
    EXPECT(algo_of(Coll::AllGather, 4096, false) == Algo::Ring, "all_gather without direct access");
    o.algo = Algo::Auto;
    for (int n : {4, 17}) {
      o.nranks = n;
      std::string msg;
      try {
        algo_of(Coll::ReduceScatter, 64, false);
      } catch (const rr::RingError& e) {
        msg = e.what();
      }
      EXPECT(contains(msg, "deterministic reduce_scatter") && contains(msg, "RINGREDUCE_TRANSPORT=nccl") &&
                 contains(msg, n > rc::p2p::kMaxPeers ? "more than the 16" : "peer access"),
             "%d ranks without direct access: '%s'", n, msg.c_str());
    }
    o.nranks = 1;  // nothing to reduce (run() copies): no error
    EXPECT(algo_of(Coll::AllReduce, 64, false) == Algo::Ring, "one rank");
  }
}

#ifdef RINGREDUCE_EMU
// A ring whose ranks map only their neighbours: a deterministic all_reduce or reduce_scatter raises
// the clear error on every rank, before the call is counted; all_gather and default-mode calls
// (the ring) still run, in step.
static void test_deterministic_needs_direct() {
  const int n = 4;
  Group g(n, 2, 4096, 10.0, rc::p2p::Algo::Auto, false, rc::p2p::kDefaultChunkBytes, true);
  EXPECT(!g.rings[0]->direct(), "neighbours only, yet direct");
  DevBuf buf(1024 * 4);
  std::string first;
  {
    DeterministicScope det;
    for (rr::Coll coll : {rr::Coll::AllReduce, rr::Coll::ReduceScatter})
      for (int r = 0; r < n; ++r) {
        const uint64_t seq = g.rings[r]->op_seq();
        std::string msg;
        try {
          g.rings[r]->run({coll, rr::DType::BF16, rr::RedOp::Sum, 1024, buf.p, buf.p}, g.ranks[r].stream);
        } catch (const rr::RingError& e) {
          msg = e.what();
        }
        EXPECT(contains(msg, std::string("deterministic ") + rr::coll_name(coll)) &&
                   contains(msg, "peer access") && contains(msg, "RINGREDUCE_TRANSPORT=nccl"),
               "rank %d %s: '%s'", r, rr::coll_name(coll), msg.c_str());
        EXPECT(g.rings[r]->op_seq() == seq, "rank %d: the refused call was counted", r);
        EXPECT(g.rings[r]->failure().empty(), "rank %d: the refusal broke the ring", r);
        if (first.empty()) first = msg;
      }
    check_collective(g.ranks, rr::Coll::AllGather, rr::DType::F32, rr::RedOp::Sum, 1000, false,
                     "deterministic all_gather, neighbours only");
  }
  check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 1001, true,
                   "default all_reduce after the refusal");
  std::printf("deterministic without direct access: %s\n", first.c_str());
}

#endif

int main(int argc, char** argv) {
  return p2p_main("test_p2p_deterministic", [&] {
    run_test(argc, argv, "test_deterministic", [&] { test_deterministic(); });
    run_test(argc, argv, "test_deterministic_plan", [&] { test_deterministic_plan(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_deterministic_needs_direct", [&] { test_deterministic_needs_direct(); });
#endif
  });
}
