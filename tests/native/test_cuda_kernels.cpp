// Native test of the CUDA kernels and the p2p transport, torch-free. Built against the emulated
// device in every CI run (test_cuda_kernels_emu; ranks are threads, areas are shared through the
// emulated IPC) and by nvcc where a toolkit is found (test_cuda_kernels; on a GPU, ranks are streams
// of one process and areas are used directly, since a process cannot open its own IPC handles).
// (1) launch_reduce against a host reference: every dtype and op, odd sizes, misaligned offsets,
//     and AVG divisors that do not fit the element type;
// (2) the p2p ring: 2-4 ranks, every collective, in place and not, zero-size and numel < N, tiny
//     slices (many pipeline steps) and the defaults, hundreds of calls in a row on one ring;
// (3) failures and their messages: a silent rank (timeout), mismatched calls, a host abort, which
//     call failed first, a peer process that dies, closing while a neighbour may still read;
// (4) the transport choice: which devices can map each other's memory;
// (5) deterministic mode: the rank-order fold kernel for any number of ranks; the p2p transport
//     under every forced algorithm giving the bits of the rank-order reference (never the ring), its
//     plans, replays, and the error where the direct algorithms cannot run;
// (6) the narrow wire (Call::wire): every wire, dtype, op and collective, world 1-4, in pieces and
//     blocks, against the CPU kernels' bits; fp16 overflows learned by every rank; a wire mismatch
//     named; its plans; weak memory.
// Exits 0 with a message when there is no CUDA device.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <set>
#include <thread>

#include "cuda/nccl/endpoint.h"
#include "cuda/p2p/endpoint.h"
#include "cuda_check.h"
#include "held_memory.h"
#include "deterministic_check.h"
#include "wire_check.h"
#include "runtime/recorder.h"
#include "runtime/shm_map.h"
#ifdef RINGREDUCE_EMU
#include "emu.h"
#endif

namespace rc = ringreduce::cuda;
using Clock = std::chrono::steady_clock;

static int device_of(int rank) {
  int count = 1;
  cudaGetDeviceCount(&count);
  return rank % count;
}

// (1) launch_reduce: d = a op b, with element offsets oa/ob/od into 16-byte aligned buffers.
static void test_reduce() {
  const int64_t sizes[] = {0, 1, 2, 7, 15, 16, 17, 255, 4099, 1000003};
  const int offsets[][3] = {{0, 0, 0}, {1, 1, 1}, {3, 3, 3}, {0, 1, 2}, {2, 0, 0}};
  int cases = 0;
  for (rr::DType t : kDtypes) {
    const size_t es = rr::dtype_size(t);
    for (rr::RedOp op : kOps) {
      for (int64_t n : sizes) {
        for (const auto& off : offsets) {
          const int div = op == rr::RedOp::Avg ? 3 : 1;
          const size_t bytes = (n + 8) * es;
          std::vector<char> ha(bytes), hb(bytes), hd(bytes), want(bytes);
          for (int64_t i = 0; i < n; ++i) {
            put(t, &ha[(i + off[0]) * es], value(t, i, 1));
            put(t, &hb[(i + off[1]) * es], value(t, i, 2));
            const double r = ref_op(op, value(t, i, 1), value(t, i, 2));
            put(t, &want[i * es], op == rr::RedOp::Avg ? ref_avg(t, r, div) : r);
          }
          DevBuf a(bytes), b(bytes), d(bytes);
          RR_CUDA_CHECK(cudaMemcpy(a.p, ha.data(), bytes, cudaMemcpyHostToDevice));
          RR_CUDA_CHECK(cudaMemcpy(b.p, hb.data(), bytes, cudaMemcpyHostToDevice));
          RR_CUDA_CHECK(cudaMemset(d.p, 0x5a, bytes));
          rc::nccl::launch_reduce(t, op, d.p + off[2] * es, a.p + off[0] * es, b.p + off[1] * es, n, div,
                            nullptr);
          RR_CUDA_CHECK(cudaDeviceSynchronize());
          RR_CUDA_CHECK(cudaMemcpy(hd.data(), d.p, bytes, cudaMemcpyDeviceToHost));
          for (int64_t i = 0; i < n; ++i)
            EXPECT(std::memcmp(&hd[(i + off[2]) * es], &want[i * es], es) == 0,
                   "reduce %s %s n=%lld off=%d/%d/%d i=%lld: got %g want %g", rr::dtype_name(t),
                   rr::op_name(op), (long long)n, off[0], off[1], off[2], (long long)i,
                   get(t, &hd[(i + off[2]) * es]), get(t, &want[i * es]));
          // Nothing outside the span is written.
          for (int64_t i = 0; i < off[2]; ++i)
            EXPECT(static_cast<unsigned char>(hd[i * es]) == 0x5a, "reduce wrote before its span");
          EXPECT(static_cast<unsigned char>(hd[(n + off[2]) * es]) == 0x5a, "reduce wrote past its span");
          ++cases;
        }
      }
    }
  }
  std::printf("reduce kernel: %d cases\n", cases);
}

// AVG divides by the world size, which need not fit the element type (int8 with 128 or 200 ranks,
// uint8 with 256 or 300): the device must divide in a wide type, as cpu::reduce does.
static void test_avg_wide_divisor() {
  struct Case { rr::DType t; int64_t a, b; int div; int64_t want; };
  const Case cases[] = {{rr::DType::I8, -64, -64, 128, -1}, {rr::DType::I8, -60, -60, 200, 0},
                        {rr::DType::U8, 200, 50, 256, 0},   {rr::DType::U8, 200, 50, 300, 0},
                        {rr::DType::I32, 3000, 3000, 129, 46}, {rr::DType::I64, -5000, -5000, 256, -39}};
  for (const Case& c : cases) {
    const size_t es = rr::dtype_size(c.t);
    const int64_t n = 37;  // vector body and scalar tail
    std::vector<char> ha(n * es), hb(n * es), hd(n * es);
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(&ha[i * es], &c.a, es);  // little-endian: the low bytes hold the value
      std::memcpy(&hb[i * es], &c.b, es);
    }
    DevBuf a(n * es), b(n * es), d(n * es);
    RR_CUDA_CHECK(cudaMemcpy(a.p, ha.data(), n * es, cudaMemcpyHostToDevice));
    RR_CUDA_CHECK(cudaMemcpy(b.p, hb.data(), n * es, cudaMemcpyHostToDevice));
    rc::nccl::launch_reduce(c.t, rr::RedOp::Avg, d.p, a.p, b.p, n, c.div, nullptr);
    RR_CUDA_CHECK(cudaDeviceSynchronize());
    RR_CUDA_CHECK(cudaMemcpy(hd.data(), d.p, n * es, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < n; ++i) {
      const double got = get(c.t, &hd[i * es]);
      EXPECT(got == static_cast<double>(c.want), "%s AVG (%lld + %lld) / %d: got %g want %lld",
             rr::dtype_name(c.t), (long long)c.a, (long long)c.b, c.div, got, (long long)c.want);
    }
  }
}

// (2) a p2p ring of n ranks, rank r on device r % count, with its own stream.
struct Group {
  std::vector<std::unique_ptr<rc::p2p::Endpoint>> rings;
  std::vector<Rank> ranks;
  // neighbours_only: each rank maps only its ring neighbours (as when not every pair of devices
  // can map each other's memory): the direct algorithms are off (emulator only).
  Group(int n, int channels, size_t slice_bytes, double timeout_s,
        rc::p2p::Algo algo = rc::p2p::Algo::Auto, bool exact = false,
        size_t chunk_bytes = rc::p2p::kDefaultChunkBytes, bool neighbours_only = false,
        int max_blocks = 0, bool one_device = false, size_t copy_slot_bytes = rc::p2p::kDefaultCopySlotBytes,
        const std::function<void(int, rc::p2p::Options&)>& tweak = nullptr) {
    auto device_of = [&](int r) { return one_device ? 0 : ::device_of(r); };
    for (int r = 0; r < n; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
      rc::p2p::Options o;
      o.max_blocks = max_blocks;
      o.direct = !neighbours_only;
      o.rank = r;
      o.nranks = n;
      o.channels = channels;
      o.slice_bytes = slice_bytes;
      o.timeout_s = timeout_s;
      o.algo = algo;
      o.exact = exact;
      o.chunk_bytes = chunk_bytes;
      o.copy_slot_bytes = copy_slot_bytes;
      if (tweak) tweak(r, o);
      rings.push_back(std::make_unique<rc::p2p::Endpoint>(o));
      Rank k;
      k.device = device_of(r);
      RR_CUDA_CHECK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
      rc::p2p::Endpoint* ring = rings.back().get();
      k.run = [ring](const rr::Call& c, cudaStream_t s) { ring->run(c, s); };
      k.failure = [ring] { return ring->failure(); };
      ranks.push_back(k);
    }
    std::vector<std::string> handles;
    std::vector<const rc::p2p::Endpoint*> all;
    for (auto& ring : rings) {
      handles.push_back(ring->handle());
      all.push_back(ring.get());
    }
    for (int r = 0; r < n; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
#ifdef RINGREDUCE_EMU
      std::vector<std::string> mine = handles;  // the path of real ranks: IPC mappings
      for (int q = 0; q < n && neighbours_only; ++q)
        if (q != (r + 1) % n && q != (r + n - 1) % n) mine[q].clear();
      rings[r]->connect(mine);
#else
      rings[r]->connect_local(all);
#endif
    }
    // The copy algorithm's counters, as the torch binding attaches them: rank 0 makes the shared
    // memory segment, the others map it, the name goes.
    if (rings[0]->copies()) {
      static std::atomic<int> made{0};
      const std::string name = "/rr-test-copy-" + std::to_string(getpid()) + "-" + std::to_string(made++);
      for (int r = 0; r < n; ++r) {
        RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
        rings[r]->copy_attach(name, r == 0);
      }
      rr::runtime::shm_unlink(name);
    }
  }
  ~Group() {
    // The two-phase close of the binding: every rank unmaps its peers, then each frees its own;
    // if one keeps its mappings (a graph pin), every rank keeps its memory.
    bool unmapped = true;
    for (size_t r = 0; r < rings.size(); ++r) {
      cudaSetDevice(ranks[r].device);
      cudaStreamSynchronize(ranks[r].stream);
      unmapped &= rings[r]->unmap_peers();
    }
    for (size_t r = 0; r < rings.size() && !unmapped; ++r) {
      cudaSetDevice(ranks[r].device);
      rings[r]->close(/*peers_done=*/false);
    }
    for (Rank& k : ranks) cudaStreamDestroy(k.stream);
  }
  rr::Call call(int64_t numel, const DevBuf& buf) const {
    return {rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, buf.p, buf.p};
  }
};

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

// (2a) the copy algorithm (ranks sharing a GPU without MPS): copies into the peers' inboxes and
// stream waits on counters, a kernel that never waits. Forced, with tiny pieces (many per call, so
// that the inbox slots are reused while peers still fold: the "freed" counts), unaligned too; then
// as auto picks it for time-sliced ranks on one device, at the default piece size.
static void sync_all(Group& g);
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

// (2b) registered buffers: a buffer of `bytes` allocated by every rank of g and mapped by all, as
// ringreduce.shared_empty does on CUDA (IPC handles under the emulator); every rank's copy.
// Auto's one-shot threshold goes to 0 (tuned: never), so that every size runs the registered kernel.
static std::vector<char*> register_all(Group& g, size_t bytes) {
  const int n = static_cast<int>(g.rings.size());
  for (auto& ring : g.rings) ring->set_threshold(0), ring->set_ll_max(0);
  std::vector<std::string> handles(n);
  std::vector<const rc::p2p::Endpoint*> all;
  int id = -1;
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
    id = g.rings[r]->reg_alloc(bytes, &handles[r]);
    all.push_back(g.rings[r].get());
  }
  std::vector<char*> at(n);
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
#ifdef RINGREDUCE_EMU
    g.rings[r]->reg_connect(id, handles);
#else
    g.rings[r]->reg_connect_local(id, all);
#endif
    at[r] = g.rings[r]->reg_memory(id).get();
  }
  return at;
}

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

static void sync_all(Group& g);

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

// The LL one-shot (ll_kernel.cu): auto's choice up to its reach, every dtype and op, worlds 2-8
// (ranks beyond the 4 emulated devices share them), odd sizes and unaligned tensors (one element
// in: the byte-wise paths), exact; the last size past its reach runs one-shot.
static void test_ll() {
  using rc::p2p::Algo;
  int cases = 0;
  const auto t0 = Clock::now();
  for (int n : {2, 3, 5, 8}) {
    Group g(n, rc::p2p::kDefaultChannels, rc::p2p::kDefaultSliceBytes, 20.0);
    const size_t limit = rc::p2p::ll_max_bytes(n);
    for (rr::DType t : kDtypes) {
      const int64_t es = static_cast<int64_t>(rr::dtype_size(t)), most = static_cast<int64_t>(limit) / es;
      for (rr::RedOp op : kOps)
        for (int64_t numel : {int64_t{1}, int64_t{n + 1}, int64_t{4099}, most}) {
          char what[64];
          std::snprintf(what, sizeof what, "ll n=%d", n);
          check_collective(g.ranks, rr::Coll::AllReduce, t, op, numel, true, what, numel % 2);
          ++cases;
        }
      const rr::Call at{rr::Coll::AllReduce, t, rr::RedOp::Sum, most, nullptr, nullptr};
      const rr::Call past{rr::Coll::AllReduce, t, rr::RedOp::Sum, most + 1, nullptr, nullptr};
      EXPECT(g.rings[0]->plan_of(at).algo == Algo::LL && g.rings[0]->plan_of(past).algo == Algo::OneShot,
             "n=%d %s: %lld elements ran %s, one more %s", n, rr::dtype_name(t), (long long)most,
             rc::p2p::algo_name(g.rings[0]->plan_of(at).algo), rc::p2p::algo_name(g.rings[0]->plan_of(past).algo));
      if (g_failures) return;
    }
  }
  std::printf("ll: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

// A rank whose call is one element past the LL's reach runs one-shot while its peers run LL: the
// one-shot rank finds their headers at its barrier (the LL kernel writes them there too) and the
// LL ranks find its header in their barrier words: every rank stops over the mismatch (those the
// abort reaches first say which rank saw it), and the calls are named.
static void test_ll_mismatch_with_the_workspace() {
  for (int n : {2, 3}) {
    Group g(n, 2, 4096, 10.0);
    const int64_t most = static_cast<int64_t>(rc::p2p::ll_max_bytes(n)) / 4;
    DevBuf buf((most + 1) * 4);
    for (int r = 0; r < n; ++r) g.rings[r]->run(g.call(r == 1 ? most + 1 : most, buf), g.ranks[r].stream);
    sync_all(g);
    int named = 0;
    for (int r = 0; r < n; ++r) {
      const std::string f = g.rings[r]->failure();
      EXPECT(contains(f, "mismatched collective calls"), "n=%d rank %d: '%s'", n, r, f.c_str());
      named += contains(f, "numel=" + std::to_string(most)) && contains(f, "numel=" + std::to_string(most + 1));
    }
    EXPECT(named >= 1, "n=%d: no rank named both calls; rank 0 says: %s", n, g.rings[0]->failure().c_str());
    std::printf("ll beside one-shot (n=%d): rank 0 says: %s\n", n, g.rings[0]->failure().c_str());
  }
}

// LL calls back to back, no synchronisation between them: a rank runs ahead into the next call
// (the other parity) while its peers still read this one; x <- sum over ranks of x, 25 times.
static void ll_back_to_back(int n, int64_t numel, int calls) {
  Group g(n, 2, 4096, 20.0);
  std::vector<std::unique_ptr<DevBuf>> x;
  const std::vector<int64_t> ones(numel, 1);
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
    x.push_back(std::make_unique<DevBuf>(numel * 8));
    RR_CUDA_CHECK(cudaMemcpyAsync(x[r]->p, ones.data(), numel * 8, cudaMemcpyHostToDevice, g.ranks[r].stream));
    RR_CUDA_CHECK(cudaStreamSynchronize(g.ranks[r].stream));
  }
  for (int k = 0; k < calls; ++k)
    for (int r = 0; r < n; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
      g.rings[r]->run({rr::Coll::AllReduce, rr::DType::I64, rr::RedOp::Sum, numel, x[r]->p, x[r]->p}, g.ranks[r].stream);
    }
  sync_all(g);
  int64_t want = 1;
  for (int k = 0; k < calls; ++k) want *= n;
  for (int r = 0; r < n; ++r) {
    EXPECT(g.rings[r]->failure().empty(), "rank %d: %s", r, g.rings[r]->failure().c_str());
    std::vector<int64_t> got(numel);
    RR_CUDA_CHECK(cudaMemcpy(got.data(), x[r]->p, numel * 8, cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int64_t v : got) bad += v != want;
    EXPECT(bad == 0, "n=%d rank %d: %lld of %lld elements are not %lld after %d calls (first %lld)", n, r,
           (long long)bad, (long long)numel, (long long)want, calls, (long long)got[0]);
  }
}
static void test_ll_back_to_back() {
  for (int n : {2, 3, 4}) ll_back_to_back(n, 1000, 25);
}

// The emulator's weak memory mode (a GPU's is its own).
static void set_weak(uint64_t seed) {
#ifdef RINGREDUCE_EMU
  emu_set_weak(seed);
#else
  (void)seed;
#endif
}

// Issue 81 item 2: the LL flag never matches a stale word. The LL count started just below a
// wipe and below 2^32 (where a flag that was the count cut to 32 bits came round to 0, the value
// of a word never written), sizes mixed (a big call leaves words a small one does not overwrite),
// and one rank late to every call, so that its peers poll before its words arrive: every result
// exact; after each wiping call the idle slots hold only zeros.
static void test_ll_flag_wrap() {
  // Twice: as stores land, and in the weak memory mode (stores land late and in any order, so a
  // reader meets words not yet arrived whatever the header's timing).
  for (uint64_t seed : {uint64_t{0}, uint64_t{5}})
  for (int n : {2, 3})
    for (uint64_t start : {(uint64_t{1} << 30) - 3, (uint64_t{1} << 32) - 5, (uint64_t{3} << 31) - 4}) {
      set_weak(seed);
      struct Strong {
        ~Strong() { set_weak(0); }
      } strong;
      Group g(n, 2, 4096, 20.0);  // slots of zeros, as new
      const int64_t most = static_cast<int64_t>(rc::p2p::ll_max_bytes(n)) / 4;
      std::vector<std::unique_ptr<DevBuf>> x;
      for (int r = 0; r < n; ++r) {
        RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
        x.push_back(std::make_unique<DevBuf>(most * 4));
      }
      for (int r = 0; r < n; ++r) g.rings[r]->set_counts(start * 3, start);  // epochs: any larger value
      // small calls first, so that the fifth (LL call 2^32 from the second start) reads words no
      // call wrote since the slots were new
      const int64_t sizes[] = {7, 1, 33, 2, most, most - 5, 7, most / 2, 1, most};
      int calls = 0;
      for (int64_t numel : sizes) {
        const uint64_t k = start + ++calls;
        for (int r = 0; r < n; ++r) {
          std::vector<int32_t> v(numel);
          for (int64_t i = 0; i < numel; ++i) v[i] = (r + 1) * static_cast<int32_t>(i % 7 + 1) + calls;
          RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
          RR_CUDA_CHECK(cudaMemcpyAsync(x[r]->p, v.data(), numel * 4, cudaMemcpyHostToDevice, g.ranks[r].stream));
          RR_CUDA_CHECK(cudaStreamSynchronize(g.ranks[r].stream));
        }
        const rr::Call probe{rr::Coll::AllReduce, rr::DType::I32, rr::RedOp::Sum, numel, x[0]->p, x[0]->p};
        EXPECT(g.rings[0]->plan_of(probe).algo == rc::p2p::Algo::LL, "n=%d: %lld elements not LL", n, (long long)numel);
        for (int r = n - 1; r >= 0; --r) {  // rank 0 last, late: the others poll for its words
          if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(3));
          RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
          g.rings[r]->run({rr::Coll::AllReduce, rr::DType::I32, rr::RedOp::Sum, numel, x[r]->p, x[r]->p},
                          g.ranks[r].stream);
        }
        sync_all(g);
        for (int r = 0; r < n; ++r) {
          EXPECT(g.rings[r]->failure().empty(), "n=%d rank %d: %s", n, r, g.rings[r]->failure().c_str());
          std::vector<int32_t> got(numel);
          RR_CUDA_CHECK(cudaMemcpy(got.data(), x[r]->p, numel * 4, cudaMemcpyDeviceToHost));
          int64_t bad = 0, first = -1;
          for (int64_t i = 0; i < numel; ++i)
            if (got[i] != n * (n + 1) / 2 * static_cast<int32_t>(i % 7 + 1) + n * calls) bad += 1, first = first < 0 ? i : first;
          EXPECT(bad == 0, "n=%d rank %d, LL call %llu (%lld elements): %lld wrong, first at %lld (%d)", n, r,
                 (unsigned long long)k, (long long)numel, (long long)bad, (long long)first, first >= 0 ? got[first] : 0);
          if (!rc::p2p::ll_wipes(k)) continue;
          size_t slot = 0;
          const char* slots = g.rings[r]->ll_slots(&slot);
          std::vector<uint64_t> idle(n * slot / 8);
          RR_CUDA_CHECK(cudaMemcpy(idle.data(), slots + ((k + 1) & 1) * n * slot, n * slot, cudaMemcpyDeviceToHost));
          int64_t left = 0;
          for (uint64_t w : idle) left += w != 0;
          EXPECT(left == 0, "n=%d rank %d: %lld words left in the idle slots after LL call %llu wiped them", n, r,
                 (long long)left, (unsigned long long)k);
        }
        if (g_failures) return;
      }
    }
  // The flag's arithmetic: never 0, and a slot's flags distinct for calls fewer than 2^32 apart.
  for (uint64_t k : {uint64_t{1}, uint64_t{2}, (uint64_t{1} << 32) - 2, uint64_t{1} << 32, (uint64_t{1} << 33) + 7}) {
    EXPECT(rc::p2p::ll_flag(k) != 0, "the flag of LL call %llu is 0", (unsigned long long)k);
    for (uint64_t d : {uint64_t{2}, uint64_t{4}, (uint64_t{1} << 31), (uint64_t{1} << 32) - 2})
      EXPECT(rc::p2p::ll_flag(k) != rc::p2p::ll_flag(k + d), "LL calls %llu and %llu share a flag",
             (unsigned long long)k, (unsigned long long)(k + d));
  }
}

// The group's board for imported memory (Endpoint::board_attach): rank 0 makes it, the others
// map it, then the name goes.
// Each rank's holds come from g_held: memory from g_held.alloc() is freed as torch frees a tensor's
// block, when its last owner (the test, or a hold) lets go; other memory stays held until close.
static HeldMemory g_held;
static void attach_boards(Group& g) {
  static int made = 0;
  const std::string name = "/rr-test-board-" + std::to_string(getpid()) + "-" + std::to_string(made++);
  for (size_t r = 0; r < g.rings.size(); ++r) {
    g.rings[r]->set_holder(g_held.holder());
    g.rings[r]->board_attach(name, r == 0);
  }
  rr::runtime::shm_unlink(name);
}

// Frees of memory an IPC mapping still mapped (the emulator counts them; a GPU cannot tell).
static uint64_t frees_while_mapped() {
#ifdef RINGREDUCE_EMU
  return emu_frees_while_mapped();
#else
  return 0;
#endif
}

// Waits (at most 5 s) until pred holds; false if it never did.
template <class Pred>
static bool eventually(Pred pred) {
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

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
        g.rings[r]->run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, fresh[r].get(), fresh[r].get()},
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
// Calls on memory from g_held at every rank (each tensor at its allocation's start): the second
// and later run in place, mapped by every peer.
static std::vector<std::shared_ptr<char>> imported_tensors(Group& g, int64_t numel, int calls) {
  const int n = static_cast<int>(g.rings.size());
  std::vector<std::shared_ptr<char>> mem;
  std::vector<char*> at(n);
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
    mem.push_back(g_held.alloc(numel * 4));
    at[r] = mem[r].get();
  }
  for (int k = 0; k < calls; ++k)
    check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, true, "imported", 0, &at);
  return mem;
}

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
#endif

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
  std::ifstream f(std::string(RR_SOURCE_DIR) + "/README.md");
  EXPECT(f.good(), "cannot read %s/README.md", RR_SOURCE_DIR);
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
    EXPECT(contains(direct, w), "README's p2p row lacks '%s': %s", w.c_str(), direct.c_str());
  const std::string want_ring = "(its FIFO: " + size_text(area(false)) + " per rank)";
  EXPECT(contains(ring, want_ring), "README's ring row lacks '%s': %s", want_ring.c_str(), ring.c_str());
  const std::string want_nccl = "two-shot (up to " + size_text(rc::nccl::kTwoShotMaxBytes) + ")";
  EXPECT(contains(nccl, want_nccl), "README's nccl row lacks '%s': %s", want_nccl.c_str(), nccl.c_str());
}

// Freeing memory a peer still maps is undefined in CUDA (issue 51, finding 3): a released shared
// buffer's own copy and a rank's workspace are freed only in the close's second phase, after every
// rank has unmapped (unmap_peers, a barrier in the binding). The emulator counts each cudaFree of
// memory an IPC mapping still maps; a close of one rank alone (no first phase) is one.
static std::atomic<uint64_t> g_allowed_frees_while_mapped{0};

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

// A rank's registered all_reduce ends only when every peer has written its chunk into this rank's
// copy: work after it on the rank's stream (here a device-to-device copy of the result, as torch's
// next kernel would read it) sees the whole result. Large tensors and several ranks, so that the
// peers are still writing when a rank that did not wait would go on.
// imported: ordinary memory (Algo::Imported; the first call through the workspace, the others in
// place).
static void attach_boards(Group& g);
static void test_result_in_stream_order(bool imported) {
  for (int n = 2; n <= 4; ++n) {
    const int64_t numel = 1 << 20;
    std::vector<std::unique_ptr<DevBuf>> mem;
    for (int r = 0; r < n && imported; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(device_of(r)));
      mem.push_back(std::make_unique<DevBuf>(numel * 4));
    }
    Group g(n, rc::p2p::kDefaultChannels, rc::p2p::kDefaultSliceBytes, 20.0);
    std::vector<char*> at(n);
    if (imported) {
      for (auto& ring : g.rings) ring->set_threshold(0), ring->set_ll_max(0);
      attach_boards(g);
      for (int r = 0; r < n; ++r) at[r] = mem[r]->p;
    } else {
      at = register_all(g, numel * 4);
    }
    std::vector<std::unique_ptr<DevBuf>> after;
    std::vector<std::vector<char>> host(n);
    for (int r = 0; r < n; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
      after.push_back(std::make_unique<DevBuf>(numel * 4));
      std::vector<float> h(numel, static_cast<float>(r + 1));
      host[r].assign(reinterpret_cast<const char*>(h.data()), reinterpret_cast<const char*>(h.data() + numel));
    }
    for (int call = 0; call < 3; ++call) {
      for (int r = 0; r < n; ++r) {
        RR_CUDA_CHECK(cudaSetDevice(g.ranks[r].device));
        fill_on(g.ranks[r].stream, at[r], host[r]);
        g.rings[r]->run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, at[r], at[r]},
                        g.ranks[r].stream);
        RR_CUDA_CHECK(cudaMemcpyAsync(after[r]->p, at[r], numel * 4, cudaMemcpyDeviceToDevice, g.ranks[r].stream));
      }
      sync_all(g);
      const float want = n * (n + 1) / 2.0f;
      for (int r = 0; r < n; ++r) {
        EXPECT(g.rings[r]->failure().empty(), "rank %d: %s", r, g.rings[r]->failure().c_str());
        std::vector<float> h(numel);
        RR_CUDA_CHECK(cudaMemcpy(h.data(), after[r]->p, numel * 4, cudaMemcpyDeviceToHost));
        int64_t bad = 0;
        for (float v : h) bad += v != want;
        EXPECT(bad == 0, "n=%d call %d rank %d: %lld of %lld elements read after the call are not %g", n, call, r,
               (long long)bad, (long long)numel, want);
      }
      if (g_failures) return;
    }
  }
}

// (3) failures. Each waits on streams that end by the deadline at the latest.
static void sync_all(Group& g) {
  for (Rank& k : g.ranks) cudaStreamSynchronize(k.stream);
}


const rc::p2p::Algo kAlgos[] = {rc::p2p::Algo::Ring, rc::p2p::Algo::OneShot, rc::p2p::Algo::TwoShot,
                                 rc::p2p::Algo::LL};

// Rank n-1 never calls: the others stop within the timeout, saying why; the ring stays broken.
// On each algorithm.
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

// The process of rank 2 dies (SIGKILL) while ranks 0 and 1 wait for it: both stop within about a
// second, naming it, instead of waiting out their 30 s timeout.
static void test_dead_peer() {
  const pid_t child = fork();
  if (child == 0) {
    pause();  // plays rank 2's process
    _exit(0);
  }
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

#ifdef RINGREDUCE_EMU
// The weak memory mode (tests/native/emu/weak.cpp): stores land late and in random order unless
// released, loads may be stale until acquired. Each algorithm forced, on worlds 2 and 3 with tiny
// slices/slots (many steps and slot reuses per call), three seeds. Run by name only (ctest's
// test_cuda_kernels_emu_weak): the other tests run with the strong model.
// The happens-before check (tests/native/emu/hb.cpp) runs alongside: a load that no acquire
// ordered after its store (a poll without the acquire after it) fails the scope.
struct WeakScope {
  explicit WeakScope(uint64_t seed) : seed(seed) {
    emu_set_weak(seed);
    emu_set_hb(1);
  }
  ~WeakScope() {
    emu_set_weak(0);
    EXPECT(emu_hb_races() == 0, "weak seed=%llu: %llu loads not ordered after their stores; the first: %s",
           (unsigned long long)seed, (unsigned long long)emu_hb_races(), emu_hb_first_race());
    emu_set_hb(0);
  }
  uint64_t seed;
};
// registered: all_reduce in registered buffers (Algo::Auto picks the registered algorithm), the
// other collectives staged.
static void weak_sweep(rc::p2p::Algo algo, bool registered = false) {
  const auto t0 = Clock::now();
  int cases = 0;
  for (uint64_t seed : {1, 2, 3}) {
    WeakScope weak(seed);
    for (int n = 2; n <= 3; ++n) {
      Group g(n, 2, 64, 20.0, algo, true, 64, false, 0, false, 64);  // copy: pieces of 64 B
      const std::vector<char*> reg = registered ? register_all(g, 1 << 16) : std::vector<char*>();
      char what[96];
      std::snprintf(what, sizeof what, "weak seed=%llu p2p n=%d %s", (unsigned long long)seed, n,
                    registered ? "registered" : rc::p2p::algo_name(algo));
      for (rr::Coll coll : {rr::Coll::AllReduce, rr::Coll::ReduceScatter, rr::Coll::AllGather})
        for (rr::DType t : {rr::DType::F32, rr::DType::BF16, rr::DType::I64})
          for (int64_t numel : {int64_t{n + 1}, int64_t{200 * n}})
            for (bool inplace : {true, false}) {
              if (coll == rr::Coll::AllReduce && !inplace) continue;
              const int64_t total = coll == rr::Coll::AllReduce ? numel : (numel / n) * n;
              check_collective(g.ranks, coll, t, rr::RedOp::Sum, total, inplace, what, 0,
                               registered ? &reg : nullptr);
              ++cases;
            }
    }
  }
  std::printf("weak %s: %d cases (%.1f s)\n", registered ? "registered" : rc::p2p::algo_name(algo), cases,
              seconds_since(t0));
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

// (4) the transport choice: p2p only where every device can map its neighbours' memory.
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

// (5) deterministic mode.

// launch_reduce_ranks against the host's rank-order fold: every dtype and op, up to 20 ranks (more
// than the direct kernels' kMaxSpanPtrs), the own piece at any rank and alignment, in place.
static void test_reduce_ranks() {
  const int64_t sizes[] = {0, 1, 17, 4099};
  const int worlds[] = {1, 2, 3, 5, 20};
  int cases = 0;
  DetTeeth teeth;
  for (rr::DType t : kDtypes) {
    const size_t es = rr::dtype_size(t);
    for (rr::RedOp op : kOps)
      for (int64_t n : sizes)
        for (int nr : worlds)
          for (int own : {0, nr - 1})
            for (int off : {0, 1, 3}) {  // element offset of the own piece; the output's too, or in place
              const bool inplace = off == 3;
              const size_t slot = (n * es + 15) / 16 * 16 + 16;  // a multiple of 16 (every es)
              std::vector<std::vector<char>> x(nr, std::vector<char>(std::max<int64_t>(n, 1) * es));
              for (int q = 0; q < nr; ++q)
                for (int64_t i = 0; i < n; ++i) put(t, &x[q][i * es], det_value(t, op, i, q));
              std::vector<char> slots_h((nr > 1 ? nr - 1 : 1) * slot, 0);
              for (int q = 0, k = 0; q < nr; ++q)
                if (q != own) std::memcpy(&slots_h[(k++) * slot], x[q].data(), n * es);
              std::vector<char> own_h((n + 8) * es, 0x5a);
              std::memcpy(&own_h[off * es], x[own].data(), n * es);
              DevBuf own_d(own_h.size()), slots_d(slots_h.size()), out_d((n + 8) * es);
              RR_CUDA_CHECK(cudaMemcpy(own_d.p, own_h.data(), own_h.size(), cudaMemcpyHostToDevice));
              RR_CUDA_CHECK(cudaMemcpy(slots_d.p, slots_h.data(), slots_h.size(), cudaMemcpyHostToDevice));
              RR_CUDA_CHECK(cudaMemset(out_d.p, 0x5a, (n + 8) * es));
              char* dst = inplace ? own_d.p + off * es : out_d.p + (off + 1) * es;
              rc::nccl::launch_reduce_ranks(t, op, dst, own_d.p + off * es, own, slots_d.p, slot, nr, n, nr,
                                      nullptr);
              RR_CUDA_CHECK(cudaDeviceSynchronize());
              std::vector<char> got(n * es + 1);
              RR_CUDA_CHECK(cudaMemcpy(got.data(), dst, n * es, cudaMemcpyDeviceToHost));
              std::vector<const char*> xs(nr);
              std::vector<char> want(es), step(es);
              for (int64_t i = 0; i < n; ++i) {
                for (int q = 0; q < nr; ++q) xs[q] = &x[q][i * es];
                det_fold(t, op, xs, want.data());
                if (nr >= 3 && (op == rr::RedOp::Sum || op == rr::RedOp::Avg) &&
                    (t == rr::DType::F16 || t == rr::DType::BF16)) {
                  det_fold(t, op, xs, step.data(), true);
                  ++teeth.elements;
                  teeth.per_step += want != step;
                }
                if (std::memcmp(&got[i * es], want.data(), es) != 0) {
                  EXPECT(false, "reduce_ranks %s %s n=%lld ranks=%d own=%d off=%d%s i=%lld: got %.17g want %.17g",
                         rr::dtype_name(t), rr::op_name(op), (long long)n, nr, own, off,
                         inplace ? " in place" : "", (long long)i, det_get(t, &got[i * es]),
                         det_get(t, want.data()));
                  break;
                }
              }
              if (!inplace) {  // nothing around the output is written
                std::vector<char> around((n + 8) * es);
                RR_CUDA_CHECK(cudaMemcpy(around.data(), out_d.p, around.size(), cudaMemcpyDeviceToHost));
                for (int64_t i = 0; i < (off + 1) * static_cast<int64_t>(es); ++i)
                  EXPECT(static_cast<unsigned char>(around[i]) == 0x5a, "reduce_ranks wrote before its output");
                EXPECT(static_cast<unsigned char>(around[(off + 1 + n) * es]) == 0x5a,
                       "reduce_ranks wrote past its output");
              }
              ++cases;
            }
  }
  EXPECT(teeth.per_step > 0, "no fp16/bf16 element rounds differently per step: the test could not fail");
  std::printf("reduce_ranks kernel: %d cases; per-step rounding differs on %lld of %lld fp16/bf16 "
              "elements\n", cases, (long long)teeth.per_step, (long long)teeth.elements);
}

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

// (6) The narrow wire on the symmetric workspace (sym_wire.cu), against the CPU kernels' bits.
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
  // The ranks' kernels spin until their neighbours' kernels run, so all must run at once. Streams
  // beyond CUDA_DEVICE_MAX_CONNECTIONS (default 8) share hardware queues and are serialized behind
  // each other; a Group of 4 rings makes 8 streams (rank + side streams). Before CUDA starts.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // failures reach a pipe even if the exit crashes
#ifdef RINGREDUCE_EMU
  emu_set_device_count(4);  // rank r on device r: IPC mappings across devices
  std::printf("emulated device: %d threads per block\n", emu_block_threads());
#endif
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("test_cuda_kernels: no CUDA device, skipped\n");
    return 0;
  }
  try {
    run_test(argc, argv, "test_reduce", [&] { test_reduce(); });
    run_test(argc, argv, "test_avg_wide_divisor", [&] { test_avg_wide_divisor(); });
    run_test(argc, argv, "test_ring", [&] { test_ring(); });
    run_test(argc, argv, "test_ranks_share_a_device", [&] { test_ranks_share_a_device(); });
    run_test(argc, argv, "test_two_communicators_share_a_device", [&] { test_two_communicators_share_a_device(); });
    run_test(argc, argv, "test_epochs_stay_equal", [&] { test_epochs_stay_equal(); });
    run_test(argc, argv, "test_copy", [&] { test_copy(); });
    run_test(argc, argv, "test_copy_failures", [&] { test_copy_failures(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_emulated_hardware_queues", [&] { test_emulated_hardware_queues(); });
#endif
    run_test(argc, argv, "test_registered", [&] { test_registered(); });
    run_test(argc, argv, "test_registered_mismatch", [&] { test_registered_mismatch(); });
    run_test(argc, argv, "test_registered_result_in_stream_order", [&] { test_result_in_stream_order(false); });
    run_test(argc, argv, "test_imported_result_in_stream_order", [&] { test_result_in_stream_order(true); });
    run_test(argc, argv, "test_registered_release", [&] { test_registered_release(); });
    run_test(argc, argv, "test_imported", [&] { test_imported(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_imported_release", [&] { test_imported_release(); });
    run_test(argc, argv, "test_imports_beside_a_capture", [&] { test_imports_beside_a_capture(); });
    run_test(argc, argv, "test_no_cuda_call_after_stop_threads", [&] { test_no_cuda_call_after_stop_threads(); });
    run_test(argc, argv, "test_failed_open_remembered", [&] { test_failed_open_remembered(); });
#endif
    run_test(argc, argv, "test_ll", [&] { test_ll(); });
    run_test(argc, argv, "test_ll_back_to_back", [&] { test_ll_back_to_back(); });
    run_test(argc, argv, "test_ll_flag_wrap", [&] { test_ll_flag_wrap(); });
    run_test(argc, argv, "test_ll_mismatch_with_the_workspace", [&] { test_ll_mismatch_with_the_workspace(); });
    run_test(argc, argv, "test_pinned_release_counted_once", [&] { test_pinned_release_counted_once(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_close_frees_nothing_mapped", [&] { test_close_frees_nothing_mapped(); });
    run_test(argc, argv, "test_readme_table", [&] { test_readme_table(); });
#endif
    run_test(argc, argv, "test_timeout", [&] { test_timeout(); });
    run_test(argc, argv, "test_block_counts_must_agree", [&] { test_block_counts_must_agree(); });
    run_test(argc, argv, "test_failed_call_survives_close", [&] { test_failed_call_survives_close(); });
    run_test(argc, argv, "test_timeout_with_every_block", [&] { test_timeout_with_every_block(); });
    run_test(argc, argv, "test_mismatch", [&] { test_mismatch(); });
    run_test(argc, argv, "test_abort", [&] { test_abort(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_launch_failure_aborts_the_group", [&] { test_launch_failure_aborts_the_group(); });
#endif
    run_test(argc, argv, "test_abort_between_calls", [&] { test_abort_between_calls(); });
    run_test(argc, argv, "test_dead_peer", [&] { test_dead_peer(); });
    run_test(argc, argv, "test_call_log", [&] { test_call_log(); });
    run_test(argc, argv, "test_replayed_launches_stay_in_step", [&] { test_replayed_launches_stay_in_step(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_close_keeps_memory_neighbours_read", [&] { test_close_keeps_memory_neighbours_read(); });
#endif
    run_test(argc, argv, "test_can_map", [&] { test_can_map(); });
    run_test(argc, argv, "test_reduce_ranks", [&] { test_reduce_ranks(); });
    run_test(argc, argv, "test_deterministic", [&] { test_deterministic(); });
    run_test(argc, argv, "test_deterministic_plan", [&] { test_deterministic_plan(); });
    run_test(argc, argv, "test_tuned_thresholds", [&] { test_tuned_thresholds(); });
    run_test(argc, argv, "test_sym_blocks_knob", [&] { test_sym_blocks_knob(); });
    run_test(argc, argv, "test_calls_of_the_most_blocks", [&] { test_calls_of_the_most_blocks(); });
    run_test(argc, argv, "test_options_checked", [&] { test_options_checked(); });
    run_test(argc, argv, "test_replay_after_close_of_a_pinned_ring", [&] { test_replay_after_close_of_a_pinned_ring(); });
    run_test(argc, argv, "test_wire", [&] { test_wire(); });
    run_test(argc, argv, "test_wire_overflow", [&] { test_wire_overflow(); });
    run_test(argc, argv, "test_wire_mismatch", [&] { test_wire_mismatch(); });
    run_test(argc, argv, "test_wire_plan", [&] { test_wire_plan(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "test_deterministic_needs_direct", [&] { test_deterministic_needs_direct(); });
    run_test(argc, argv, "weak_ring", [&] { weak_sweep(rc::p2p::Algo::Ring); });
    run_test(argc, argv, "weak_oneshot", [&] { weak_sweep(rc::p2p::Algo::OneShot); });
    run_test(argc, argv, "weak_twoshot", [&] { weak_sweep(rc::p2p::Algo::TwoShot); });
    run_test(argc, argv, "weak_registered", [&] { weak_sweep(rc::p2p::Algo::Auto, true); });
    run_test(argc, argv, "weak_copy", [&] { weak_sweep(rc::p2p::Algo::Copy); });
    run_test(argc, argv, "weak_imported", [&] { weak_imported(); });
    run_test(argc, argv, "weak_ll", [&] {
      weak_sweep(rc::p2p::Algo::LL);
      for (uint64_t seed : {1, 2, 3}) {  // ahead into the other parity while peers read
        WeakScope weak(seed);
        ll_back_to_back(3, 300, 12);
      }
    });
    run_test(argc, argv, "weak_wire", [&] { weak_wire(); });
#endif
  } catch (const std::exception& e) {
    std::printf("FAIL: exception: %s\n", e.what());
    return 1;
  }
#ifdef RINGREDUCE_EMU
  // Every test's rings closed in two phases: no memory was freed while a peer mapped it.
  EXPECT(emu_frees_while_mapped() == g_allowed_frees_while_mapped,
         "%llu cudaFree calls of memory a peer still mapped (see the emulator's lines above)",
         (unsigned long long)(emu_frees_while_mapped() - g_allowed_frees_while_mapped));
#endif
  std::printf(g_failures ? "test_cuda_kernels: %d failures\n" : "test_cuda_kernels: OK\n", g_failures);
  return g_failures ? 1 : 0;
}
