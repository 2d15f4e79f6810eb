// Native test of the copy algorithm (copies into the peers' inboxes, stream waits on counters):
// sizes and shifts, its failures (timeout, mismatch, abort, capture), the emulator's hardware
// queues; weak memory.
// Built against the emulated device in every CI run (test_p2p_copy_emu; ranks are threads, areas
// are shared through the emulated IPC) and by nvcc where a toolkit is found (test_p2p_copy; on a
// GPU, ranks are streams of one process). Exits 0 with a message when there is no CUDA device.
// `test_p2p_copy_emu NAME...` runs the tests whose names contain a NAME (weak_* only so); without
// names, all but weak_*.
#include "p2p_check.h"

// The copy algorithm (ranks sharing a GPU without MPS): copies into the peers' inboxes and
// stream waits on counters, a kernel that never waits. Forced, with tiny pieces (many per call, so
// that the inbox slots are reused while peers still fold: the "freed" counts), unaligned too; then
// as auto picks it for time-sliced ranks on one device, at the default piece size.
static Group copy_group(int n, size_t piece_bytes, double timeout_s = 20.0, bool one_device = false) {
  return Group(n, 2, 4096, timeout_s, rc::p2p::Algo::Copy, false, rc::p2p::kDefaultChunkBytes,
               false, 0, one_device, piece_bytes);
}

static void test_copy() {
  using rc::p2p::Algo;
  int cases = 0;
  const auto t0 = Clock::now();
  for (int n = 2; n <= 4; ++n) {
    for (int shift : {0, 1}) {
      Group g = copy_group(n, 64);
      char what[96];
      std::snprintf(what, sizeof what, "copy n=%d pieces of 64 B shift=%d", n, shift);
      cases += sweep(g.ranks, {0, 1, n - 1, n + 1, 100 * n + 7}, what, shift);
      if (g_failures) return;
    }
    // Ranks sharing a device: auto runs the symmetric workspace (the copy algorithm is opt-in: no
    // GPU has shown it faster there yet), and allocates no copy inbox.
    Group g(n, 2, 4096, 20.0, Algo::Auto, false, rc::p2p::kDefaultChunkBytes, false,
            std::max(1, rc::sm_count() / n), true, 4096);
    EXPECT(!g.rings[0]->copies(), "auto n=%d: a copy inbox", n);
    DevBuf any(16);
    for (int64_t numel : {int64_t{1}, int64_t{1} << 24}) {
      const rc::p2p::Plan p = g.rings[0]->plan_of(g.call(numel, any));
      EXPECT(p.algo != Algo::Copy && p.algo != Algo::Ring, "time-sliced n=%d: %lld floats planned %s", n,
             (long long)numel, rc::p2p::algo_name(p.algo));
    }
    char what[96];
    std::snprintf(what, sizeof what, "p2p n=%d time-sliced on one device, auto", n);
    cases += sweep(g.ranks, {1, 1000 * n + 7, 3 * 4096 + 5}, what, 0);
    if (g_failures) return;
  }
  std::printf("copy: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

// The copy algorithm's failures, where a stream wait would wait forever: a silent rank (the
// watchdog times it out and releases every wait, the peers learn why), mismatched calls (a kernel
// sees the headers differ and releases the waits), a host abort; and a CUDA graph cannot capture it.
static void test_copy_failures() {
  {  // rank 2 never calls
    DevBuf buf(4096 * 4);
    Group g = copy_group(3, 1024, 1.0);
    const auto t0 = Clock::now();
    for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(4096, buf), g.ranks[r].stream);
    sync_all(g);
    EXPECT(seconds_since(t0) < 5, "copy: the silent rank was noticed after %.1f s (timeout 1 s)", seconds_since(t0));
    bool timed_out = false;
    for (int r = 0; r < 2; ++r) {
      const std::string f = g.rings[r]->failure();
      // The one who timed out names the rank that never sent (its other peer did).
      timed_out |= contains(f, "timed out after 1 s waiting for data from rank 2 ");
      EXPECT(contains(f, "timed out"), "copy: rank %d: failure is '%s'", r, f.c_str());
      EXPECT(g.rings[r]->failed_seq() == 1, "copy: rank %d: first failed call %llu, want 1", r,
             (unsigned long long)g.rings[r]->failed_seq());
      EXPECT(run_throws(g.ranks[r], r, buf, "broken by an earlier failure"), "copy: rank %d: a broken ring accepted a call", r);
    }
    EXPECT(timed_out, "copy: no rank reported the timeout itself");
    // The silent rank calls late: its call fails at once (its waits were released), naming why.
    const auto t1 = Clock::now();
    g.rings[2]->run(g.call(4096, buf), g.ranks[2].stream);
    sync_all(g);
    const std::string f2 = g.rings[2]->failure();
    EXPECT(contains(f2, "timed out") && contains(f2, "stopped because rank"), "copy: late rank 2: '%s'", f2.c_str());
    EXPECT(seconds_since(t1) < 0.9, "copy: the late rank took %.1f s to fail", seconds_since(t1));
    std::printf("copy timeout: rank 0 says: %s\nrank 2 says: %s\n", g.rings[0]->failure().c_str(), f2.c_str());
  }
  {  // rank 1 calls with another numel, after a good call (pieces of 1 KiB: 3 against 2)
    DevBuf buf(1000 * 4);
    Group g = copy_group(3, 1024, 30.0);
    EXPECT(g.rings[0]->plan_of(g.call(500, buf)).algo == rc::p2p::Algo::Copy, "copy: forced copy not planned");
    for (int r = 0; r < 3; ++r) g.rings[r]->run(g.call(500, buf), g.ranks[r].stream);
    sync_all(g);
    const auto t0 = Clock::now();
    for (int r = 0; r < 3; ++r) g.rings[r]->run(g.call(r == 1 ? 700 : 500, buf), g.ranks[r].stream);
    sync_all(g);
    EXPECT(seconds_since(t0) < 5, "copy: the mismatch took %.1f s (timeout 30 s)", seconds_since(t0));
    bool named = false;
    for (int r = 0; r < 3; ++r) {
      const std::string f = g.rings[r]->failure();
      EXPECT(!f.empty(), "copy: rank %d did not fail", r);
      named |= contains(f, "mismatched collective calls") && contains(f, "numel=700") &&
               contains(f, "numel=500") && contains(f, "copy");
      EXPECT(g.rings[r]->failed_seq() == 2, "copy: rank %d: first failed call %llu, want 2", r,
             (unsigned long long)g.rings[r]->failed_seq());
    }
    EXPECT(named, "copy: no rank named the mismatched calls");
    std::printf("copy mismatch: rank 1 says: %s\n", g.rings[1]->failure().c_str());
  }
  {  // rank 0 aborts while ranks 0 and 1 wait for a silent rank 2
    DevBuf buf(4096 * 4);
    Group g = copy_group(3, 1024, 30.0);
    for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(4096, buf), g.ranks[r].stream);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto t0 = Clock::now();
    g.rings[0]->abort("test abort");
    sync_all(g);
    EXPECT(seconds_since(t0) < 5, "copy: abort took %.1f s (timeout 30 s)", seconds_since(t0));
    EXPECT(contains(g.rings[0]->failure(), "test abort"), "copy: rank 0: '%s'", g.rings[0]->failure().c_str());
    const std::string f1 = g.rings[1]->failure();
    EXPECT(contains(f1, "stopped because rank 0 was aborted"), "copy: rank 1: '%s'", f1.c_str());
  }
#ifdef RINGREDUCE_EMU
  // One hardware queue per device (CUDA_DEVICE_MAX_CONNECTIONS=1): each ring's side stream runs
  // behind its rank's stream, which is stuck in a wait that never ends. The watchdog's release and
  // an abort must not need any stream: CPU stores into the shared counters.
  for (bool abort : {false, true}) {
    emu_set_connections(1);
    DevBuf buf(4096 * 4);
    Group g = copy_group(3, 1024, abort ? 30.0 : 1.0);
    emu_set_connections(0);
    for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(4096, buf), g.ranks[r].stream);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto t0 = Clock::now();
    if (abort) g.rings[0]->abort("test abort");
    for (int r = 0; r < 2; ++r) RR_CUDA_CHECK(cudaStreamSynchronize(g.ranks[r].stream));
    EXPECT(seconds_since(t0) < 5, "copy, one queue per device: %s took %.1f s", abort ? "abort" : "timeout",
           seconds_since(t0));
    const std::string f1 = g.rings[1]->failure();
    EXPECT(abort ? contains(f1, "stopped because rank 0 was aborted") : contains(f1, "timed out"),
           "copy, one queue per device: rank 1: '%s'", f1.c_str());
    g.rings[2]->abort("the test ends");  // its side stream is not stuck: let the others' go
    sync_all(g);
  }
  {  // capture refused before the call is counted, on every rank alike
    DevBuf buf(64 * 4);
    Group g = copy_group(2, 1024);
    emu_set_capturing(g.ranks[0].stream, 1);
    EXPECT(run_throws(g.ranks[0], 0, buf, "CUDA graph cannot capture the copy algorithm"),
           "copy: a capturing stream was accepted");
    emu_set_capturing(g.ranks[0].stream, 0);
    EXPECT(g.rings[0]->op_seq() == 0, "copy: the refused call was counted");
    check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 64, true,
                     "copy after a refused capture");
  }
#endif
}

#ifdef RINGREDUCE_EMU
// The emulator's hardware queues (emu_set_connections): with one per device, a stream waiting
// (cuStreamWaitValue64 on a host word) holds back another stream's later work; with a queue each
// it does not. What makes test_copy_failures' one-queue cases mean something.
static void test_emulated_hardware_queues() {
  using Fn = int (*)(cudaStream_t, unsigned long long, unsigned long long, unsigned);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  RR_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue64", &fn, 12000, cudaEnableDefault, &q));
  for (int k : {1, 0}) {
    RR_CUDA_CHECK(cudaSetDevice(0));
    emu_set_connections(k);
    cudaStream_t a, b;
    RR_CUDA_CHECK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
    RR_CUDA_CHECK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
    emu_set_connections(0);
    uint64_t word = 0;
    DevBuf d(64);
    EXPECT(reinterpret_cast<Fn>(fn)(a, reinterpret_cast<unsigned long long>(&word), 1, 0) == 0, "wait enqueued");
    RR_CUDA_CHECK(cudaMemsetAsync(d.p, 0, 64, b));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const cudaError_t later = cudaStreamQuery(b);
    EXPECT(later == (k == 1 ? cudaErrorNotReady : cudaSuccess), "%d queue(s): the other stream's memset is %s",
           k, later == cudaSuccess ? "done" : "held back");
    __atomic_store_n(&word, 1, __ATOMIC_SEQ_CST);
    RR_CUDA_CHECK(cudaStreamSynchronize(a));
    RR_CUDA_CHECK(cudaStreamSynchronize(b));
    cudaStreamDestroy(a);
    cudaStreamDestroy(b);
  }
}

#endif

int main(int argc, char** argv) {
  return p2p_main("test_p2p_copy", [&] {
    run_test(argc, argv, "test_copy", [&] { test_copy(); });
    run_test(argc, argv, "test_copy_failures", [&] { test_copy_failures(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_emulated_hardware_queues", [&] { test_emulated_hardware_queues(); });
    run_test(argc, argv, "weak_copy", [&] { weak_sweep(rc::p2p::Algo::Copy); });
#endif
  });
}
