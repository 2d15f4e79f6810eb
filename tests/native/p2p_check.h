// The p2p tests' common part (test_p2p_*.cpp, test_cuda_reduce.cpp): a Group of endpoints, one
// per rank, connected as the binding connects them; registered buffers and imported memory as the
// binding sets them up; the weak memory sweep; and p2p_main, which runs a binary's tests and checks
// at the end that no memory was freed while a peer mapped it.
#pragma once
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
#include "runtime/recorder.h"
#include "runtime/shm_map.h"
#ifdef RINGREDUCE_EMU
#include "emu.h"
#endif

namespace rc = ringreduce::cuda;

using Clock = std::chrono::steady_clock;

inline int device_of(int rank) {
  int count = 1;
  cudaGetDeviceCount(&count);
  return rank % count;
}

// A p2p ring of n ranks, rank r on device r % count, with its own stream.
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

// Waits for every rank's stream (each ends by the deadline at the latest).
inline void sync_all(Group& g) {
  for (Rank& k : g.ranks) cudaStreamSynchronize(k.stream);
}

// Registered buffers: a buffer of `bytes` allocated by every rank of g and mapped by all, as
// ringreduce.shared_empty does on CUDA (IPC handles under the emulator); every rank's copy.
// Auto's one-shot threshold goes to 0 (tuned: never), so that every size runs the registered kernel.
inline std::vector<char*> register_all(Group& g, size_t bytes) {
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

// The group's board for imported memory (Endpoint::board_attach): rank 0 makes it, the others
// map it, then the name goes.
// Each rank's holds come from g_held: memory from g_held.alloc() is freed as torch frees a tensor's
// block, when its last owner (the test, or a hold) lets go; other memory stays held until close.
inline HeldMemory g_held;

inline void attach_boards(Group& g) {
  static int made = 0;
  const std::string name = "/rr-test-board-" + std::to_string(getpid()) + "-" + std::to_string(made++);
  for (size_t r = 0; r < g.rings.size(); ++r) {
    g.rings[r]->set_holder(g_held.holder());
    g.rings[r]->board_attach(name, r == 0);
  }
  rr::runtime::shm_unlink(name);
}

// Frees of memory an IPC mapping still mapped (the emulator counts them; a GPU cannot tell).
inline uint64_t frees_while_mapped() {
#ifdef RINGREDUCE_EMU
  return emu_frees_while_mapped();
#else
  return 0;
#endif
}

// Waits (at most 5 s) until pred holds; false if it never did.
template <class Pred>
inline bool eventually(Pred pred) {
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (!pred()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

#ifdef RINGREDUCE_EMU
// Calls on memory from g_held at every rank (each tensor at its allocation's start): the second
// and later run in place, mapped by every peer.
inline std::vector<std::shared_ptr<char>> imported_tensors(Group& g, int64_t numel, int calls) {
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

// What test_close_frees_nothing_mapped provokes itself: the frees the final check allows.
inline std::atomic<uint64_t> g_allowed_frees_while_mapped{0};

#endif

// A rank's registered all_reduce ends only when every peer has written its chunk into this rank's
// copy: work after it on the rank's stream (here a device-to-device copy of the result, as torch's
// next kernel would read it) sees the whole result. Large tensors and several ranks, so that the
// peers are still writing when a rank that did not wait would go on.
// imported: ordinary memory (Algo::Imported; the first call through the workspace, the others in
// place).
inline void test_result_in_stream_order(bool imported) {
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

inline const rc::p2p::Algo kAlgos[] = {rc::p2p::Algo::Ring, rc::p2p::Algo::OneShot, rc::p2p::Algo::TwoShot,
                                 rc::p2p::Algo::LL};

#ifdef RINGREDUCE_EMU
// The weak memory mode (tests/native/emu/weak.cpp): stores land late and in random order unless
// released, loads may be stale until acquired. Each algorithm forced, on worlds 2 and 3 with tiny
// slices/slots (many steps and slot reuses per call), three seeds. Run by name only (ctest's
// *_emu_weak entries): the other tests run with the strong model.
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
inline void weak_sweep(rc::p2p::Algo algo, bool registered = false) {
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

#endif

// A test binary's main: tests() calls run_test for each of its tests.
inline int p2p_main(const char* binary, const std::function<void()>& tests) {
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
    std::printf("%s: no CUDA device, skipped\n", binary);
    return 0;
  }
  try {
    tests();
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
  std::printf(g_failures ? "%s: %d failures\n" : "%s: OK\n", binary, g_failures);
  return g_failures ? 1 : 0;
}
