// Native test of the narrow wire (Call::wire): every wire, dtype, op and collective, world 1-4, in
// pieces and blocks, against the CPU kernels' bits; fp16 overflows learned by every rank; a wire
// mismatch named; its plans; weak memory.
// Built against the emulated device in every CI run (test_p2p_wire_emu; ranks are threads, areas
// are shared through the emulated IPC) and by nvcc where a toolkit is found (test_p2p_wire; on a
// GPU, ranks are streams of one process). Exits 0 with a message when there is no CUDA device.
// `test_p2p_wire_emu NAME...` runs the tests whose names contain a NAME (weak_* only so); without
// names, all but weak_*.
#include "p2p_check.h"
#include "wire_check.h"

// The narrow wire on the symmetric workspace (sym_wire.cu), against the CPU kernels' bits.
// Groups: tiny pieces (a workspace of 4 KiB: many pieces, both halves, two-shot chunks of one or
// two wire blocks) with 3 blocks per piece; one-shot and two-shot forced at the default sizes; a
// forced ring (gives way to two-shot, as in deterministic mode).
static void test_wire() {
  using rc::p2p::Algo;
  const auto t0 = Clock::now();
  int cases = 0;
  int64_t changed = 0;
  for (int n = 1; n <= 4; ++n) {
    struct Setup { Algo algo; bool exact; size_t chunk; const char* name; };
    const Setup setups[] = {{Algo::Auto, true, 4096, "pieces of 4 KiB, 3 blocks"},
                            {Algo::OneShot, false, rc::p2p::kDefaultChunkBytes, "one-shot"},
                            {Algo::TwoShot, false, rc::p2p::kDefaultChunkBytes, "two-shot"},
                            {Algo::Ring, false, rc::p2p::kDefaultChunkBytes, "ring forced"}};
    for (const Setup& st : setups) {
      if (n == 1 && st.algo != Algo::Auto) continue;
      Group g(n, 3, 4096, 20.0, st.algo, st.exact, st.chunk);
      char what[96];
      std::snprintf(what, sizeof what, "wire p2p n=%d %s", n, st.name);
      for (rr::Wire w : kWires)
        for (rr::DType t : {rr::DType::F32, rr::DType::BF16, rr::DType::F16})
          for (rr::RedOp op : {rr::RedOp::Sum, rr::RedOp::Avg})
            for (int64_t numel : {int64_t{1}, int64_t{129}, int64_t{1000}, int64_t{4099}}) {
              const bool inplace = (numel + static_cast<int>(op)) % 2 == 0;
              changed += check_wire(g.ranks, rr::Coll::AllReduce, t, op, w, numel, inplace, what, cases);
              const int64_t rs_numel = (numel / n + 1) * n;
              changed += check_wire(g.ranks, rr::Coll::ReduceScatter, t, op, w, rs_numel, !inplace, what, cases);
              cases += 2;
            }
    }
  }
  // The wire rounds: a test whose results equal the plain sum's would not see a wire ignored.
  EXPECT(changed > 1000, "the wire changed only %lld elements against the plain fold", (long long)changed);
  std::printf("wire p2p: %d cases, %lld elements differ from the plain fold (%.1f s)\n", cases,
              (long long)changed, seconds_since(t0));
}

// fp16 on the wire: a finite value that rounds beyond 65504 (an input on one rank, or a sum) is
// learned by every rank (Endpoint::wire_overflowed), whichever rank rounded it; a call without one,
// and AVG whose mean fits, report none. World 1 too.
static void test_wire_overflow() {
  using rc::p2p::Algo;
  for (int n : {1, 3})
    for (Algo algo : {Algo::OneShot, Algo::TwoShot}) {
      Group g(n, 2, 4096, 20.0, algo, true, 4096);
      const int64_t numel = 3000;
      struct Case { const char* name; rr::Coll coll; rr::RedOp op; float big; int who; bool over; };
      const Case cases[] = {
          {"no overflow", rr::Coll::AllReduce, rr::RedOp::Sum, 1000.0f, 0, false},
          {"an input beyond fp16", rr::Coll::AllReduce, rr::RedOp::Sum, 70000.0f, n - 1, true},
          {"a sum beyond fp16", rr::Coll::AllReduce, rr::RedOp::Sum, 40000.0f, -1, n > 1},
          {"AVG of the same", rr::Coll::AllReduce, rr::RedOp::Avg, 40000.0f, -1, false},
          {"reduce_scatter input", rr::Coll::ReduceScatter, rr::RedOp::Sum, 70000.0f, 0, true},
          {"after them, none", rr::Coll::AllReduce, rr::RedOp::Sum, 1.0f, -1, false}};
      for (const Case& c : cases) {
        // the big value in the last wire block (the last chunk, owned by rank n - 1)
        std::vector<std::unique_ptr<DevBuf>> bufs;
        for (int r = 0; r < n; ++r) {
          std::vector<float> h(numel, 1.0f);
          if (c.who < 0 || c.who == r) h[numel - 5] = c.big;
          bufs.push_back(std::make_unique<DevBuf>(numel * 4));
          RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
          RR_CUDA_CHECK(cudaMemcpyAsync(bufs[r]->p, h.data(), numel * 4, cudaMemcpyHostToDevice, g.ranks[r].stream));
          RR_CUDA_CHECK(cudaStreamSynchronize(g.ranks[r].stream));
        }
        const int64_t total = c.coll == rr::Coll::AllReduce ? numel : numel / n * n;
        for (int r = 0; r < n; ++r) {
          char* out = bufs[r]->p + (c.coll == rr::Coll::ReduceScatter ? r * (total / n) * 4 : 0);
          g.rings[r]->run({c.coll, rr::DType::F32, c.op, total, bufs[r]->p, out, rr::Wire::F16}, g.ranks[r].stream);
        }
        sync_all(g);
        for (int r = 0; r < n; ++r) {
          EXPECT(g.rings[r]->failure().empty(), "wire overflow n=%d %s %s: rank %d failed: %s", n,
                 rc::p2p::algo_name(algo), c.name, r, g.rings[r]->failure().c_str());
          const bool got = g.rings[r]->wire_overflowed(g.rings[r]->op_seq());
          EXPECT(got == c.over, "wire overflow n=%d %s %s: rank %d says %s", n, rc::p2p::algo_name(algo),
                 c.name, r, got ? "overflowed" : "no overflow");
        }
      }
    }
}

// A rank with another wire (or none) than its peers: every rank stops with the calls named.
static void test_wire_mismatch() {
  DevBuf buf(2000 * 4);
  for (rc::p2p::Algo algo : {rc::p2p::Algo::OneShot, rc::p2p::Algo::TwoShot}) {
    Group g(3, 2, 4096, 10.0, algo);
    for (int r = 0; r < 3; ++r)
      g.rings[r]->run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 1000, buf.p, buf.p,
                       r == 1 ? rr::Wire::E4M3 : rr::Wire::BF16}, g.ranks[r].stream);
    sync_all(g);
    bool named = false;
    for (int r = 0; r < 3; ++r) {
      const std::string f = g.rings[r]->failure();
      EXPECT(!f.empty(), "wire mismatch: rank %d did not fail", r);
      named |= contains(f, "wire_dtype=float8_e4m3fn") && contains(f, "wire_dtype=bfloat16");
    }
    EXPECT(named, "wire mismatch (%s): no rank named both wires: %s", rc::p2p::algo_name(algo),
           g.rings[0]->failure().c_str());
  }
}

// The wire's plans: pieces of whole wire blocks that fit a workspace half, a forced ring or copy
// giving way, and the errors: a group that cannot map every peer, a collective or dtype it cannot run.
static void test_wire_plan() {
  using rc::p2p::Algo;
  rc::p2p::Options o;
  o.nranks = 4;
  for (rr::Wire w : kWires)
    for (rr::Coll coll : {rr::Coll::AllReduce, rr::Coll::ReduceScatter})
      for (Algo algo : {Algo::Auto, Algo::Ring, Algo::Copy, Algo::OneShot, Algo::TwoShot}) {
        o.algo = algo;
        const int64_t numel = int64_t{64} << 20;
        const rc::p2p::Plan p = rc::p2p::plan({coll, rr::DType::F32, rr::RedOp::Sum, numel, nullptr, nullptr, w}, o, true);
        const bool rs = coll == rr::Coll::ReduceScatter;
        EXPECT(p.algo == (rs || algo != Algo::OneShot ? Algo::TwoShot : Algo::OneShot),
               "wire plan %s %s forced %s: %s", rr::wire_name(w), rr::coll_name(coll), rc::p2p::algo_name(algo),
               rc::p2p::algo_name(p.algo));
        EXPECT(p.slice_elems % rr::kWireBlock == 0 && p.slice_elems > 0, "wire plan: piece of %lld elements",
               (long long)p.slice_elems);
        const bool sc = rr::wire_scaled(w);
        // A half's bytes for pieces of cap wire blocks: reduce_scatter 4 chunks' inputs; two-shot
        // the inputs and a quarter of them for the reduced chunk.
        auto used = [&](int64_t cap) {
          const uint64_t span = rc::p2p::workspace_wire_bytes(sc, rr::wire_elem_bytes(w), cap);
          return rs ? 4 * span : p.algo == Algo::OneShot ? span
                 : span + rc::p2p::workspace_wire_bytes(sc, rr::wire_elem_bytes(w), (cap + 3) / 4);
        };
        const int64_t span = rs ? numel / 4 : numel, cap = p.slice_elems / rr::kWireBlock;
        EXPECT(used(cap) <= o.chunk_bytes, "wire plan %s %s: spans of %llu bytes exceed the half",
               rr::wire_name(w), rr::coll_name(coll), (unsigned long long)used(cap));
        // Equal pieces, as few as fit (fewer pieces, fewer barriers).
        EXPECT(p.slice_elems * (p.steps - 1) < span && span <= p.slice_elems * p.steps &&
                   span > p.slice_elems * p.steps - rr::kWireBlock * p.steps,
               "wire plan %s: %lld pieces of %lld elements for %lld", rr::wire_name(w), (long long)p.steps,
               (long long)p.slice_elems, (long long)span);
        const int64_t fewer = p.steps > 1 ? (span / rr::kWireBlock + p.steps - 2) / (p.steps - 1) : 0;
        EXPECT(p.steps == 1 || used(fewer) > o.chunk_bytes, "wire plan %s %s: %lld pieces where %lld fit",
               rr::wire_name(w), rr::coll_name(coll), (long long)p.steps, (long long)(p.steps - 1));
      }
  o.algo = Algo::Auto;
  bool threw = false;
  try {
    rc::p2p::plan({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 1000, nullptr, nullptr, rr::Wire::BF16}, o, false);
  } catch (const rr::RingError& e) {
    threw = contains(e.what(), "wire_dtype=bfloat16") && contains(e.what(), "peer access");
  }
  EXPECT(threw, "wire plan: a group that cannot map every peer must refuse the wire, naming why");
  for (auto bad : {rr::Call{rr::Coll::AllGather, rr::DType::F32, rr::RedOp::Sum, 1000, nullptr, nullptr, rr::Wire::BF16},
                   rr::Call{rr::Coll::AllReduce, rr::DType::I32, rr::RedOp::Sum, 1000, nullptr, nullptr, rr::Wire::BF16},
                   rr::Call{rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Max, 1000, nullptr, nullptr, rr::Wire::E4M3}}) {
    std::string msg;
    try {
      rc::p2p::plan(bad, o, true);
    } catch (const std::invalid_argument& e) {
      msg = e.what();
    }
    EXPECT(contains(msg, "wire_dtype=") && contains(msg, "SUM or AVG"), "wire plan: bad call gave '%s'", msg.c_str());
  }
}

#ifdef RINGREDUCE_EMU
// The weak memory mode on the wire kernel: stores landing late and out of order, stale loads
// until an acquire; one-shot and two-shot, tiny pieces.
static void weak_wire() {
  const auto t0 = Clock::now();
  int cases = 0;
  for (uint64_t seed : {1, 2, 3}) {
    WeakScope weak(seed);
    for (int n = 2; n <= 3; ++n)
      for (rc::p2p::Algo algo : {rc::p2p::Algo::OneShot, rc::p2p::Algo::TwoShot}) {
        Group g(n, 2, 4096, 20.0, algo, true, 2048);
        char what[96];
        std::snprintf(what, sizeof what, "weak seed=%llu wire n=%d %s", (unsigned long long)seed, n,
                      rc::p2p::algo_name(algo));
        for (rr::Wire w : {rr::Wire::BF16, rr::Wire::E4M3})
          for (int64_t numel : {int64_t{300}, int64_t{1500 * n}}) {
            check_wire(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, w, numel, true, what, cases++);
            check_wire(g.ranks, rr::Coll::ReduceScatter, rr::DType::F32, rr::RedOp::Sum, w, numel, false, what, cases++);
          }
      }
  }
  std::printf("weak wire: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

#endif

int main(int argc, char** argv) {
  return p2p_main("test_p2p_wire", [&] {
    run_test(argc, argv, "test_wire", [&] { test_wire(); });
    run_test(argc, argv, "test_wire_overflow", [&] { test_wire_overflow(); });
    run_test(argc, argv, "test_wire_mismatch", [&] { test_wire_mismatch(); });
    run_test(argc, argv, "test_wire_plan", [&] { test_wire_plan(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "weak_wire", [&] { weak_wire(); });
#endif
  });
}
