// Native test of the p2p transport's ring and its plan: 2-4 ranks, every collective, in place and
// not, zero-size and numel < N, tiny slices and the defaults; ranks and communicators sharing a
// device; failures and their messages (a silent rank, mismatched calls, a dead peer; the survivors'
// fresh ring after it), the call log;
// the transport choice (can_map), the options' checks, the tuned thresholds and the README's table.
// Built against the emulated device in every CI run (test_p2p_ring_emu; ranks are threads, areas
// are shared through the emulated IPC) and by nvcc where a toolkit is found (test_p2p_ring; on a
// GPU, ranks are streams of one process). Exits 0 with a message when there is no CUDA device.
// `test_p2p_ring_emu NAME...` runs the tests whose names contain a NAME (weak_* only so); without
// names, all but weak_*.
#include "p2p_check.h"

static void test_ring() {
  int cases = 0;
  const auto t0 = Clock::now();
  using rc::p2p::Algo;
  for (int n = 2; n <= 4; ++n) {
    // Each algorithm forced, with tiny slices/pieces (64 B: many pipeline steps, or pieces and so
    // barriers and reused workspace halves, per call) and 3 blocks; then the defaults, where the
    // plan picks algorithm, blocks and pieces by size (several algorithms on one communicator, call
    // after call).
    struct Config { Algo algo; bool exact; size_t slice, chunk; int channels; int shift; };
    const Config configs[] = {
        {Algo::Ring, true, 64, 64, 3, 0},    {Algo::OneShot, true, 64, 64, 3, 0},
        {Algo::TwoShot, true, 64, 64, 3, 1}, {Algo::TwoShot, true, 64, 4096, 3, 0},
        {Algo::Auto, false, rc::p2p::kDefaultSliceBytes, rc::p2p::kDefaultChunkBytes,
         rc::p2p::kDefaultChannels, 0}};
    for (const Config& c : configs) {
      Group g(n, c.channels, c.slice, 20.0, c.algo, c.exact, c.chunk);
      char what[112];
      std::snprintf(what, sizeof what, "p2p n=%d %s slice=%zu chunk=%zu shift=%d", n,
                    rc::p2p::algo_name(c.algo), c.slice, c.chunk, c.shift);
      // The largest size is for the plan's choices at the defaults; with 64-byte slices and slots
      // 16411 elements already makes about a thousand steps or rounds per call (the 196613 there
      // took 94 of the sweep's 108 s, and no mutation needed it).
      const int64_t largest = c.algo == Algo::Auto ? 3 * 65536 + 5 : 16411;
      cases += sweep(g.ranks, {0, 1, n - 1, n + 1, 1000 * n + 7, largest}, what, c.shift);
      if (g_failures) return;  // the sweep stopped at its first failure: so does the test
    }
  }
  std::printf("p2p ring: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

// Ranks sharing one device: every block of every rank's kernel must be resident at once (they spin
// on each other), so a call uses at most SMs / ranks blocks (Options::max_blocks, which the torch
// binding computes). The emulator runs at most EMU_CUDA_SMS blocks per device at once, as a GPU
// does; 16 channels or direct blocks per rank would leave some waiting for blocks that never end.
static void test_ranks_share_a_device() {
  using rc::p2p::Algo;
  int cases = 0;
  const auto t0 = Clock::now();
  for (int n = 2; n <= 3; ++n) {
    const int max_blocks = std::max(1, rc::sm_count() / n);
    struct Config { Algo algo; bool exact; size_t slice; };
    const Config configs[] = {{Algo::Ring, true, 256}, {Algo::OneShot, true, 256},
                              {Algo::TwoShot, true, 256},
                              {Algo::Auto, false, rc::p2p::kDefaultSliceBytes}};
    for (const Config& c : configs) {
      Group g(n, rc::p2p::kMaxChannels, c.slice, 5.0, c.algo, c.exact, c.exact ? 256 : rc::p2p::kDefaultChunkBytes,
              false, max_blocks, true);
      char what[96];
      std::snprintf(what, sizeof what, "%d ranks on one device, %s, at most %d blocks", n,
                    rc::p2p::algo_name(c.algo), max_blocks);
      cases += sweep(g.ranks, {1, 1000 * n + 7, c.exact ? 16411 : 3 * 65536 + 5}, what, 0);
      if (g_failures) return;
      DevBuf any(16);  // plan() reads no memory
      const int planned = g.rings[0]->plan_of(g.call(1 << 24, any)).blocks;
      EXPECT(planned == max_blocks, "%s: a plan of %d blocks", what, planned);
    }
  }
  std::printf("ranks sharing a device: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

// Two communicators per rank on one shared device, their calls in flight at once (a DDP hook's
// bucket beside another group's call): the torch binding gives each the SMs over the ranks and the
// live communicators of the device (ringreduce/_cuda/policy.py: usable_sms, resident_blocks), so every
// block of all four kernels is resident together. The emulator holds EMU_CUDA_SMS blocks at once;
// with more per kernel some would wait for blocks that never end (the mutation
// plan_ignores_resident_blocks).
static void test_two_communicators_share_a_device() {
  const int n = 2, comms = 2;
  const int max_blocks = std::max(1, rc::sm_count() / (n * comms));
  const int64_t numel = 3 * 65536 + 5;
  std::vector<std::unique_ptr<Group>> groups;
  for (int k = 0; k < comms; ++k)
    groups.push_back(std::make_unique<Group>(n, rc::p2p::kMaxChannels, rc::p2p::kDefaultSliceBytes, 5.0,
                                             rc::p2p::Algo::TwoShot, false, 64 << 10, false, max_blocks, true));
  DevBuf any(16);
  const int planned = groups[0]->rings[0]->plan_of(groups[0]->call(numel, any)).blocks;
  EXPECT(planned == std::min(max_blocks, rc::p2p::kDefaultSymBlocks), "a plan of %d blocks, cap %d", planned, max_blocks);
  std::vector<std::unique_ptr<DevBuf>> bufs;
  std::vector<std::vector<char>> hosts;  // the copies read them later (stream order): kept until the sync
  for (int round = 0; round < 3; ++round) {
    bufs.clear();
    hosts.clear();
    for (int k = 0; k < comms; ++k)
      for (int r = 0; r < n; ++r) {
        bufs.push_back(std::make_unique<DevBuf>(numel * 4));
        const std::vector<float> h(numel, static_cast<float>(k * 10 + r + 1));
        hosts.emplace_back(reinterpret_cast<const char*>(h.data()), reinterpret_cast<const char*>(h.data() + numel));
        fill_on(groups[k]->ranks[r].stream, bufs.back()->p, hosts.back());
      }
    for (int r = 0; r < n; ++r)  // interleaved: rank r of both communicators, then the next rank
      for (int k = 0; k < comms; ++k)
        groups[k]->rings[r]->run(groups[k]->call(numel, *bufs[k * n + r]), groups[k]->ranks[r].stream);
    for (int k = 0; k < comms; ++k)
      for (int r = 0; r < n; ++r) RR_CUDA_CHECK(cudaStreamSynchronize(groups[k]->ranks[r].stream));
    for (int k = 0; k < comms; ++k)
      for (int r = 0; r < n; ++r) {
        EXPECT(groups[k]->rings[r]->failure().empty(), "communicator %d rank %d: %s", k, r,
               groups[k]->rings[r]->failure().c_str());
        std::vector<float> h(numel);
        RR_CUDA_CHECK(cudaMemcpy(h.data(), bufs[k * n + r]->p, numel * 4, cudaMemcpyDeviceToHost));
        const float want = static_cast<float>(2 * k * 10 + 3);
        int bad = 0;
        for (float v : h) bad += v != want;
        EXPECT(bad == 0, "communicator %d rank %d round %d: %d elements are not %g (e.g. %g)", k, r, round, bad, want, h[0]);
      }
    if (g_failures) return;
  }
  std::printf("two communicators on one device: %d blocks each\n", planned);
}

#ifdef RINGREDUCE_EMU
// The README's table of what runs where states the CUDA plan's numbers: checked against the code
// (issue 50, item 5), so that a change of a default fails here until the README says it too.
static std::string size_text(size_t b) {
  char buf[32];
  if (b >= (1u << 20)) std::snprintf(buf, sizeof buf, "%zu MiB", (b + (1u << 19)) >> 20);  // to the MiB
  else std::snprintf(buf, sizeof buf, "%zu KiB", b >> 10);
  return buf;
}

static void test_readme_table() {
  // The full "what runs where" table (the README's short one links to it).
  std::ifstream f(std::string(RR_SOURCE_DIR) + "/docs/usage.md");
  EXPECT(f.good(), "cannot read %s/docs/usage.md", RR_SOURCE_DIR);
  std::string line, direct, ring, nccl;
  while (std::getline(f, line)) {
    if (line.rfind("| CUDA, every rank maps every other", 0) == 0) direct = line;
    if (line.rfind("| CUDA, not every rank maps every other", 0) == 0) ring = line;
    if (line.rfind("| CUDA across hosts", 0) == 0) nccl = line;
  }
  auto area = [](bool direct_on) {
    rc::p2p::Options o;
    o.rank = 0;
    o.nranks = 2;
    o.direct = direct_on;
    RR_CUDA_CHECK(cudaSetDevice(0));
    return rc::p2p::Endpoint(o).area_bytes();
  };
  const std::vector<std::string> want_direct = {
      "the LL one-shot (flag-carrying words, no barrier) up to " + size_text(rc::p2p::ll_max_bytes(2)) +
          " at world 2 (" + size_text(rc::p2p::ll_max_bytes(4)) + " at 4, " + size_text(rc::p2p::ll_max_bytes(8)) +
          " at 8)",
      "one-shot up to " + size_text(rc::p2p::oneshot_max_bytes(2)) + " at world 2 (" +
          size_text(rc::p2p::oneshot_max_bytes(4)) + " at 4, " + size_text(rc::p2p::oneshot_max_bytes(8)) + " at 8)",
      "(" + size_text(area(true)) + " per rank",
      "one barrier per " + size_text(rc::p2p::kDefaultChunkBytes) + " piece"};
  for (const std::string& w : want_direct)
    EXPECT(contains(direct, w), "docs/usage.md's p2p row lacks '%s': %s", w.c_str(), direct.c_str());
  const std::string want_ring = "(its FIFO: " + size_text(area(false)) + " per rank)";
  EXPECT(contains(ring, want_ring), "docs/usage.md's ring row lacks '%s': %s", want_ring.c_str(), ring.c_str());
  const std::string want_nccl = "two-shot (up to " + size_text(rc::nccl::kTwoShotMaxBytes) + ")";
  EXPECT(contains(nccl, want_nccl), "docs/usage.md's nccl row lacks '%s': %s", want_nccl.c_str(), nccl.c_str());
}

#endif

// Rank n-1 never calls: the others stop within the timeout, saying why; the ring stays broken.
// On each algorithm.
static void test_timeout() {
  for (rc::p2p::Algo algo : kAlgos) {
    DevBuf buf(4096 * 4);
    Group g(3, 2, 4096, 1.0, algo);
    const auto t0 = Clock::now();
    for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(4096, buf), g.ranks[r].stream);
    sync_all(g);
    EXPECT(seconds_since(t0) < 5, "%s: the silent rank was noticed after %.1f s (timeout 1 s)",
           rc::p2p::algo_name(algo), seconds_since(t0));
    bool timed_out = false;
    for (int r = 0; r < 2; ++r) {
      const std::string f = g.rings[r]->failure();
      timed_out |= contains(f, "timed out after 1 s waiting for");
      EXPECT(contains(f, "timed out") || contains(f, "stopped because"), "rank %d: failure is '%s'", r, f.c_str());
      EXPECT(g.rings[r]->failed_seq() == 1, "rank %d: first failed call %llu, want 1", r,
             (unsigned long long)g.rings[r]->failed_seq());
      EXPECT(run_throws(g.ranks[r], r, buf, "broken by an earlier failure"), "rank %d: a broken ring accepted a call", r);
    }
    EXPECT(timed_out, "%s: no rank reported the timeout itself", rc::p2p::algo_name(algo));
    std::printf("timeout (%s): rank 0 says: %s\n", rc::p2p::algo_name(algo), g.rings[0]->failure().c_str());
  }
}

// A timeout in a call of kMaxSymBlocks two-shot blocks (8 run at once on the emulated device):
// every block records its stop in the host-mapped error records, the last ones included (the
// emulator's host allocations end at an inaccessible page, so a record past the end faults).
static void test_timeout_with_every_block() {
  const int64_t numel = 1 << 20;
  DevBuf buf(numel * 4);
  Group g(3, 2, 4096, 1.0, rc::p2p::Algo::TwoShot, false, rc::p2p::kDefaultChunkBytes, false,
          rc::p2p::kMaxSymBlocks, false, rc::p2p::kDefaultCopySlotBytes,
          [](int, rc::p2p::Options& o) { o.sym_blocks = rc::p2p::kMaxSymBlocks; });
  EXPECT(g.rings[0]->plan_of(g.call(numel, buf)).blocks == rc::p2p::kMaxSymBlocks,
         "a 4 MiB two-shot call runs %d blocks", g.rings[0]->plan_of(g.call(numel, buf)).blocks);
  const auto t0 = Clock::now();
  for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(numel, buf), g.ranks[r].stream);
  sync_all(g);
  EXPECT(seconds_since(t0) < 10, "the silent rank was noticed after %.1f s (timeout 1 s)", seconds_since(t0));
  for (int r = 0; r < 2; ++r) {
    const std::string f = g.rings[r]->failure();
    EXPECT(contains(f, "timed out") || contains(f, "stopped because"), "rank %d: failure is '%s'", r, f.c_str());
    EXPECT(g.rings[r]->failed_seq() == 1, "rank %d: first failed call %llu, want 1", r,
           (unsigned long long)g.rings[r]->failed_seq());
  }
  std::printf("timeout with %d blocks: rank 0 says: %s\n", rc::p2p::kMaxSymBlocks, g.rings[0]->failure().c_str());
}

// Calls of kMaxSymBlocks blocks (RINGREDUCE_CUDA_SYM_BLOCKS=64, as a measured table entry may set):
// every collective's result, on every workspace algorithm, 8 blocks of each rank at a time.
static void test_calls_of_the_most_blocks() {
  const int64_t numel = int64_t{1} << 20;  // 4 MiB of f32: 128 parts of 32 KiB
  for (rc::p2p::Algo algo : {rc::p2p::Algo::OneShot, rc::p2p::Algo::TwoShot}) {
    Group g(2, 2, 4096, 20.0, algo, false, rc::p2p::kDefaultChunkBytes, false, rc::p2p::kMaxSymBlocks, false,
            rc::p2p::kDefaultCopySlotBytes, [](int, rc::p2p::Options& o) { o.sym_blocks = rc::p2p::kMaxSymBlocks; });
    DevBuf any(16);
    EXPECT(g.rings[0]->plan_of(g.call(numel, any)).blocks == rc::p2p::kMaxSymBlocks, "%s: %d blocks",
           rc::p2p::algo_name(algo), g.rings[0]->plan_of(g.call(numel, any)).blocks);
    for (rr::Coll coll : {rr::Coll::AllReduce, rr::Coll::ReduceScatter, rr::Coll::AllGather})
      check_collective(g.ranks, coll, rr::DType::F32, rr::RedOp::Sum, numel, coll == rr::Coll::AllReduce,
                       "the most blocks");
  }
}

// Rank 1 calls with another numel: every rank fails, one names both calls; the good call before
// the mismatch is not counted as failed. On each algorithm.
static void test_mismatch() {
  for (rc::p2p::Algo algo : kAlgos) {
    DevBuf buf(2000 * 4);
    Group g(3, 2, 4096, 10.0, algo);
    for (int r = 0; r < 3; ++r) g.rings[r]->run(g.call(1000, buf), g.ranks[r].stream);
    sync_all(g);
    for (int r = 0; r < 3; ++r) g.rings[r]->run(g.call(r == 1 ? 1001 : 1000, buf), g.ranks[r].stream);
    sync_all(g);
    bool named = false;
    for (int r = 0; r < 3; ++r) {
      const std::string f = g.rings[r]->failure();
      EXPECT(!f.empty(), "rank %d did not fail", r);
      named |= contains(f, "mismatched collective calls") && contains(f, "numel=1001") && contains(f, "numel=1000");
      EXPECT(g.rings[r]->failed_seq() == 2, "rank %d: first failed call %llu, want 2", r,
             (unsigned long long)g.rings[r]->failed_seq());
    }
    EXPECT(named, "%s: no rank named the mismatched calls", rc::p2p::algo_name(algo));
    std::printf("mismatch (%s): rank 1 says: %s\n", rc::p2p::algo_name(algo), g.rings[1]->failure().c_str());
  }
}

// The flight recorder's view of the device: a call enqueued on ranks 0 and 1 is pending while
// rank 2 has not called, done (with a time between enqueue and now) once it has; a dump resolves
// the host's "started" record through the device; a call out of the window is done by stream
// order; a timed-out call is failed through failed_seq.
static void test_call_log() {
  namespace runtime = rr::runtime;
  DevBuf buf(256 * 4);
  Group g(3, 2, 4096, 2.0);
  runtime::Recorder rec(8);
  rc::p2p::Endpoint& ring = *g.rings[0];
  ring.calls().enable(true);  // as attaching an enabled recorder does
  rec.set_device_probe([&ring](uint64_t dev_seq, int64_t* done, std::string* error) {
    const uint64_t failed = ring.failed_seq();
    if (failed && dev_seq >= failed) {
      *error = ring.failure();
      return 3;
    }
    return static_cast<int>(ring.calls().state(dev_seq, done));
  });
  const int64_t t0 = runtime::now_ns();
  const uint64_t seq = rec.begin("all_reduce", "float32", "SUM", "p2p", 256, 1024, runtime::Source::Api, t0, t0);
  for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(256, buf), g.ranks[r].stream);
  rec.set_dev_seq(seq, ring.op_seq());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  int64_t done = -1;
  EXPECT(ring.calls().state(1, &done) == rc::CallLog::State::Pending, "call 1 is not pending");
  EXPECT(ring.calls().state(2, &done) == rc::CallLog::State::Unknown, "call 2 was never made");
  std::string j = rec.json();
  EXPECT(contains(j, "\"state\": \"started\"") && contains(j, "\"device\": \"pending\""), "dump: %s", j.c_str());
  g.rings[2]->run(g.call(256, buf), g.ranks[2].stream);
  sync_all(g);
  const int64_t t1 = runtime::now_ns();
  EXPECT(ring.calls().state(1, &done) == rc::CallLog::State::Done, "call 1 is not done");
  EXPECT(done >= t0 && done <= t1 + 1000000, "done at %lld, outside [%lld, %lld]", (long long)done,
         (long long)t0, (long long)t1);
  j = rec.json();
  EXPECT(contains(j, "\"state\": \"finished\"") && contains(j, "\"device\": \"done\""), "dump: %s", j.c_str());
  // More calls than the window: the oldest are known done by stream order, their time forgotten.
  for (int k = 0; k < rc::CallLog::kWindow + 3; ++k) {
    for (int r = 0; r < 3; ++r) g.rings[r]->run(g.call(16, buf), g.ranks[r].stream);
  }
  sync_all(g);
  EXPECT(ring.calls().state(2, &done) == rc::CallLog::State::Done && done == 0, "call 2: done %lld",
         (long long)done);
  EXPECT(ring.calls().state(ring.op_seq(), &done) == rc::CallLog::State::Done && done > 0, "last call");
  // Rank 2 does not come: the call times out, and the dump says failed, with the device's reason.
  const uint64_t seq2 = rec.begin("all_reduce", "float32", "SUM", "p2p", 256, 1024, runtime::Source::Api,
                                  runtime::now_ns(), runtime::now_ns());
  for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(256, buf), g.ranks[r].stream);
  rec.set_dev_seq(seq2, ring.op_seq());
  sync_all(g);
  j = rec.json();
  EXPECT(contains(j, "\"state\": \"failed\"") && contains(j, "\"device\": \"failed\"") &&
         contains(j, "timed out"), "dump: %s", j.c_str());
  rec.set_device_probe(nullptr);
}

// A process that only waits to be killed: a rank's process for watch_peers.
static pid_t fake_rank_process() {
  const pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  return child;
}

// The process of rank 2 dies (SIGKILL) while ranks 0 and 1 wait for it: both stop within about a
// second, naming it, instead of waiting out their 30 s timeout.
static void test_dead_peer() {
  const pid_t child = fake_rank_process();  // plays rank 2's process
  DevBuf buf(4096 * 4);
  Group g(3, 2, 4096, 30.0);
  for (int r = 0; r < 2; ++r) g.rings[r]->watch_peers({{2, child}});
  for (int r = 0; r < 2; ++r) g.rings[r]->run(g.call(4096, buf), g.ranks[r].stream);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto t0 = Clock::now();
  kill(child, SIGKILL);  // a zombie until reaped: dead all the same
  sync_all(g);
  const double took = seconds_since(t0);
  waitpid(child, nullptr, 0);
  EXPECT(took < 3, "the dead peer was noticed after %.1f s", took);
  for (int r = 0; r < 2; ++r) {
    const std::string f = g.rings[r]->failure();
    EXPECT(contains(f, "peer rank 2 (pid " + std::to_string(child) + ") died") ||
               contains(f, "stopped because"),
           "rank %d: '%s'", r, f.c_str());
  }
  std::printf("dead peer: noticed in %.2f s; rank 0 says: %s\n", took, g.rings[0]->failure().c_str());
}

// dist.shrink_group on p2p (ringreduce/_shrink.py): rank 2 dies, and the survivors build a fresh
// ring of their own beside the broken one, which still holds its memory (the binding keeps a
// broken ring's until exit); the new ring's results are exact, call after call.
static void test_survivors_after_dead_peer() {
  const pid_t child = fake_rank_process();  // plays rank 2's process
  DevBuf buf(4096 * 4);
  auto broken = std::make_unique<Group>(3, 2, 4096, 30.0);
  for (int r = 0; r < 2; ++r) broken->rings[r]->watch_peers({{2, child}});
  for (int r = 0; r < 2; ++r) broken->rings[r]->run(broken->call(4096, buf), broken->ranks[r].stream);
  kill(child, SIGKILL);
  sync_all(*broken);
  waitpid(child, nullptr, 0);
  for (int r = 0; r < 2; ++r) EXPECT(!broken->rings[r]->failure().empty(), "rank %d not broken", r);
  Group survivors(2, 2, 4096, 30.0);
  const int cases = sweep(survivors.ranks, {1, 3, 4099, 3 * 65536 + 5}, "p2p survivors", 0);
  for (int r = 0; r < 2; ++r)
    EXPECT(survivors.rings[r]->failure().empty(), "survivor %d: %s", r, survivors.rings[r]->failure().c_str());
  broken.reset();  // the parent goes after the new ring ran: torch destroys it after the shrink
  std::printf("survivors after a dead peer: %d cases on a fresh ring of 2\n", cases);
}

// The transport choice: p2p only where every device can map its neighbours' memory.
static void test_can_map() {
  std::string why;
  RR_CUDA_CHECK(cudaSetDevice(0));
  EXPECT(rc::p2p::can_map(rc::p2p::device_bus_id(), &why), "a device cannot map its own memory: %s", why.c_str());
  EXPECT(!rc::p2p::can_map("0000:ff:00.0", &why) && contains(why, "not visible"), "unknown device: %s", why.c_str());
#ifdef RINGREDUCE_EMU
  emu_set_peer_access(0, 1, 0);
  RR_CUDA_CHECK(cudaSetDevice(1));
  const std::string bus1 = rc::p2p::device_bus_id();
  RR_CUDA_CHECK(cudaSetDevice(0));
  EXPECT(!rc::p2p::can_map(bus1, &why) && contains(why, "no peer access"), "no peers: '%s'", why.c_str());
  // The ring itself refuses, naming the other transport.
  bool refused = false;
  try {
    Group g(2, 1, 4096, 5.0);
  } catch (const rr::RingError& e) {
    refused = contains(e.what(), "RINGREDUCE_TRANSPORT=nccl");
  }
  EXPECT(refused, "a ring across devices without peer access was connected");
  emu_set_peer_access(0, 1, 1);
  EXPECT(rc::p2p::can_map(bus1, &why), "peers: '%s'", why.c_str());
#endif
}

// The plan in deterministic mode: one-shot or two-shot for every all_reduce and reduce_scatter,
// whatever the size and forced algorithm; all_gather as by default; a RingError naming the nccl
// transport where the direct algorithms are impossible (not every pair mappable, > kMaxPeers ranks).
// Options the kernels depend on are checked when the ring is built, naming the value given.
static void test_options_checked() {
  for (size_t chunk : {size_t{0}, size_t{24}}) {
    rc::p2p::Options o;
    o.nranks = 2;
    o.chunk_bytes = chunk;
    std::string what;
    try {
      rc::p2p::Endpoint ring(o);
    } catch (const std::invalid_argument& e) {
      what = e.what();
    }
    const std::string want = "chunk_bytes must be a positive multiple of 16, got " + std::to_string(chunk);
    EXPECT(contains(what, want), "chunk_bytes=%zu: error '%s', want '%s'", chunk, what.c_str(), want.c_str());
  }
}

// Auto's one-shot threshold from a measured table (Options.tuned, set by Endpoint::set_threshold from
// ringreduce/gpu_tuning.json): used as given, 0 meaning never; the model's without it. Above it
// two-shot, at every size: auto never picks the ring where every rank maps every other.
static void test_tuned_thresholds() {
  using rc::p2p::Algo;
  rc::p2p::Options o;
  o.nranks = 2;
  auto algo_of = [&](int64_t bytes) {
    return rc::p2p::plan({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, bytes / 4, nullptr,
                          nullptr}, o, true).algo;
  };
  // The LL one-shot first, up to its reach; then (LL off: Options::ll_max 0) one-shot's threshold.
  const int64_t ll = static_cast<int64_t>(rc::p2p::ll_max_bytes(2));
  EXPECT(algo_of(4096) == Algo::LL && algo_of(ll) == Algo::LL && algo_of(ll + 4) == Algo::OneShot,
         "model, world 2: LL up to %lld B, then one-shot", (long long)ll);
  o.ll_max = 0;
  EXPECT(algo_of(4096) == Algo::OneShot, "model, world 2: one-shot at 4 KiB");
  EXPECT(algo_of(int64_t{1} << 30) == Algo::TwoShot, "model, world 2: two-shot at 1 GiB");
  o.tuned = true;
  o.oneshot_max = 0;
  EXPECT(algo_of(4096) == Algo::TwoShot, "tuned: one-shot never (0)");
  o.oneshot_max = 8192;
  EXPECT(algo_of(8192) == Algo::OneShot && algo_of(8196) == Algo::TwoShot, "tuned one-shot limit");
}

int main(int argc, char** argv) {
  return p2p_main("test_p2p_ring", [&] {
    run_test(argc, argv, "test_ring", [&] { test_ring(); });
    run_test(argc, argv, "test_ranks_share_a_device", [&] { test_ranks_share_a_device(); });
    run_test(argc, argv, "test_two_communicators_share_a_device", [&] { test_two_communicators_share_a_device(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_readme_table", [&] { test_readme_table(); });
#endif
    run_test(argc, argv, "test_timeout", [&] { test_timeout(); });
    run_test(argc, argv, "test_timeout_with_every_block", [&] { test_timeout_with_every_block(); });
    run_test(argc, argv, "test_mismatch", [&] { test_mismatch(); });
    run_test(argc, argv, "test_dead_peer", [&] { test_dead_peer(); });
    run_test(argc, argv, "test_survivors_after_dead_peer", [&] { test_survivors_after_dead_peer(); });
    run_test(argc, argv, "test_call_log", [&] { test_call_log(); });
    run_test(argc, argv, "test_can_map", [&] { test_can_map(); });
    run_test(argc, argv, "test_tuned_thresholds", [&] { test_tuned_thresholds(); });
    run_test(argc, argv, "test_calls_of_the_most_blocks", [&] { test_calls_of_the_most_blocks(); });
    run_test(argc, argv, "test_options_checked", [&] { test_options_checked(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "weak_ring", [&] { weak_sweep(rc::p2p::Algo::Ring); });
#endif
  });
}
