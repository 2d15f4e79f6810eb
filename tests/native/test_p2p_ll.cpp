// Native test of the LL one-shot: every dtype and op, worlds 2-8, calls back to back, the flag's
// wrap, a mismatch with the workspace's one-shot; weak memory.
// Built against the emulated device in every CI run (test_p2p_ll_emu; ranks are threads, areas are
// shared through the emulated IPC) and by nvcc where a toolkit is found (test_p2p_ll; on a GPU,
// ranks are streams of one process). Exits 0 with a message when there is no CUDA device.
// `test_p2p_ll_emu NAME...` runs the tests whose names contain a NAME (weak_* only so); without
// names, all but weak_*.
#include "p2p_check.h"

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

int main(int argc, char** argv) {
  return p2p_main("test_p2p_ll", [&] {
    run_test(argc, argv, "test_ll", [&] { test_ll(); });
    run_test(argc, argv, "test_ll_back_to_back", [&] { test_ll_back_to_back(); });
    run_test(argc, argv, "test_ll_flag_wrap", [&] { test_ll_flag_wrap(); });
    run_test(argc, argv, "test_ll_mismatch_with_the_workspace", [&] { test_ll_mismatch_with_the_workspace(); });
#ifdef RINGREDUCE_EMU
    run_test(argc, argv, "weak_ll", [&] {
      weak_sweep(rc::p2p::Algo::LL);
      for (uint64_t seed : {1, 2, 3}) {  // ahead into the other parity while peers read
        WeakScope weak(seed);
        ll_back_to_back(3, 300, 12);
      }
    });
#endif
  });
}
