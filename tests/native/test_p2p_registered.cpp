// Native test of registered buffers (shared_empty): every dtype and op, a mismatch, the result in
// stream order, a release (also under a graph's pin); weak memory.
// Built against the emulated device in every CI run (test_p2p_registered_emu; ranks are threads,
// areas are shared through the emulated IPC) and by nvcc where a toolkit is found
// (test_p2p_registered; on a GPU, ranks are streams of one process). Exits 0 with a message when
// there is no CUDA device. `test_p2p_registered_emu NAME...` runs the tests whose names contain a
// NAME (weak_* only so); without names, all but weak_*.
#include "p2p_check.h"

// all_reduce of tensors in registered buffers: every dtype and op, odd sizes, at the buffer's start
// and 4 KiB + 1 element into it (unaligned), between calls of the other algorithms on the same
// communicator (the sweep's reduce_scatter and all_gather, staged) and with a second buffer; the
// plan picks the registered algorithm for them only.
static void test_registered() {
  using rc::p2p::Algo;
  int cases = 0;
  const auto t0 = Clock::now();
  for (int n = 2; n <= 4; ++n) {
    Group g(n, rc::p2p::kDefaultChannels, rc::p2p::kDefaultSliceBytes, 20.0);
    const std::vector<char*> first = register_all(g, 2 << 20);
    const std::vector<char*> second = register_all(g, 4 << 20);
    std::vector<char*> inside(n);
    for (int r = 0; r < n; ++r) inside[r] = second[r] + 4096;
    for (int shift : {0, 1}) {
      const std::vector<char*>* at = shift ? &inside : &first;
      char what[96];
      std::snprintf(what, sizeof what, "registered n=%d shift=%d%s", n, shift, shift ? " second buffer" : "");
      cases += sweep(g.ranks, {1, n - 1, n + 1, 1000 * n + 7, 3 * 65536 + 5}, what, shift, at);
      if (g_failures) return;
    }
    const rr::Call in_reg{rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 100, inside[0], inside[0]};
    const rc::p2p::Plan p = g.rings[0]->plan_of(in_reg);
    EXPECT(p.algo == Algo::Registered && p.reg == 1 && p.reg_offset == 4096, "n=%d: plan %s buffer %d offset %llu", n,
           rc::p2p::algo_name(p.algo), p.reg, (unsigned long long)p.reg_offset);
    DevBuf plain(400);
    const Algo other = g.rings[0]->plan_of({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 100, plain.p, plain.p}).algo;
    EXPECT(other != Algo::Registered, "n=%d: a tensor outside every buffer planned as registered", n);
    // At auto's one-shot threshold or below, one-shot runs (one handshake instead of two).
    g.rings[0]->set_threshold(4096);
    const rr::Call small{rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 1024, inside[0], inside[0]};
    const rr::Call above{rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 1025, inside[0], inside[0]};
    EXPECT(g.rings[0]->plan_of(small).algo == Algo::OneShot && g.rings[0]->plan_of(above).algo == Algo::Registered,
           "n=%d: 4 KiB in a buffer ran %s, 4 KiB + 4 %s (one-shot threshold 4 KiB)", n,
           rc::p2p::algo_name(g.rings[0]->plan_of(small).algo), rc::p2p::algo_name(g.rings[0]->plan_of(above).algo));
    // Past the buffer's end: not registered (it would read past the peers' copies).
    const rr::Call over{rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, (2 << 20) / 4 + 1, first[0], first[0]};
    EXPECT(g.rings[0]->plan_of(over).algo != Algo::Registered, "n=%d: a tensor past its buffer's end planned as registered", n);
  }
  std::printf("registered buffers: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

// Ranks whose tensors sit at other offsets, or in a registered buffer on one rank only, or a rank
// that does not come: every calling rank stops, and the message says why.
static void test_registered_mismatch() {
  DevBuf plain(64 * 4);
  for (int kind = 0; kind < 3; ++kind) {
    Group g(2, 2, 4096, kind == 2 ? 2.0 : 10.0);
    const std::vector<char*> at = register_all(g, 1 << 16);
    for (int r = 0; r < 2; ++r) {
      if (kind == 2 && r == 1) continue;
      char* p = kind == 0 && r == 1 ? at[r] + 256 : kind == 1 && r == 1 ? plain.p : at[r];
      g.rings[r]->run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 64, p, p}, g.ranks[r].stream);
    }
    sync_all(g);
    const char* want[] = {"byte offset 256 of its shared buffer #0", "shared_empty buffer on one rank only",
                          "timed out"};
    for (int r = 0; r < (kind == 2 ? 1 : 2); ++r) {
      const std::string f = g.rings[r]->failure();
      EXPECT(contains(f, want[kind]), "case %d rank %d: '%s' lacks '%s'", kind, r, f.c_str(), want[kind]);
    }
    std::printf("registered mismatch %d: rank 0 says: %s\n", kind, g.rings[0]->failure().c_str());
  }
}

// A rank that lets go of a buffer (its tensor is gone) unmaps the peers' copies and frees its own:
// its plans no longer pick the buffer, and a peer that still calls on it stops with the mismatch,
// having read none of the freed memory. Within a CUDA graph's pin the memory is kept instead.
static void test_registered_release() {
  Group g(2, 2, 4096, 5.0);
  const std::vector<char*> at = register_all(g, 1 << 16);
  const int64_t numel = 1000;
  for (int r = 0; r < 2; ++r) g.rings[r]->run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, at[r], at[r]}, g.ranks[r].stream);
  sync_all(g);
  std::weak_ptr<char> gone = g.rings[0]->reg_memory(0);
  char* const copy0 = at[0];
  g.rings[0]->reg_release(0);
  // Rank 1 still maps rank 0's copy: it is freed at the close, after every rank unmapped.
  EXPECT(!gone.expired(), "rank 0 freed its copy while rank 1 maps it");
  DevBuf plain(numel * 4);
  const rr::Call after{rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, copy0, copy0};
  EXPECT(g.rings[0]->plan_of(after).algo != rc::p2p::Algo::Registered, "a released buffer is still planned");
  g.rings[0]->run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, plain.p, plain.p}, g.ranks[0].stream);
  g.rings[1]->run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, at[1], at[1]}, g.ranks[1].stream);
  sync_all(g);
  const std::string f = g.rings[1]->failure();
  EXPECT(contains(f, "shared_empty buffer on one rank only"), "rank 1: '%s'", f.c_str());
  // A broken ring keeps what it releases (a peer's stopped call may still write into it).
  const size_t kept = rc::p2p::Endpoint::kept_bytes();
  g.rings[1]->reg_release(0);
  EXPECT(rc::p2p::Endpoint::kept_bytes() == kept + (1 << 16), "a broken ring's released buffer: kept %zu bytes more",
         rc::p2p::Endpoint::kept_bytes() - kept);
}

// A buffer released while a CUDA graph pins the ring is kept until exit, and counted once: a
// close() still under the pin keeps the area, not the buffer a second time (the review's nit:
// g_kept_bytes counted it twice).
static void test_pinned_release_counted_once() {
  Group g(2, 2, 4096, 5.0);
  register_all(g, 1 << 16);
  void* pin = g.rings[0]->graph_pin();
  const size_t kept = rc::p2p::Endpoint::kept_bytes();
  g.rings[0]->reg_release(0);
  EXPECT(rc::p2p::Endpoint::kept_bytes() == kept + (1 << 16), "a pinned release kept %zu bytes",
         rc::p2p::Endpoint::kept_bytes() - kept);
  const size_t area = g.rings[0]->area_bytes();
  RR_CUDA_CHECK(cudaSetDevice(device_of(0)));
  g.rings[0]->close(/*peers_done=*/true);
  EXPECT(rc::p2p::Endpoint::kept_bytes() == kept + (1 << 16) + area,
         "close() under the pin kept %zu bytes more, want the area's %zu",
         rc::p2p::Endpoint::kept_bytes() - kept - (1 << 16), area);
  rc::p2p::Endpoint::release_graph_pin(pin);
}

int main(int argc, char** argv) {
  return p2p_main("test_p2p_registered", [&] {
    run_test(argc, argv, "test_registered", [&] { test_registered(); });
    run_test(argc, argv, "test_registered_mismatch", [&] { test_registered_mismatch(); });
    run_test(argc, argv, "test_registered_result_in_stream_order", [&] { test_result_in_stream_order(false); });
    run_test(argc, argv, "test_registered_release", [&] { test_registered_release(); });
    run_test(argc, argv, "test_pinned_release_counted_once", [&] { test_pinned_release_counted_once(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "weak_registered", [&] { weak_sweep(rc::p2p::Algo::Auto, true); });
#endif
  });
}
