// Native test of the endpoint's lifetime: a failed call after close, aborts, a refused launch, CUDA
// graph replays and pins, closing while a neighbour reads, nothing freed while mapped, no CUDA call
// after stop_threads.
// Built against the emulated device in every CI run (test_p2p_close_emu; ranks are threads, areas
// are shared through the emulated IPC) and by nvcc where a toolkit is found (test_p2p_close; on a
// GPU, ranks are streams of one process). Exits 0 with a message when there is no CUDA device.
// `test_p2p_close_emu NAME...` runs the tests whose names contain a NAME (weak_* only so); without
// names, all but weak_*.
#include "p2p_check.h"

#ifdef RINGREDUCE_EMU
// Issue 81 item 5: after stop_threads (a communicator left to the process's exit) no thread of
// the transport makes a CUDA call: the runtime may be tearing down.
static void test_no_cuda_call_after_stop_threads() {
  const int n = 2;
  Group g(n, 2, 4096, 20.0);
  for (auto& ring : g.rings) ring->set_threshold(0), ring->set_ll_max(0);
  attach_boards(g);
  for (int r = 0; r < n; ++r) g.rings[r]->watch_peers({rr::runtime::Peer{1 - r, getpid()}});
  std::vector<std::shared_ptr<char>> mem = imported_tensors(g, 5000, 3);  // mapped by the peer
  for (auto& ring : g.rings) ring->stop_threads();
  emu_watch_calls(1);
  mem.clear();  // a live reaper would withdraw, close the peer's mapping and free
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  const uint64_t calls = emu_other_thread_calls();
  emu_watch_calls(0);
  EXPECT(calls == 0, "%llu CUDA calls from a transport's threads after stop_threads", (unsigned long long)calls);
}

// Freeing memory a peer still maps is undefined in CUDA (issue 51, finding 3): a released shared
// buffer's own copy and a rank's workspace are freed only in the close's second phase, after every
// rank has unmapped (unmap_peers, a barrier in the binding). The emulator counts each cudaFree of
// memory an IPC mapping still maps; a close of one rank alone (no first phase) is one.
static void test_close_frees_nothing_mapped() {
  const uint64_t before = emu_frees_while_mapped();
  std::weak_ptr<char> copy0;
  {
    Group g(3, 2, 4096, 5.0);
    const std::vector<char*> at = register_all(g, 1 << 16);
    for (int r = 0; r < 3; ++r)
      g.rings[r]->run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 1000, at[r], at[r]}, g.ranks[r].stream);
    sync_all(g);
    copy0 = g.rings[0]->reg_memory(0);
    g.rings[0]->reg_release(0);
    g.rings[2]->reg_release(0);
    EXPECT(!copy0.expired(), "rank 0's released copy was freed while its peers map it");
    std::vector<std::unique_ptr<DevBuf>> plain;
    for (int r = 0; r < 3; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
      plain.push_back(std::make_unique<DevBuf>(4000));
      g.rings[r]->run(g.call(1000, *plain.back()), g.ranks[r].stream);
    }
    sync_all(g);
  }  // the two-phase close
  EXPECT(copy0.expired(), "rank 0's released copy outlived the close");
  EXPECT(emu_frees_while_mapped() == before, "%llu frees of mapped memory",
         (unsigned long long)(emu_frees_while_mapped() - before));
  // Without the first phase the emulator sees it: rank 0 frees its workspace while 1 and 2 map it.
  {
    Group g(3, 2, 4096, 5.0);
    RR_CUDA_CHECK(cudaSetDevice(g.ranks[0].device));
    g.rings[0]->close(/*peers_done=*/true);
    EXPECT(emu_frees_while_mapped() == before + 1, "a one-phase close: %llu frees of mapped memory",
           (unsigned long long)(emu_frees_while_mapped() - before));
    g_allowed_frees_while_mapped += emu_frees_while_mapped() - before;
  }
}

#endif

// A call that failed on the device stays failed after close() (issue 51, finding 4): a Work
// waited on after its communicator closed (the worker's join timed out) must not report success
// because the error records went with the communicator.
static void test_failed_call_survives_close() {
  DevBuf buf(4096 * 4);
  Group g(3, 2, 4096, 1.0, rc::p2p::Algo::TwoShot);
  for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(4096, buf), g.ranks[r].stream);  // rank 2 is silent
  sync_all(g);
  for (int r = 0; r < 2; ++r) {
    EXPECT(g.rings[r]->failed_seq() == 1, "rank %d before close: first failed call %llu", r,
           (unsigned long long)g.rings[r]->failed_seq());
    RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
    g.rings[r]->close(false);
    EXPECT(g.rings[r]->failed_seq() == 1, "rank %d after close: first failed call %llu, want 1", r,
           (unsigned long long)g.rings[r]->failed_seq());
  }
}

#ifdef RINGREDUCE_EMU
// Rank 0's kernel launch is refused (issue 51, finding 6): run() throws there, and the group is
// aborted, so ranks 1 and 2, already waiting in the call's kernel, stop at once instead of at
// their timeout. On each algorithm.
static void test_launch_failure_aborts_the_group() {
  for (rc::p2p::Algo algo : kAlgos) {
    DevBuf buf(4096 * 4);
    Group g(3, 2, 4096, 30.0, algo);
    for (int r = 1; r < 3; ++r) g.rings[r]->run(g.call(4096, buf), g.ranks[r].stream);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const auto t0 = Clock::now();
    emu_fail_launches(1, cudaErrorLaunchOutOfResources);
    std::string thrown;
    try {
      RR_CUDA_CHECK(cudaSetDevice(g.ranks[0].device));
      g.rings[0]->run(g.call(4096, buf), g.ranks[0].stream);
    } catch (const std::exception& e) {
      thrown = e.what();
    }
    emu_fail_launches(0, cudaSuccess);
    sync_all(g);
    const char* name = rc::p2p::algo_name(algo);
    EXPECT(contains(thrown, "cudaErrorLaunchOutOfResources"), "%s: rank 0 threw '%s'", name, thrown.c_str());
    EXPECT(seconds_since(t0) < 5, "%s: the peers stopped after %.1f s (timeout 30 s)", name, seconds_since(t0));
    EXPECT(contains(g.rings[0]->failure(), "could not enqueue call #1"), "%s rank 0: '%s'", name,
           g.rings[0]->failure().c_str());
    for (int r = 1; r < 3; ++r)
      EXPECT(contains(g.rings[r]->failure(), "stopped because rank 0 was aborted"), "%s rank %d: '%s'",
             name, r, g.rings[r]->failure().c_str());
    std::printf("launch failure (%s): rank 1 says: %s\n", name, g.rings[1]->failure().c_str());
  }
}

#endif

// Rank 0 aborts while the ring waits on a silent rank 2: rank 0 and rank 1 stop at once.
static void test_abort() {
  DevBuf buf(4096 * 4);
  Group g(3, 2, 4096, 30.0);
  for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(4096, buf), g.ranks[r].stream);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto t0 = Clock::now();
  g.rings[0]->abort("test abort");
  sync_all(g);
  EXPECT(seconds_since(t0) < 5, "abort took %.1f s (timeout 30 s)", seconds_since(t0));
  EXPECT(contains(g.rings[0]->failure(), "test abort"), "rank 0: '%s'", g.rings[0]->failure().c_str());
  const std::string f1 = g.rings[1]->failure();
  EXPECT(contains(f1, "stopped because rank 0 was aborted"), "rank 1: '%s'", f1.c_str());
  EXPECT(g.rings[1]->failed_seq() == 1, "rank 1: first failed call %llu", (unsigned long long)g.rings[1]->failed_seq());
  // A call enqueued after the abort is failed too, though its kernel never ran a step.
  const uint64_t before = g.rings[0]->op_seq();
  EXPECT(g.rings[0]->failed_seq() <= before + 1, "rank 0: first failed %llu after %llu calls",
         (unsigned long long)g.rings[0]->failed_seq(), (unsigned long long)before);
}

// An abort with nothing running spoils the next call, not the ones already finished.
static void test_abort_between_calls() {
  DevBuf buf(64 * 4);
  Group g(2, 2, 4096, 10.0);
  for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(64, buf), g.ranks[r].stream);
  sync_all(g);
  g.rings[1]->abort("between calls");
  EXPECT(g.rings[1]->failed_seq() == 2, "first failed %llu, want 2", (unsigned long long)g.rings[1]->failed_seq());
  EXPECT(run_throws(g.ranks[1], 1, buf, "between calls"), "an aborted ring accepted a call");
  g.rings[0]->run(g.call(64, buf), g.ranks[0].stream);  // its neighbour is gone: it stops
  sync_all(g);
  EXPECT(contains(g.rings[0]->failure(), "stopped because rank 1 was aborted"), "rank 0: '%s'",
         g.rings[0]->failure().c_str());
  EXPECT(g.rings[0]->failed_seq() == 2, "rank 0: first failed %llu", (unsigned long long)g.rings[0]->failed_seq());
}

// A CUDA graph replays a launch with the arguments it was captured with. Here every rank runs an
// in-place all_reduce, then launches exactly the same kernel arguments twice more (a replay), then
// runs again: four all_reduces in step (values x, S, nS, n^2 S, n^3 S), because the kernel takes
// where the FIFOs stand from the ring's counters, not from its arguments.
// registered: the tensors in a registered buffer (the registered kernel replayed).
static void replayed_launches_stay_in_step(rc::p2p::Algo algo, bool registered = false) {
  const int n = 3;
  const int64_t numel = 5000;
  std::vector<std::unique_ptr<DevBuf>> bufs;
  std::vector<std::vector<char>> hs(n);
  Group g(n, 2, 256, 10.0, algo, false, 256);  // several rounds/slices per call
  const std::vector<char*> at = registered ? register_all(g, numel * 4) : std::vector<char*>();
  if (registered)
    EXPECT(g.rings[0]->plan_of(g.call(numel, DevBuf(at[0], 0))).algo == rc::p2p::Algo::Registered,
           "the replayed tensors are not planned as registered");
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
    bufs.push_back(registered ? std::make_unique<DevBuf>(at[r], 0) : std::make_unique<DevBuf>(numel * 4));
    const std::vector<float> h(numel, static_cast<float>(r + 1));
    hs[r].assign(reinterpret_cast<const char*>(h.data()), reinterpret_cast<const char*>(h.data() + numel));
    fill_on(g.ranks[r].stream, bufs[r]->p, hs[r]);  // ordered before the call (cuda_check.h)
  }
  const float S = n * (n + 1) / 2.0f;
  for (int round = 0; round < 2; ++round) {
    for (int r = 0; r < n; ++r) g.rings[r]->run(g.call(numel, *bufs[r]), g.ranks[r].stream);
    if (round == 0)
      for (int replay = 0; replay < 2; ++replay)
        for (int r = 0; r < n; ++r) g.rings[r]->launch_again(g.call(numel, *bufs[r]), g.ranks[r].stream);
  }
  sync_all(g);
  const float want = S * n * n * n;
  for (int r = 0; r < n; ++r) {
    EXPECT(g.rings[r]->failure().empty(), "rank %d: %s", r, g.rings[r]->failure().c_str());
    std::vector<float> h(numel);
    RR_CUDA_CHECK(cudaMemcpy(h.data(), bufs[r]->p, numel * 4, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (float v : h) bad += v != want;
    EXPECT(bad == 0, "%s rank %d: %d of %lld elements are not %g after replays (e.g. %g)", rc::p2p::algo_name(algo), r, bad,
           (long long)numel, want, h[0]);
  }
}

static void test_replayed_launches_stay_in_step() {
  for (rc::p2p::Algo algo : kAlgos) replayed_launches_stay_in_step(algo);
  replayed_launches_stay_in_step(rc::p2p::Algo::Auto, true);
  // Deterministic mode: the forced ring runs the direct algorithms, replays included.
  DeterministicScope det;
  replayed_launches_stay_in_step(rc::p2p::Algo::Ring);
}

#ifdef RINGREDUCE_EMU
// Rank 0 closes without knowing that its neighbours are done with its memory (the close barrier
// failed). Rank 1 reads rank 0's area after that: it must find the abort word and stop cleanly,
// not read whatever the memory holds once freed (the emulator overwrites freed memory that is still
// mapped elsewhere, as a reuse would).
static void test_close_keeps_memory_neighbours_read() {
  DevBuf buf(4096 * 4);
  Group g(3, 2, 4096, 10.0);
  const size_t kept = rc::p2p::Endpoint::kept_bytes();
  g.rings[0]->close(/*peers_done=*/false);
  EXPECT(rc::p2p::Endpoint::kept_bytes() > kept, "close(peers_done=false) freed the area");
  g.rings[1]->run(g.call(4096, buf), g.ranks[1].stream);
  cudaStreamSynchronize(g.ranks[1].stream);
  const std::string f = g.rings[1]->failure();
  EXPECT(contains(f, "stopped because rank 0 was aborted"), "rank 1: '%s'", f.c_str());
}

#endif

// A CUDA graph that captured launches of a ring pins it (Endpoint::graph_pin): close() keeps what the
// kernels touch, and a replay after close stops at its start and writes nothing into the peers (they
// may have freed their memory; the emulator faults on freed memory). Rank 0 alone replays.
static void test_replay_after_close_of_a_pinned_ring() {
  const int n = 3;
  const int64_t numel = 4096;
  Group g(n, 2, 4096, 10.0);
  std::vector<std::unique_ptr<DevBuf>> bufs;
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
    bufs.push_back(std::make_unique<DevBuf>(numel * 4));
    fill_on(g.ranks[r].stream, bufs[r]->p, std::vector<char>(numel * 4, 0));
  }
  for (int r = 0; r < n; ++r) g.rings[r]->run(g.call(numel, *bufs[r]), g.ranks[r].stream);
  sync_all(g);
  std::vector<rc::p2p::SymArgs> args;
  std::vector<void*> pins;
  for (int r = 0; r < n; ++r) {
    const rr::Call c = g.call(numel, *bufs[r]);
    args.push_back(g.rings[r]->sym_args(c, g.rings[r]->plan_of(c)));
    args.back().graph = 1;  // as Endpoint::run launches into a capture
    pins.push_back(g.rings[r]->graph_pin());
  }
  const size_t kept = rc::p2p::Endpoint::kept_bytes();
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
    g.rings[r]->close(/*peers_done=*/true);
  }
  EXPECT(rc::p2p::Endpoint::kept_bytes() > kept, "close() freed a pinned ring's memory");
  // The peers' areas (kept here: they are pinned too), byte for byte: no header, flag or abort word.
  auto area_of = [&](int q) {
    std::vector<char> b(sizeof(rc::p2p::Area));
    RR_CUDA_CHECK(cudaMemcpy(b.data(), args[q].self, b.size(), cudaMemcpyDeviceToHost));
    return b;
  };
  std::vector<std::vector<char>> before;
  for (int q = 0; q < n; ++q) before.push_back(area_of(q));
  RR_CUDA_CHECK(cudaSetDevice(device_of(0)));
  const auto t0 = Clock::now();
  // The replay: the captured copy of the host's abort word (Endpoint::copy_host_abort), the kernel.
  RR_CUDA_CHECK(cudaMemcpyAsync(&args[0].self->host_abort, &args[0].ctl->abort, sizeof(uint32_t),
                                cudaMemcpyHostToDevice, g.ranks[0].stream));
  rc::p2p::launch_sym(args[0], g.ranks[0].stream);
  RR_CUDA_CHECK(cudaStreamSynchronize(g.ranks[0].stream));
  EXPECT(seconds_since(t0) < 5.0, "the replay after close waited %.1f s (timeout 10 s)", seconds_since(t0));
  for (int q = 1; q < n; ++q)
    EXPECT(area_of(q) == before[q], "the replay after close wrote into rank %d's area (abort word, "
           "header or flag)", q);
  // It stopped at its start: this rank's record says so (phase -1: before the call began).
  const rc::p2p::ErrorRecord* e = args[0].ctl->err;
  EXPECT(e[0].word != 0 && e[0].phase == -1, "the replay did not stop at its start (record word %#x, phase %d)",
         e[0].word, e[0].phase);
  for (void* pin : pins) rc::p2p::Endpoint::release_graph_pin(pin);
  EXPECT(g.rings[0]->graph_pins() == 0, "pins left: %d", g.rings[0]->graph_pins());
}

int main(int argc, char** argv) {
  return p2p_main("test_p2p_close", [&] {
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_no_cuda_call_after_stop_threads", [&] { test_no_cuda_call_after_stop_threads(); });
    run_test(argc, argv, "test_close_frees_nothing_mapped", [&] { test_close_frees_nothing_mapped(); });
#endif
    run_test(argc, argv, "test_failed_call_survives_close", [&] { test_failed_call_survives_close(); });
    run_test(argc, argv, "test_abort", [&] { test_abort(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_launch_failure_aborts_the_group", [&] { test_launch_failure_aborts_the_group(); });
#endif
    run_test(argc, argv, "test_abort_between_calls", [&] { test_abort_between_calls(); });
    run_test(argc, argv, "test_replayed_launches_stay_in_step", [&] { test_replayed_launches_stay_in_step(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_close_keeps_memory_neighbours_read", [&] { test_close_keeps_memory_neighbours_read(); });
#endif
    run_test(argc, argv, "test_replay_after_close_of_a_pinned_ring", [&] { test_replay_after_close_of_a_pinned_ring(); });
  });
}
