// Native test of the nccl transport (csrc/cuda/nccl/) on the emulated device, against the
// in-process NCCL stand-in (tests/native/emu/nccl_standin.cpp), which cuda/nccl/library.cpp loads by
// path as it loads torch's libnccl.so.2. Ranks are threads; rank r on emulated device r.
// (1) the schedules (ring, one-shot, two-shot, and the choice by size): 2-4 ranks, every
//     collective, in place and not, zero-size and numel < N, tiny staging buffers (a chunk in many
//     pieces) and the default, many calls in a row; NCCL groups and reduce launches per call;
// (2) failures and their messages, on every algorithm where they differ: a silent rank (the
//     watchdog's timeout), mismatched sizes (NCCL's "message truncated"), an NCCL call failing inside a group (the group must still be ended), a
//     CUDA fault on the stream (the watchdog must report it), two ranks on one GPU (NCCL refuses;
//     the message says what to do), a peer process that dies (and the survivors' fresh group
//     beside the broken one), an abort, which call failed first;
// (3) deterministic mode: every forced algorithm gives the bits of the rank-order reference (one
//     rounding in the accumulation type) at worlds 2-5, tiny staging and the default; its plans;
//     the error where two-shot's pieces would be under one element.
// Emulator only: real NCCL is exercised by tests/test_cuda.py on a GPU.
#include <dlfcn.h>
#include <nccl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "cuda/nccl/endpoint.h"
#include "cuda_check.h"
#include "deterministic_check.h"
#include "emu.h"

namespace rc = ringreduce::cuda;
using Clock = std::chrono::steady_clock;

static const char* kLib = RR_TEST_NCCL_LIB;

// The stand-in's test hooks, from the library cuda/nccl/library.cpp loads.
struct Hooks {
  void (*fail_next)(const char*, ncclResult_t) = nullptr;
  int (*group_depth)() = nullptr;
  uint64_t (*groups)() = nullptr;
  Hooks() {
    void* h = dlopen(kLib, RTLD_NOW);
    if (!h) throw std::runtime_error(std::string("cannot load the NCCL stand-in: ") + dlerror());
    fail_next = reinterpret_cast<decltype(fail_next)>(dlsym(h, "standin_fail_next"));
    group_depth = reinterpret_cast<decltype(group_depth)>(dlsym(h, "standin_group_depth"));
    groups = reinterpret_cast<decltype(groups)>(dlsym(h, "standin_groups"));
  }
};

struct Group {
  std::vector<std::unique_ptr<rc::nccl::Endpoint>> rings;
  std::vector<Rank> ranks;
  // Creation is collective (each constructor waits for the others), so each rank is built on a
  // thread of its own, on its device. devices: rank -> device (default rank r on device r).
  Group(int n, size_t staging, double timeout_s, std::vector<int> devices = {},
        rc::nccl::Algo algo = rc::nccl::Algo::Auto, std::vector<rc::nccl::Algo> algos = {}) {
    if (devices.empty())
      for (int r = 0; r < n; ++r) devices.push_back(r);
    const std::string id = rc::nccl::unique_id(kLib);
    rings.resize(n);
    std::vector<std::string> errors(n);
    std::vector<std::thread> ths;
    for (int r = 0; r < n; ++r)
      ths.emplace_back([&, r] {
        try {
          RR_CUDA_CHECK(cudaSetDevice(devices[r]));
          rc::nccl::Options o;
          o.rank = r;
          o.nranks = n;
          o.timeout_s = timeout_s;
          o.staging_bytes = staging;
          o.lib = kLib;
          o.algo = algos.empty() ? algo : algos[r];
          rings[r] = std::make_unique<rc::nccl::Endpoint>(o, id);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : ths) t.join();
    for (int r = 0; r < n; ++r)
      if (!errors[r].empty()) throw rr::RingError(errors[r]);
    for (int r = 0; r < n; ++r) {
      Rank k;
      k.device = devices[r];
      RR_CUDA_CHECK(cudaSetDevice(k.device));
      RR_CUDA_CHECK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
      rc::nccl::Endpoint* ring = rings[r].get();
      k.run = [ring](const rr::Call& c, cudaStream_t s) { ring->run(c, s); };
      k.failure = [ring] { return ring->failure(); };
      ranks.push_back(k);
    }
  }
  ~Group() {
    for (Rank& k : ranks) {
      cudaSetDevice(k.device);
      cudaStreamSynchronize(k.stream);
    }
    rings.clear();  // close: finalize, or abort when broken
    for (Rank& k : ranks) cudaStreamDestroy(k.stream);
  }
  rr::Call call(int64_t numel, const DevBuf& buf) const {
    return {rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, buf.p, buf.p};
  }
  void run(int r, int64_t numel, const DevBuf& buf) {
    cudaSetDevice(ranks[r].device);
    rings[r]->run(bound(call(numel, buf), ranks[r].stream), ranks[r].stream);
  }
  void sync() {
    for (Rank& k : ranks) {
      cudaSetDevice(k.device);
      cudaStreamSynchronize(k.stream);
    }
  }
  // Polls until every rank in rs has a failure, up to limit seconds; returns the seconds taken.
  double await_failures(std::initializer_list<int> rs, double limit) {
    const auto t0 = Clock::now();
    for (;;) {
      bool all = true;
      for (int r : rs) all &= !rings[r]->failure().empty();
      if (all || seconds_since(t0) > limit) return seconds_since(t0);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
};

using rc::nccl::Algo;

// (1) the schedules.
static void test_sweep() {
  int cases = 0;
  const auto t0 = Clock::now();
  for (int n = 2; n <= 4; ++n) {
    // Staging of 64 bytes: every chunk goes through in many pieces (the ring's 64-byte slices,
    // two-shot's 128 / (n-1)-byte pieces). 64-byte pieces of the largest size (3 x 65536 elements)
    // would take minutes on 2 cores: the default staging below runs that size.
    for (Algo a : {Algo::Ring, Algo::TwoShot}) {
      Group g(n, 64, 20.0, {}, a);
      char what[64];
      std::snprintf(what, sizeof what, "nccl n=%d staging=64 %s", n, rc::nccl::algo_name(a));
      cases += sweep(g.ranks, {0, 1, n - 1, n + 1, 1000 * n + 7}, what);
    }
    for (Algo a : {Algo::Auto, Algo::Ring}) {  // auto: one-shot for the small sizes, two-shot above
      Group g(n, rc::nccl::kDefaultStagingBytes, 20.0, {}, a);
      char what[64];
      std::snprintf(what, sizeof what, "nccl n=%d staging=default %s", n, rc::nccl::algo_name(a));
      cases += sweep(g.ranks, {0, 1, n + 1, 3 * 65536 + 5}, what);
    }
  }
  std::printf("nccl: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

// One-shot forced at sizes auto gives two-shot (4099 x 8 bytes at n = 4 is over
// oneshot_max_bytes); reduce-scatter and all-gather fall back to two-shot (their one group each).
static void test_oneshot() {
  int cases = 0;
  for (int n = 2; n <= 4; ++n) {
    Group g(n, rc::nccl::kDefaultStagingBytes, 20.0, {}, Algo::OneShot);
    char what[64];
    std::snprintf(what, sizeof what, "nccl n=%d oneshot", n);
    cases += sweep(g.ranks, {1, n - 1, 7, 100 * n + 3, 4099}, what);
  }
  std::printf("oneshot: %d cases\n", cases);
}

static rr::Call call_of(rr::Coll coll, rr::DType t, int64_t numel) {
  return {coll, t, rr::RedOp::Sum, numel, nullptr, nullptr};
}

// The choice by size, and the fallbacks where a forced algorithm is impossible.
static void test_plan() {
  using rr::Coll;
  using rr::DType;
  rc::nccl::Options o;
  o.nranks = 8;
  auto plan = [&](Coll c, DType t, int64_t numel) { return rc::nccl::plan(call_of(c, t, numel), o); };
  EXPECT(rc::nccl::oneshot_max_bytes(2) == (1u << 20) && rc::nccl::oneshot_max_bytes(8) == (32u << 10),
         "oneshot_max_bytes: n=2 %zu, n=8 %zu", rc::nccl::oneshot_max_bytes(2), rc::nccl::oneshot_max_bytes(8));
  EXPECT(plan(Coll::AllReduce, DType::F32, 1024) == Algo::OneShot, "4 KiB");
  EXPECT(plan(Coll::AllReduce, DType::F32, 8192) == Algo::OneShot, "32 KiB");
  EXPECT(plan(Coll::AllReduce, DType::F32, 8193) == Algo::TwoShot, "32 KiB + 4");
  EXPECT(plan(Coll::AllReduce, DType::F32, 1 << 20) == Algo::TwoShot, "4 MiB");
  EXPECT(plan(Coll::AllReduce, DType::F32, 4 << 20) == Algo::TwoShot, "16 MiB");
  EXPECT(plan(Coll::AllReduce, DType::F32, (4 << 20) + 1) == Algo::Ring, "16 MiB + 4");
  EXPECT(plan(Coll::ReduceScatter, DType::F32, 1024) == Algo::TwoShot, "reduce_scatter 4 KiB");
  EXPECT(plan(Coll::AllGather, DType::F32, 1024) == Algo::TwoShot, "all_gather 4 KiB");
  o.algo = Algo::OneShot;
  o.staging_bytes = 4096;  // one-shot's 7 inputs of 1200 bytes do not fit 8 KiB: two-shot
  EXPECT(plan(Coll::AllReduce, DType::F32, 300) == Algo::TwoShot, "one-shot over the staging");
  EXPECT(plan(Coll::AllReduce, DType::F32, 200) == Algo::OneShot, "one-shot in the staging");
  o.staging_bytes = 16;  // two-shot pieces of 32 / 7 bytes, under 16: the ring
  EXPECT(plan(Coll::AllReduce, DType::F64, 100) == Algo::Ring, "two-shot pieces under 16 bytes");
  EXPECT(plan(Coll::AllGather, DType::F64, 800) == Algo::TwoShot, "all_gather needs no staging");
  o.algo = Algo::Ring;
  EXPECT(plan(Coll::AllReduce, DType::F32, 1) == Algo::Ring, "forced ring");

  // Deterministic mode: one-shot or two-shot for every all_reduce and reduce_scatter, whatever the
  // size and forced algorithm (a forced one-shot that does not fit the staging: two-shot);
  // all_gather as by default; an error where two-shot's pieces would be under one element.
  DeterministicScope det;
  o.staging_bytes = rc::nccl::kDefaultStagingBytes;
  const int64_t big = (rc::nccl::kTwoShotMaxBytes / 4) * 8;
  for (Algo forced : {Algo::Auto, Algo::Ring, Algo::OneShot, Algo::TwoShot}) {
    o.algo = forced;
    for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{8192}, int64_t{8193}, big}) {
      const bool small = numel <= (forced == Algo::OneShot ? int64_t{1} << 20 : int64_t{8192});
      const Algo want = forced != Algo::TwoShot && small ? Algo::OneShot : Algo::TwoShot;
      const Algo ar = plan(Coll::AllReduce, DType::F32, numel), rs = plan(Coll::ReduceScatter, DType::F32, numel);
      EXPECT(ar == want, "deterministic all_reduce of %lld floats, %s forced: %s, want %s", (long long)numel,
             rc::nccl::algo_name(forced), rc::nccl::algo_name(ar), rc::nccl::algo_name(want));
      EXPECT(rs == Algo::TwoShot, "deterministic reduce_scatter of %lld floats, %s forced: %s",
             (long long)numel, rc::nccl::algo_name(forced), rc::nccl::algo_name(rs));
    }
  }
  o.algo = Algo::Ring;
  EXPECT(plan(Coll::AllGather, DType::F32, 1024) == Algo::Ring, "all_gather is not deterministic's");
  o.algo = Algo::Auto;
  EXPECT(plan(Coll::AllGather, DType::F32, big) == Algo::Ring, "all_gather by size");
  auto refusal = [&](Coll c, DType t, int64_t numel) {
    try {
      plan(c, t, numel);
    } catch (const rr::RingError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  o.staging_bytes = 16;  // 32 bytes in 7 pieces: under one element, for every dtype
  for (Coll c : {Coll::AllReduce, Coll::ReduceScatter}) {
    const std::string msg = refusal(c, DType::F64, 800);
    EXPECT(contains(msg, std::string("deterministic ") + rr::coll_name(c)) &&
               contains(msg, "at least 56 bytes") && contains(msg, "RINGREDUCE_NCCL_STAGING_BYTES"),
           "tiny staging: '%s'", msg.c_str());
  }
  EXPECT(plan(Coll::AllGather, DType::F64, 800) == Algo::TwoShot, "all_gather needs no staging");
  o.staging_bytes = 28;  // 56 bytes in 7 pieces of 8, rounded down to 16: none, even for int8
  EXPECT(contains(refusal(Coll::AllReduce, DType::I8, 1), "at least 56 bytes"), "28 bytes of staging");
  o.staging_bytes = 56;  // 112 bytes in 7 pieces of 16
  EXPECT(refusal(Coll::ReduceScatter, DType::F64, 800).empty() &&
             plan(Coll::ReduceScatter, DType::F64, 800) == Algo::TwoShot, "56 bytes of staging");
}

// NCCL groups and reduce launches per rank per call, world 8 (two ranks per emulated device), at
// 4 KiB and 4 MiB float32 all_reduce: auto (one-shot: 1 group; two-shot: 2) against the ring
// (2(N-1) = 14), each plus the call descriptors' group; the ring's N-1 = 7 reduce launches against
// the direct algorithms' one (their rank-order fold of all 8 pieces; one piece of the staging here).
static void test_counts(const Hooks& hooks) {
  setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
  const int n = 8;
  for (Algo a : {Algo::Ring, Algo::Auto}) {
    Group g(n, rc::nccl::kDefaultStagingBytes, 60.0, {0, 1, 2, 3, 0, 1, 2, 3}, a);
    for (int64_t numel : {int64_t{1024}, int64_t{1} << 20}) {
      const uint64_t groups0 = hooks.groups(), launches0 = emu_launches();
      check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, true, "counts");
      const double groups = double(hooks.groups() - groups0) / n;
      const double launches = double(emu_launches() - launches0) / n;
      const Algo used = rc::nccl::plan(g.call(numel, DevBuf(4)), {0, n});
      const Algo got = a == Algo::Ring ? Algo::Ring : used;
      const double want_groups = 1 + (got == Algo::Ring ? 2 * (n - 1) : got == Algo::TwoShot ? 2 : 1);
      std::printf("world %d, %lld B float32 all_reduce, %s: %g NCCL groups, %g reduce launches per call\n",
                  n, (long long)numel * 4, rc::nccl::algo_name(got), groups, launches);
      EXPECT(groups == want_groups, "%s %lld: %g groups", rc::nccl::algo_name(got), (long long)numel, groups);
      EXPECT(launches == (got == Algo::Ring ? n - 1 : 1), "%s %lld: %g launches", rc::nccl::algo_name(got),
             (long long)numel, launches);
    }
  }
  unsetenv("NCCL_MULTI_RANK_GPU_ENABLE");
}

// (2) failures.

// Rank 2 never calls: NCCL waits forever; the watchdog fails the call at the timeout, aborts the
// NCCL communicator (which ends the stream's wait) and the ring refuses later calls. 4096 floats
// with 4 KiB staging: two-shot in auto (in two pieces); 64 floats: one-shot.
static void test_timeout() {
  for (auto [a, numel] : {std::pair{Algo::Ring, 4096}, std::pair{Algo::Auto, 4096}, std::pair{Algo::Auto, 64}}) {
    DevBuf buf(numel * 4);
    Group g(3, 4096, 1.0, {}, a);
    const char* algo = rc::nccl::algo_name(rc::nccl::plan(g.call(numel, buf), {0, 3, 1.0, 4096, "", a}));
    for (int r = 0; r < 2; ++r) g.run(r, numel, buf);
    const double took = g.await_failures({0, 1}, 10);
    g.sync();
    EXPECT(took < 4, "%s: the silent rank was noticed after %.1f s (timeout 1 s)", algo, took);
    for (int r = 0; r < 2; ++r) {
      EXPECT(contains(g.rings[r]->failure(), "timed out after 1 s"), "%s rank %d: '%s'", algo, r,
             g.rings[r]->failure().c_str());
      EXPECT(g.rings[r]->failed_seq() == 1, "%s rank %d: first failed %llu", algo, r,
             (unsigned long long)g.rings[r]->failed_seq());
      EXPECT(run_throws(g.ranks[r], r, buf, "broken by an earlier failure"), "%s rank %d: a broken ring accepted a call", algo, r);
    }
    std::printf("timeout (%s): rank 0 says: %s\n", algo, g.rings[0]->failure().c_str());
  }
}

// Rank 1 calls with another numel after a good call: a receive smaller than its send is NCCL's
// "message truncated" on the receiver only (the stand-in, as NCCL over sockets, completes the
// sender's call), so the ranks' call descriptors must fail the others: every rank fails within its
// timeout, the good call is not counted and the bad one is, and some rank names both calls. The
// rank whose receive meets the larger send may learn it inside its own ncclGroupEnd (run()
// throws) or later (failure()), depending on which rank posted first: both are allowed. Auto:
// one-shot (999 floats in 4 KiB staging) for all; small (the sizes differ in two-shot pieces);
// other algorithms on different ranks (one-shot against two-shot).
static void test_size_mismatch() {
  struct Case {
    Algo algo;
    int64_t good, bad, others;
  };
  for (const Case& k : {Case{Algo::Ring, 999, 1001, 998}, Case{Algo::Auto, 999, 1001, 998},
                        Case{Algo::Auto, 60, 61, 59}, Case{Algo::TwoShot, 999, 1001, 998},
                        Case{Algo::Auto, 999, 2000, 998}}) {
    DevBuf buf(2000 * 4);
    Group g(3, 4096, 2.0, {}, k.algo);
    const rc::nccl::Options o{0, 3, 2.0, 4096, "", k.algo};
    char what[96];
    std::snprintf(what, sizeof what, "%s/%s", rc::nccl::algo_name(rc::nccl::plan(g.call(k.bad, buf), o)),
                  rc::nccl::algo_name(rc::nccl::plan(g.call(k.others, buf), o)));
    for (int r = 0; r < 3; ++r) g.run(r, k.good, buf);
    g.sync();
    for (int r = 0; r < 3; ++r) {
      try {
        g.run(r, r == 1 ? k.bad : k.others, buf);
      } catch (const rr::RingError& e) {
        EXPECT(!g.rings[r]->failure().empty(), "%s: rank %d threw '%s' but recorded no failure", what, r, e.what());
      }
    }
    g.await_failures({0, 1, 2}, 15);
    g.sync();
    bool named = false;
    for (int r = 0; r < 3; ++r) {
      const std::string f = g.rings[r]->failure();
      EXPECT(!f.empty(), "%s: rank %d did not fail", what, r);
      named |= contains(f, "mismatched collective calls: rank ") &&
               (contains(f, "numel=1001") || contains(f, "numel=61") || contains(f, "numel=2000"));
      EXPECT(g.rings[r]->failed_seq() == 2, "%s: rank %d: first failed %llu (%s)", what, r,
             (unsigned long long)g.rings[r]->failed_seq(), f.c_str());
    }
    EXPECT(named, "%s: no rank named the mismatched calls", what);
  }
}

// Four ranks, rank 1 forced onto the ring and the others on one-shot: their first groups
// talk to different peers (the ring to its neighbours only) and block each other, as NCCL's
// kernels wait for a receive nobody sends. The call descriptors travel in a group of their own,
// with every peer, ahead of the data: every rank names the mismatch within a second or two, long
// before the 30 s timeout (when they rode in the first data group, the blocked group held them
// back and the timeout was the only error).
static void test_mismatch_blocks_the_first_group() {
  const int64_t numel = 64;
  DevBuf buf(numel * 4);
  Group g(4, 4096, 30.0, {}, Algo::Auto, {Algo::Auto, Algo::Ring, Algo::Auto, Algo::Auto});
  const rc::nccl::Options o{0, 4, 30.0, 4096, "", Algo::Auto};
  EXPECT(rc::nccl::plan(g.call(numel, buf), o) == Algo::OneShot, "auto is not one-shot");
  for (int r = 0; r < 4; ++r) {
    try {
      g.run(r, numel, buf);
    } catch (const rr::RingError&) {
    }
  }
  const double took = g.await_failures({0, 1, 2, 3}, 20);
  g.sync();
  EXPECT(took < 10, "the ranks failed after %.1f s (timeout 30 s)", took);
  for (int r = 0; r < 4; ++r) {
    const std::string f = g.rings[r]->failure();
    EXPECT(contains(f, "mismatched collective calls: rank "), "rank %d: '%s'", r, f.c_str());
  }
  std::printf("mismatch in the first group: rank 0 says: %s\n", g.rings[0]->failure().c_str());
}

// An NCCL call that fails inside the group: the ring raises, and the group is ended anyway (a group
// left open would defer every later NCCL call of the thread, torch's included).
static void test_failure_inside_group(const Hooks& hooks) {
  DevBuf buf(64 * 4);
  Group g(2, 4096, 5.0);
  hooks.fail_next("ncclRecv", ncclInvalidArgument);
  bool threw = false;
  try {
    g.run(0, 64, buf);
  } catch (const rr::RingError& e) {
    threw = contains(e.what(), "ncclRecv failed");
    EXPECT(threw, "'%s'", e.what());
  }
  EXPECT(threw, "a failed ncclRecv did not raise");
  EXPECT(hooks.group_depth() == 0, "the NCCL group was left open (depth %d)", hooks.group_depth());
  EXPECT(g.rings[0]->failed_seq() == 1, "first failed %llu", (unsigned long long)g.rings[0]->failed_seq());
}

static void sleep_on_stream(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(reinterpret_cast<intptr_t>(ms)));
}

// The stream faults (a sticky CUDA error, as after an illegal address) after the call was enqueued:
// the watchdog must report the CUDA error, not count the call as done.
static void test_cuda_fault() {
  DevBuf buf(4096 * 4);
  Group g(2, 4096, 3.0);
  for (int r = 0; r < 2; ++r) g.run(r, 4096, buf);
  g.sync();
  RR_CUDA_CHECK(cudaSetDevice(g.ranks[0].device));
  // Keep the stream busy so that the call below is enqueued before the fault takes effect.
  RR_CUDA_CHECK(cudaLaunchHostFunc(g.ranks[0].stream, sleep_on_stream, reinterpret_cast<void*>(300)));
  RR_CUDA_CHECK(emu_inject_fault(g.ranks[0].stream, cudaErrorIllegalAddress));
  for (int r = 0; r < 2; ++r) g.run(r, 4096, buf);
  const double took = g.await_failures({0}, 10);
  const std::string f = g.rings[0]->failure();
  EXPECT(contains(f, "cudaErrorIllegalAddress") && contains(f, "collective #2"), "rank 0: '%s'", f.c_str());
  EXPECT(took < 2.5, "the fault was reported after %.1f s (timeout 3 s)", took);
  EXPECT(g.rings[0]->failed_seq() == 2, "first failed %llu", (unsigned long long)g.rings[0]->failed_seq());
  g.await_failures({1}, 10);  // rank 1 times out waiting for rank 0
  emu_clear_fault(g.ranks[0].device);
}

// Two ranks on one GPU: NCCL refuses (ncclInvalidUsage) unless NCCL_MULTI_RANK_GPU_ENABLE=1; the
// error says so, and with the variable set the ring works.
static void test_shared_gpu() {
  unsetenv("NCCL_MULTI_RANK_GPU_ENABLE");
  std::string msg;
  try {
    Group g(2, 4096, 5.0, {0, 0});
  } catch (const rr::RingError& e) {
    msg = e.what();
  }
  EXPECT(contains(msg, "Duplicate GPU") && contains(msg, "NCCL_MULTI_RANK_GPU_ENABLE=1") &&
             contains(msg, "RINGREDUCE_TRANSPORT=p2p"),
         "two ranks on one GPU: '%s'", msg.c_str());
  setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
  {
    Group g(2, 4096, 5.0, {0, 0});
    check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 1001, true, "shared gpu");
  }
  unsetenv("NCCL_MULTI_RANK_GPU_ENABLE");
  std::printf("shared gpu: %s\n", msg.c_str());
}

// A process that plays a peer rank's until the test SIGKILLs it.
static pid_t peer_process() {
  const pid_t child = fork();
  if (child == 0) {
    pause();
    _exit(0);
  }
  return child;
}

// Rank 2's process dies while ranks 0 and 1 wait for it: both fail within about a second.
static void test_dead_peer() {
  const pid_t child = peer_process();
  DevBuf buf(4096 * 4);
  Group g(3, 4096, 30.0);
  for (int r = 0; r < 2; ++r) g.rings[r]->watch_peers({{2, child}});
  for (int r = 0; r < 2; ++r) g.run(r, 4096, buf);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  kill(child, SIGKILL);
  const double took = g.await_failures({0, 1}, 10);
  waitpid(child, nullptr, 0);
  g.sync();
  EXPECT(took < 2, "the dead peer was noticed after %.1f s", took);
  for (int r = 0; r < 2; ++r)
    EXPECT(contains(g.rings[r]->failure(), "peer rank 2 (pid " + std::to_string(child) + ") died"),
           "rank %d: '%s'", r, g.rings[r]->failure().c_str());
}

// After a dead peer, the survivors go on in a fresh group of two beside the broken one, as
// shrink_group's new backend does (nothing of the parent reused: a new unique id): every
// collective, dtype and op exact there; then the broken group still closes.
static void test_survivors_after_dead_peer() {
  const pid_t child = peer_process();
  DevBuf buf(4096 * 4);
  auto broken = std::make_unique<Group>(3, 4096, 30.0);
  for (int r = 0; r < 2; ++r) broken->rings[r]->watch_peers({{2, child}});
  for (int r = 0; r < 2; ++r) broken->run(r, 4096, buf);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  kill(child, SIGKILL);
  const double took = broken->await_failures({0, 1}, 10);
  waitpid(child, nullptr, 0);
  broken->sync();
  EXPECT(took < 2, "the dead peer was noticed after %.1f s", took);
  const auto t0 = Clock::now();
  {
    Group fresh(2, rc::nccl::kDefaultStagingBytes, 20.0);
    const int cases = sweep(fresh.ranks, {1, 7, 4099, 3 * 65536 + 5}, "nccl survivors");
    EXPECT(cases > 0, "no case ran");
    for (int r = 0; r < 2; ++r)
      EXPECT(fresh.rings[r]->failure().empty(), "fresh rank %d: '%s'", r,
             fresh.rings[r]->failure().c_str());
    for (int r = 0; r < 2; ++r)
      EXPECT(!broken->rings[r]->failure().empty(), "broken rank %d forgot its failure", r);
    std::printf("survivors: %d cases (%.1f s)\n", cases, seconds_since(t0));
  }
  broken.reset();
}

// abort() while a call waits: the NCCL communicator is aborted, the stream is free at once.
static void test_abort() {
  DevBuf buf(4096 * 4);
  Group g(3, 4096, 30.0);
  for (int r = 0; r < 2; ++r) g.run(r, 4096, buf);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const auto t0 = Clock::now();
  g.rings[0]->abort("test abort");
  cudaSetDevice(g.ranks[0].device);
  cudaStreamSynchronize(g.ranks[0].stream);
  EXPECT(seconds_since(t0) < 2, "abort took %.1f s", seconds_since(t0));
  EXPECT(contains(g.rings[0]->failure(), "test abort"), "'%s'", g.rings[0]->failure().c_str());
  EXPECT(g.rings[0]->failed_seq() == 1, "first failed %llu", (unsigned long long)g.rings[0]->failed_seq());
  g.rings[1]->abort("end of test");
}

// Inside a CUDA graph capture the nccl transport refuses (its host side cannot follow replays),
// with a message that says what to do; outside it the ring works as before.
static void test_capture_refused() {
  DevBuf buf(64 * 4);
  Group g(2, 4096, 5.0);
  emu_set_capturing(g.ranks[0].stream, 1);
  bool refused = false;
  try {
    g.run(0, 64, buf);
  } catch (const rr::RingError& e) {
    refused = contains(e.what(), "CUDA graph capture") && contains(e.what(), "RINGREDUCE_TRANSPORT=p2p");
    EXPECT(refused, "'%s'", e.what());
  }
  EXPECT(refused, "the nccl ring ran inside a capture");
  emu_set_capturing(g.ranks[0].stream, 0);
  EXPECT(g.rings[0]->failure().empty(), "a refused capture broke the ring: %s", g.rings[0]->failure().c_str());
  check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 64, true, "after capture");
}

// Another thread captures a CUDA graph in global mode (torch.cuda.graph's default) while this
// ring works: its calls and watchdog query their events (retire, timeouts) in relaxed capture mode,
// so the capture survives (issue 51, finding 2; the emulator invalidates a capture on a query
// from a thread in global mode, as CUDA does).
static void test_watchdog_spares_a_capture() {
  DevBuf buf(4096 * 4);
  Group g(2, 4096, 5.0);
  cudaStream_t capture;
  RR_CUDA_CHECK(cudaSetDevice(g.ranks[0].device));
  RR_CUDA_CHECK(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking));
  emu_set_capturing(capture, 1);
  for (int i = 0; i < 3; ++i) {
    check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 4096, true,
                     "beside another thread's capture");
    std::this_thread::sleep_for(rc::nccl::kWatchPeriod * 2);  // the watchdog looks, several times
  }
  const int invalidated = emu_capture_invalidated(capture);
  emu_set_capturing(capture, 0);
  cudaGetLastError();
  EXPECT(!invalidated, "an event query of the nccl transport invalidated another thread's graph capture");
  cudaStreamDestroy(capture);
}

// (3) deterministic mode.

// Worlds 2-5 (5: two ranks on device 0), every forced algorithm (the ring runs as auto) with 64
// bytes of staging (one-shot only for the smallest sizes, two-shot pieces of 16-64 bytes: a call in
// many groups), and auto with the default staging: the bits of the rank-order reference. Then the
// same communicator runs a default-mode call (the ring, when forced), in step.
static void test_deterministic() {
  setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 1);
  const auto t0 = Clock::now();
  int cases = 0;
  DetTeeth t16, t32;
  for (int n = 2; n <= 5; ++n) {
    std::vector<int> devices;
    for (int r = 0; r < n; ++r) devices.push_back(r % 4);
    struct Config { Algo algo; size_t staging; };
    for (const Config& k : {Config{Algo::Ring, 64}, Config{Algo::OneShot, 64}, Config{Algo::TwoShot, 64},
                            Config{Algo::Auto, 64}, Config{Algo::Auto, rc::nccl::kDefaultStagingBytes}}) {
      Group g(n, k.staging, 20.0, devices, k.algo);
      char what[96];
      std::snprintf(what, sizeof what, "deterministic nccl n=%d %s staging=%zu", n,
                    rc::nccl::algo_name(k.algo), k.staging);
      {
        DeterministicScope det;
        cases += deterministic_sweep(g.ranks, {1, 7, 333}, what, n >= 3 ? &t16 : nullptr,
                                     n >= 3 ? &t32 : nullptr);
      }
      check_collective(g.ranks, rr::Coll::AllReduce, rr::DType::F16, rr::RedOp::Sum, 1001, true, what);
      check_collective(g.ranks, rr::Coll::ReduceScatter, rr::DType::F32, rr::RedOp::Avg, 77 * n, false, what);
    }
  }
  unsetenv("NCCL_MULTI_RANK_GPU_ENABLE");
  expect_teeth(t16, t32, "deterministic nccl");
  std::printf("deterministic nccl: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

// Staging too small for two-shot's pieces (16 bytes for 4 ranks): a deterministic all_reduce or
// reduce_scatter raises the error on every rank, before the call is counted; all_gather and
// default-mode calls (the ring) still run, in step.
static void test_deterministic_tiny_staging() {
  const int n = 4;
  Group g(n, 16, 10.0);
  DevBuf buf(64 * 8);
  std::string first;
  {
    DeterministicScope det;
    for (rr::Coll coll : {rr::Coll::AllReduce, rr::Coll::ReduceScatter})
      for (int r = 0; r < n; ++r) {
        const uint64_t seq = g.rings[r]->op_seq();
        std::string msg;
        try {
          cudaSetDevice(g.ranks[r].device);
          g.rings[r]->run({coll, rr::DType::F64, rr::RedOp::Sum, 64, buf.p, buf.p}, g.ranks[r].stream);
        } catch (const rr::RingError& e) {
          msg = e.what();
        }
        EXPECT(contains(msg, std::string("deterministic ") + rr::coll_name(coll)) &&
                   contains(msg, "at least 24 bytes") && contains(msg, "RINGREDUCE_NCCL_STAGING_BYTES"),
               "rank %d %s: '%s'", r, rr::coll_name(coll), msg.c_str());
        EXPECT(g.rings[r]->op_seq() == seq, "rank %d: the refused call was counted", r);
        EXPECT(g.rings[r]->failure().empty(), "rank %d: the refusal broke the ring", r);
        if (first.empty()) first = msg;
      }
    check_collective(g.ranks, rr::Coll::AllGather, rr::DType::F32, rr::RedOp::Sum, 400, false,
                     "deterministic all_gather, tiny staging");
  }
  check_collective(g.ranks, rr::Coll::ReduceScatter, rr::DType::F32, rr::RedOp::Sum, 400, false,
                   "default reduce_scatter after the refusal");
  std::printf("deterministic with tiny staging: %s\n", first.c_str());
}

int main(int argc, char** argv) {
  emu_set_device_count(4);
  try {
    const Hooks hooks;
    std::printf("NCCL stand-in version %d at %s\n", rc::nccl::version(kLib), kLib);
    run_test(argc, argv, "test_sweep", [&] { test_sweep(); });
    run_test(argc, argv, "test_oneshot", [&] { test_oneshot(); });
    run_test(argc, argv, "test_plan", [&] { test_plan(); });
    run_test(argc, argv, "test_counts", [&] { test_counts(hooks); });
    run_test(argc, argv, "test_timeout", [&] { test_timeout(); });
    run_test(argc, argv, "test_size_mismatch", [&] { test_size_mismatch(); });
    run_test(argc, argv, "test_mismatch_blocks_the_first_group",
             [&] { test_mismatch_blocks_the_first_group(); });
    run_test(argc, argv, "test_failure_inside_group", [&] { test_failure_inside_group(hooks); });
    run_test(argc, argv, "test_cuda_fault", [&] { test_cuda_fault(); });
    run_test(argc, argv, "test_shared_gpu", [&] { test_shared_gpu(); });
    run_test(argc, argv, "test_dead_peer", [&] { test_dead_peer(); });
    run_test(argc, argv, "test_survivors_after_dead_peer", [&] { test_survivors_after_dead_peer(); });
    run_test(argc, argv, "test_abort", [&] { test_abort(); });
    run_test(argc, argv, "test_capture_refused", [&] { test_capture_refused(); });
    run_test(argc, argv, "test_watchdog_spares_a_capture", [&] { test_watchdog_spares_a_capture(); });
    run_test(argc, argv, "test_deterministic", [&] { test_deterministic(); });
    run_test(argc, argv, "test_deterministic_tiny_staging", [&] { test_deterministic_tiny_staging(); });
  } catch (const std::exception& e) {
    std::printf("FAIL: exception: %s\n", e.what());
    return 1;
  }
  std::printf(g_failures ? "test_nccl_ring: %d failures\n" : "test_nccl_ring: OK\n", g_failures);
  return g_failures ? 1 : 0;
}
