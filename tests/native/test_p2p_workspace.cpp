// Native test of the symmetric workspace (one-shot, two-shot): epochs across block counts, ranks
// that cut a call between other numbers of blocks, the blocks knob; weak memory.
// Built against the emulated device in every CI run (test_p2p_workspace_emu; ranks are threads,
// areas are shared through the emulated IPC) and by nvcc where a toolkit is found
// (test_p2p_workspace; on a GPU, ranks are streams of one process). Exits 0 with a message when
// there is no CUDA device. `test_p2p_workspace_emu NAME...` runs the tests whose names contain a
// NAME (weak_* only so); without names, all but weak_*.
#include "p2p_check.h"

// Calls of different block counts on one communicator (a 4 KiB call runs one block, 1 MiB many):
// every block's epoch entry, used or not, ends every call at the same value on every rank, so
// that a later call's blocks (any number) agree on their barriers and workspace halves.
static void test_epochs_stay_equal() {
  const int n = 3;
  Group g(n, 2, 4096, 20.0, rc::p2p::Algo::TwoShot);
  std::vector<int> blocks;
  for (int64_t numel : {int64_t{1} << 18, int64_t{1000}, int64_t{1} << 16, int64_t{7}}) {
    DevBuf any(16);
    blocks.push_back(g.rings[0]->plan_of(g.call(numel, any)).blocks);
    check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, true,
                     "epochs across block counts");
    for (int r = 0; r < n; ++r) {
      const rr::Call c = g.call(1, any);
      const rc::p2p::SymArgs a = g.rings[r]->sym_args(c, g.rings[r]->plan_of(c));
      rc::p2p::SymFlags f[rc::p2p::kMaxSymBlocks];
      RR_CUDA_CHECK(cudaMemcpy(f, a.self->sym, sizeof f, cudaMemcpyDeviceToHost));
      for (int k = 1; k < rc::p2p::kMaxSymBlocks; ++k)
        EXPECT(f[k].epoch.value == f[0].epoch.value, "rank %d after %lld elements: block %d's epoch %llu, block 0's %llu",
               r, (long long)numel, k, (unsigned long long)f[k].epoch.value, (unsigned long long)f[0].epoch.value);
    }
  }
  EXPECT(blocks.front() > 1 && blocks[1] == 1, "the calls ran %d and %d blocks", blocks.front(), blocks[1]);
}

// Ranks whose plans cut a call between different numbers of blocks (a per-rank block cap): every
// rank stops with the cause, never reads parts its peers' blocks have not written.
static void test_block_counts_must_agree() {
  DevBuf buf(4096 * 4);
  Group g(2, 4, 4096, 5.0, rc::p2p::Algo::TwoShot, true, rc::p2p::kDefaultChunkBytes, false, 0, false,
          rc::p2p::kDefaultCopySlotBytes, [](int r, rc::p2p::Options& o) { o.channels = r ? 3 : 4; });
  const auto t0 = Clock::now();
  for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(4096, buf), g.ranks[r].stream);
  sync_all(g);
  EXPECT(seconds_since(t0) < 3, "blocks 4 against 3: stopped after %.1f s (timeout 5 s)", seconds_since(t0));
  const std::string f = g.rings[0]->failure() + " | " + g.rings[1]->failure();
  EXPECT(contains(f, "cut the call between 3 blocks, this rank between 4") ||
             contains(f, "cut the call between 4 blocks, this rank between 3"),
         "blocks 4 against 3: '%s'", f.c_str());
}

// Options::sym_blocks (RINGREDUCE_CUDA_SYM_BLOCKS): the most blocks a workspace call uses below the
// residency cap, one per 32 KiB of a piece below that; out of range refused when the ring is made.
static void test_sym_blocks_knob() {
  using rc::p2p::Algo;
  rc::p2p::Options o;
  o.nranks = 2;
  o.max_blocks = 64;
  auto blocks_of = [&](int64_t bytes, rr::Wire w) {
    return rc::p2p::plan({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, bytes / 4, nullptr, nullptr, w},
                         o, true).blocks;
  };
  const int64_t big = int64_t{64} << 20;
  EXPECT(blocks_of(big, rr::Wire::None) == rc::p2p::kDefaultSymBlocks, "default: %d", blocks_of(big, rr::Wire::None));
  o.sym_blocks = rc::p2p::kMaxSymBlocks;
  EXPECT(blocks_of(big, rr::Wire::None) == rc::p2p::kMaxSymBlocks && blocks_of(big, rr::Wire::BF16) == rc::p2p::kMaxSymBlocks,
         "sym_blocks %d: %d, wire %d", o.sym_blocks, blocks_of(big, rr::Wire::None), blocks_of(big, rr::Wire::BF16));
  EXPECT(blocks_of(4096, rr::Wire::None) == 1, "4 KiB: one block");
  o.max_blocks = 8;  // the residency cap still wins
  EXPECT(blocks_of(big, rr::Wire::None) == 8, "capped: %d", blocks_of(big, rr::Wire::None));
  o.max_blocks = 64;
  o.sym_blocks = 3;
  EXPECT(blocks_of(big, rr::Wire::None) == 3, "sym_blocks 3: %d", blocks_of(big, rr::Wire::None));
  for (int bad : {0, rc::p2p::kMaxSymBlocks + 1}) {
    rc::p2p::Options b;
    b.nranks = 1;
    b.sym_blocks = bad;
    std::string what;
    try {
      rc::p2p::Endpoint r(b);
    } catch (const std::invalid_argument& e) {
      what = e.what();
    }
    EXPECT(contains(what, "sym_blocks must be 1.." + std::to_string(rc::p2p::kMaxSymBlocks)), "sym_blocks=%d: '%s'",
           bad, what.c_str());
  }
  // The measured table's value (Endpoint::set_sym_blocks, from the binding), checked alike; a call
  // of 64 MiB at world 2 then runs kMaxSymBlocks blocks where the device has the SMs.
  rc::p2p::Options one;
  one.nranks = 1;
  rc::p2p::Endpoint ring(one);
  std::string what;
  try {
    ring.set_sym_blocks(rc::p2p::kMaxSymBlocks + 1);
  } catch (const std::invalid_argument& e) {
    what = e.what();
  }
  EXPECT(contains(what, "sym_blocks must be 1.." + std::to_string(rc::p2p::kMaxSymBlocks)), "set_sym_blocks: '%s'",
         what.c_str());
  o.sym_blocks = rc::p2p::kMaxSymBlocks;
  o.max_blocks = 66;  // an H200's 132 SMs over two ranks
  EXPECT(blocks_of(big, rr::Wire::None) == 64, "64 MiB at world 2 with 66 resident: %d", blocks_of(big, rr::Wire::None));
}

int main(int argc, char** argv) {
  return p2p_main("test_p2p_workspace", [&] {
    run_test(argc, argv, "test_epochs_stay_equal", [&] { test_epochs_stay_equal(); });
    run_test(argc, argv, "test_block_counts_must_agree", [&] { test_block_counts_must_agree(); });
    run_test(argc, argv, "test_sym_blocks_knob", [&] { test_sym_blocks_knob(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "weak_oneshot", [&] { weak_sweep(rc::p2p::Algo::OneShot); });
    run_test(argc, argv, "weak_twoshot", [&] { weak_sweep(rc::p2p::Algo::TwoShot); });
#endif
  });
}
