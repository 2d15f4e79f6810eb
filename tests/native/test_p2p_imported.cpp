// Native test of imported memory (ordinary tensors mapped by the peers): in place after the first
// call, releases and the reaper, beside a capture, a failed open, the result in stream order; weak
// memory.
// Built against the emulated device in every CI run (test_p2p_imported_emu; ranks are threads,
// areas are shared through the emulated IPC) and by nvcc where a toolkit is found
// (test_p2p_imported; on a GPU, ranks are streams of one process). Exits 0 with a message when
// there is no CUDA device. `test_p2p_imported_emu NAME...` runs the tests whose names contain a
// NAME (weak_* only so); without names, all but weak_*.
#include "p2p_check.h"

// Ordinary memory, imported (Algo::Imported): the first call on a tensor goes through the workspace
// (no prediction yet), the next on the same memory runs in place, and both are exact: every dtype
// and op, tensors at other offsets on each rank inside a larger allocation, a rank whose tensor
// moves to another allocation (the others' predictions wrong: through the workspace, then in place
// again), and a freed allocation: its owner withdraws it, the peers close their mappings before it
// is freed (the emulator counts any free of mapped memory), and a new allocation is imported anew.
static void test_imported() {
  using rc::p2p::Algo;
  int cases = 0;
  const auto t0 = Clock::now();
  for (int n = 2; n <= 3; ++n) {
    std::vector<std::shared_ptr<char>> mem;
    std::vector<std::unique_ptr<DevBuf>> other;
    for (int r = 0; r < n; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
      mem.push_back(g_held.alloc(1 << 20));
      other.push_back(std::make_unique<DevBuf>(1 << 20));
    }
    Group g(n, 2, 4096, 20.0);
    for (auto& ring : g.rings) ring->set_threshold(0), ring->set_ll_max(0);
    attach_boards(g);
    std::vector<char*> at(n), moved(n);
    for (int r = 0; r < n; ++r) at[r] = mem[r].get() + 4096 * (r + 1);
    const rr::Call probe{rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 100, at[0], at[0]};
    EXPECT(g.rings[0]->plan_of(probe).algo == Algo::Imported, "n=%d: an ordinary tensor planned %s", n,
           rc::p2p::algo_name(g.rings[0]->plan_of(probe).algo));
    char what[64];
    std::snprintf(what, sizeof what, "imported n=%d", n);
    int calls = 0;
    for (rr::DType t : kDtypes)
      for (rr::RedOp op : kOps)
        for (int64_t numel : {int64_t{1}, int64_t{n + 1}, int64_t{1000 * n + 7}})
          for (int twice = 0; twice < 2; ++twice, ++calls)
            check_collective(g.ranks, rr::Coll::AllReduce, t, op, numel, true, what, 1, &at);
    if (g_failures) return;
    // Learned by the next call's plan: every call seen, all in place but the first at each offset.
    check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 5000, true, what, 1, &at);
    const uint64_t seen = g.rings[0]->imported_seen(), in_place = g.rings[0]->imported_in_place();
    std::set<size_t> offsets;  // the tensors start one element in: a tag per element size
    for (rr::DType t : kDtypes) offsets.insert(rr::dtype_size(t));
    cases += calls;
    EXPECT(seen == static_cast<uint64_t>(calls) && in_place == seen - offsets.size(),
           "n=%d: %llu calls seen, %llu in place", n, (unsigned long long)seen, (unsigned long long)in_place);
    // Rank n-1's tensor moves: the others predict its old memory, so the call goes through the
    // workspace; the next runs in place again.
    moved = at;
    moved[n - 1] = other[n - 1]->p + 64;
    for (int k = 0; k < 3; ++k)
      check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 5000, true, "imported moved", 0, &moved);
    const uint64_t before = g.rings[0]->imported_in_place();
    check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 5000, true, "imported moved", 0, &moved);
    EXPECT(g.rings[0]->imported_seen() == seen + 4 && before == in_place + 2,
           "n=%d: after a rank's tensor moved, %llu of 3 calls in place", n,
           (unsigned long long)(before - in_place));
    // Rank 0's tensor moves and comes back: its own prediction (from before) is right again while
    // the others' (from the call it moved) are wrong; every rank must see that and go through
    // the workspace alike.
    std::vector<char*> away = moved;
    away[0] = other[0]->p + 128;
    for (const std::vector<char*>* where : {&away, &moved, &moved})
      check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 5000, true, "imported back", 0,
                       where);
#ifdef RINGREDUCE_EMU
    // Inside a CUDA graph capture (global mode) nothing new is mapped, which would invalidate it:
    // fresh memory goes through the workspace, and the capture stays valid.
    {
      std::vector<std::shared_ptr<char>> fresh;
      const int64_t numel = 3000;
      const size_t imported = g.rings[1]->imports();
      for (int r = 0; r < n; ++r) {
        RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
        fresh.push_back(g_held.alloc(numel * 4));
        const std::vector<float> v(numel, static_cast<float>(r + 1));
        RR_CUDA_CHECK(cudaMemcpyAsync(fresh[r].get(), v.data(), numel * 4, cudaMemcpyHostToDevice, g.ranks[r].stream));
        RR_CUDA_CHECK(cudaStreamSynchronize(g.ranks[r].stream));
      }
      for (int r = 0; r < n; ++r) emu_set_capturing(g.ranks[r].stream, 1);
      for (int r = 0; r < n; ++r) {
        RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
        g.rings[r]->run(bound({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, fresh[r].get(), fresh[r].get()},
                              g.ranks[r].stream),
                        g.ranks[r].stream);
      }
      for (int r = 0; r < n; ++r) {
        EXPECT(!emu_capture_invalidated(g.ranks[r].stream), "n=%d rank %d: the capture was invalidated", n, r);
        emu_set_capturing(g.ranks[r].stream, 0);
      }
      sync_all(g);
      for (int r = 0; r < n; ++r) {
        std::vector<float> got(numel);
        RR_CUDA_CHECK(cudaMemcpy(got.data(), fresh[r].get(), numel * 4, cudaMemcpyDeviceToHost));
        EXPECT(got[0] == n * (n + 1) / 2 && got[numel - 1] == n * (n + 1) / 2, "n=%d rank %d: captured call gave %g",
               n, r, got[0]);
      }
      EXPECT(g.rings[1]->imports() == imported, "n=%d: a capture mapped memory", n);
      // Never shared (first seen in a capture): nothing holds it, it goes with the test's handle.
      const int freed = g_held.freed();
      fresh.clear();
      EXPECT(g_held.freed() == freed + n, "n=%d: memory first seen in a capture was held", n);
    }
#endif
    // Rank 0 lets go of its allocation (as a tensor's last reference goes): withdrawn by its
    // reaper, the peers' mappings closed, and only then freed (the emulator counts a free of
    // mapped memory); its next allocation is shared anew.
    const size_t mapped = g.rings[1]->imports();
    const int freed = g_held.freed();
    const uint64_t frees_mapped = frees_while_mapped();
    mem[0].reset();
    EXPECT(eventually([&] { return g_held.freed() == freed + 1; }), "n=%d: rank 0's memory was never freed", n);
    EXPECT(g.rings[1]->imports() == mapped - 1, "n=%d: rank 1 maps %zu allocations after rank 0's free (before: %zu)",
           n, g.rings[1]->imports(), mapped);
    EXPECT(frees_while_mapped() == frees_mapped, "n=%d: freed while a peer mapped it", n);
    EXPECT(g.rings[0]->import_note().empty(), "rank 0: %s", g.rings[0]->import_note().c_str());
    RR_CUDA_CHECK(cudaSetDevice(device_of(0)));
    mem[0] = g_held.alloc(1 << 20);
    const bool same_address = mem[0].get() == moved[0];
    moved[0] = mem[0].get();
    g.rings[0]->learn();
    const uint64_t freed_in_place = g.rings[0]->imported_in_place();
    for (int k = 0; k < 4; ++k)
      check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::BF16, rr::RedOp::Sum, 3 * 65536 + 5, true,
                       "imported after a free", 0, &moved);
    // the first through the workspace (the new allocation is shared anew), the others in place
    g.rings[0]->learn();
    EXPECT(g.rings[0]->imported_in_place() == freed_in_place + 3,
           "n=%d: after a free and a new allocation%s, %llu of 4 calls in place", n,
           same_address ? " at the same address" : "",
           (unsigned long long)(g.rings[0]->imported_in_place() - freed_in_place));
  }
  std::printf("imported memory: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

#ifdef RINGREDUCE_EMU
// Issue 81 item 3: nothing on the owner's free path waits for another process. An owner lets go
// of its tensor (torch's free of the block would follow at once); its hold keeps the memory until
// every peer's reaper closed its mapping, then the owner's reaper drops it (the free): never
// while mapped. A peer whose ring a CUDA graph pins closes nothing (its captured launches may read
// the mappings), so the owner keeps the memory, its calls going on, until the pin goes; a group
// closed under such a pin keeps it until exit (close(false)).
static void test_imported_release() {
  for (int n = 2; n <= 3; ++n) {
    Group g(n, 2, 4096, 20.0);
    for (auto& ring : g.rings) ring->set_threshold(0), ring->set_ll_max(0);
    attach_boards(g);
    std::vector<std::shared_ptr<char>> mem = imported_tensors(g, 5000, 3);
    if (g_failures) return;
    EXPECT(g.rings[1]->imports() >= 1, "n=%d: rank 1 mapped nothing of rank 0's", n);
    const uint64_t mapped_frees = frees_while_mapped();
    int freed = g_held.freed();
    const size_t holds = g.rings[0]->holds();
    const auto t0 = Clock::now();
    mem[0].reset();  // torch's free path: returns at once (the hold is ours)
    const double drop_us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    EXPECT(eventually([&] { return g_held.freed() == freed + 1; }), "n=%d: rank 0's memory never freed", n);
    const double free_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    EXPECT(frees_while_mapped() == mapped_frees, "n=%d: freed while a peer mapped it", n);
    EXPECT(g.rings[0]->holds() == holds - 1, "n=%d: rank 0 keeps %zu holds, not %zu", n, g.rings[0]->holds(), holds - 1);
    std::printf("n=%d: the owner let go in %.1f us; freed %.1f ms later, after every peer closed\n", n, drop_us,
                free_ms);
    // A graph pins rank 1's ring: it closes nothing, so rank 0 keeps its memory; calls go on.
    void* pin = g.rings[1]->graph_pin();
    std::vector<std::shared_ptr<char>> fresh = imported_tensors(g, 3000, 2);
    const std::weak_ptr<char> watched = fresh[0];  // expired: freed
    fresh.clear();  // every rank lets go
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT(!watched.expired(), "n=%d: rank 0 freed memory a pinned peer maps", n);
    std::vector<std::shared_ptr<char>> more = imported_tensors(g, 2000, 2);  // calls still run
    rc::p2p::Endpoint::release_graph_pin(pin);
    EXPECT(eventually([&] { return watched.expired(); }), "n=%d: rank 0 kept its memory after the pin went", n);
    EXPECT(frees_while_mapped() == mapped_frees, "n=%d: freed while a pinned peer mapped it", n);
    more.clear();
    mem.clear();
    // A group closed while rank 1 is pinned (unmap_peers refuses): every rank closes keeping what a
    // peer may map (close(false)); nothing is freed while mapped.
    std::vector<std::shared_ptr<char>> last = imported_tensors(g, 1000, 2);
    void* pin2 = g.rings[1]->graph_pin();
    EXPECT(!g.rings[1]->unmap_peers(), "n=%d: a pinned ring unmapped its peers", n);
    last.clear();
    for (auto& ring : g.rings) ring->close(false);
    EXPECT(frees_while_mapped() == mapped_frees, "n=%d: a close under a pin freed mapped memory", n);
    rc::p2p::Endpoint::release_graph_pin(pin2);
  }
}

// Issue 81 item 4: IPC calls beside a CUDA graph capture on another thread (torch.cuda.graph
// captures in global mode): a first export, a peer's first open and a reaper's close run in
// relaxed mode, so the user's capture stays valid.
static void test_imports_beside_a_capture() {
  const int n = 2;
  Group g(n, 2, 4096, 20.0);
  for (auto& ring : g.rings) ring->set_threshold(0), ring->set_ll_max(0);
  attach_boards(g);
  cudaStream_t user;
  RR_CUDA_CHECK(cudaStreamCreateWithFlags(&user, cudaStreamNonBlocking));
  emu_set_capturing(user, 1);
  {
    std::vector<std::shared_ptr<char>> mem = imported_tensors(g, 5000, 3);  // get + open
    EXPECT(g.rings[1]->imports() == 1, "rank 1 maps %zu allocations (beside a capture)", g.rings[1]->imports());
    const int freed = g_held.freed();
    mem.clear();  // the reapers close, then the holds go
    EXPECT(eventually([&] { return g_held.freed() == freed + n; }), "memory not freed beside a capture");
  }
  EXPECT(!emu_capture_invalidated(user), "an IPC call invalidated another thread's capture");
  emu_set_capturing(user, 0);
  RR_CUDA_CHECK(cudaStreamDestroy(user));
}

// Issue 81 item 8: a peer's allocation that cannot be mapped here is tried once, not on every
// call (each would cost an IPC open); the calls go through the workspace, exact.
static void test_failed_open_remembered() {
  const int n = 2;
  Group g(n, 2, 4096, 20.0);
  for (auto& ring : g.rings) ring->set_threshold(0), ring->set_ll_max(0);
  attach_boards(g);
  std::vector<std::shared_ptr<char>> mem;
  std::vector<char*> at(n);
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
    mem.push_back(g_held.alloc(5000 * 4));
    at[r] = mem[r].get();
  }
  check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 5000, true, "open fails", 0, &at);
  emu_fail_ipc_opens(n);  // every rank's open of its peer's memory, at the next call
  const uint64_t opens = emu_ipc_opens();
  check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 5000, true, "open fails", 0, &at);
  EXPECT(emu_ipc_opens() == opens + n, "%llu opens at the first call, not %d", (unsigned long long)(emu_ipc_opens() - opens), n);
  for (int k = 0; k < 5; ++k)
    check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 5000, true, "open fails", 0, &at);
  EXPECT(emu_ipc_opens() == opens + n, "a failed open was retried %llu times in 5 calls",
         (unsigned long long)(emu_ipc_opens() - opens - n));
  EXPECT(g.rings[0]->import_note().find("could not be mapped") != std::string::npos, "rank 0's note: %s",
         g.rings[0]->import_note().c_str());
  emu_fail_ipc_opens(0);
}

// Imported memory under the weak memory mode and the happens-before check: each case twice, the
// first through the workspace (no prediction), the second in place (the tags and the peers'
// tensors read after the start barrier's acquire).
static void weak_imported() {
  const auto t0 = Clock::now();
  int cases = 0;
  for (uint64_t seed : {1, 2, 3}) {
    WeakScope weak(seed);
    for (int n = 2; n <= 3; ++n) {
      std::vector<std::unique_ptr<DevBuf>> mem;
      std::vector<char*> at(n);
      for (int r = 0; r < n; ++r) {
        RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
        mem.push_back(std::make_unique<DevBuf>(1 << 16));
        at[r] = mem[r]->p + 256 * r;
      }
      Group g(n, 2, 64, 20.0, rc::p2p::Algo::Auto, true, 64);
      for (auto& ring : g.rings) ring->set_threshold(0), ring->set_ll_max(0);
      attach_boards(g);
      char what[96];
      std::snprintf(what, sizeof what, "weak seed=%llu p2p n=%d imported", (unsigned long long)seed, n);
      for (rr::DType t : {rr::DType::F32, rr::DType::BF16, rr::DType::I64})
        for (int64_t numel : {int64_t{n + 1}, int64_t{200 * n}})
          for (int twice = 0; twice < 2; ++twice, ++cases)
            check_collective(g.ranks, rr::Coll::AllReduce, t, rr::RedOp::Sum, numel, true, what, 0, &at);
      EXPECT(g.rings[0]->imported_in_place() > 0, "%s: no call ran in place", what);
    }
  }
  std::printf("weak imported: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

#endif

int main(int argc, char** argv) {
  return p2p_main("test_p2p_imported", [&] {
    run_test(argc, argv, "test_imported_result_in_stream_order", [&] { test_result_in_stream_order(true); });
    run_test(argc, argv, "test_imported", [&] { test_imported(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_imported_release", [&] { test_imported_release(); });
    run_test(argc, argv, "test_imports_beside_a_capture", [&] { test_imports_beside_a_capture(); });
    run_test(argc, argv, "test_failed_open_remembered", [&] { test_failed_open_remembered(); });
    run_test(argc, argv, "weak_imported", [&] { weak_imported(); });
#endif
  });
}
