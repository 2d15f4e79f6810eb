// The shared-memory ring with threads playing the ranks: every collective x dtype x op x world size
// x edge sizes against an exact reference, bitwise agreement across ranks, tiny slices (many
// pipeline steps), mismatched calls and timeouts raising on every rank.
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "check.h"
#include "cpu/reduce.h"
#include "shm/protocol.h"

using namespace ringreduce;
using shm::Protocol;

// The algorithm the next with_ring() rings use (Options::algo), and a per-rank override.
static shm::Algo g_algo = shm::Algo::Ring;
static std::function<void(int, shm::Options&)> g_tweak;

// One zeroed, initialised segment; each thread builds its own Protocol on it, as each process would.
static void with_ring(int n, size_t slice_bytes, double timeout_s,
                      const std::function<void(int, Protocol&)>& body) {
  const size_t bytes = shm::segment_bytes(n, slice_bytes);
  void* mem = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  std::memset(mem, 0, bytes);
  shm::init_segment(mem, n, slice_bytes);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      shm::Options opt;
      opt.rank = r;
      opt.nranks = n;
      opt.timeout_s = timeout_s;
      opt.spin_ns = 1000;  // threads > cores here: sleep early
      opt.yield_ns = 20000;
      opt.algo = g_algo;
      opt.oneshot_max_bytes = 4096;
      opt.cma_block_bytes = slice_bytes;  // as ringreduce/_shm.py's default: many reads per chunk
      if (g_tweak) g_tweak(r, opt);
      Protocol ring(mem, bytes, opt);
      body(r, ring);
    });
  }
  for (auto& t : threads) t.join();
  std::free(mem);
}

// Element i of rank r: a small integer, exact in every dtype, products of 5 stay in int8.
static int value(int r, int64_t i) { return static_cast<int>((i * 7 + r * 3) % 5) - 2; }

static double combine(RedOp op, double a, double b) {
  switch (op) {
    case RedOp::Sum: case RedOp::Avg: return a + b;
    case RedOp::Prod: return a * b;
    case RedOp::Min: return std::min(a, b);
    case RedOp::Max: return std::max(a, b);
    default: return 0;
  }
}

// Stores a double into a buffer of dtype t (small integers: exact everywhere).
static void put(DType t, void* p, int64_t i, double v) {
  switch (t) {
    case DType::F32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::F64: static_cast<double*>(p)[i] = v; break;
    case DType::F16: static_cast<uint16_t*>(p)[i] = cpu::float_to_half(static_cast<float>(v)); break;
    case DType::BF16: static_cast<uint16_t*>(p)[i] = cpu::float_to_bf16(static_cast<float>(v)); break;
    case DType::I8: static_cast<int8_t*>(p)[i] = static_cast<int8_t>(v); break;
    case DType::U8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(static_cast<int>(v)); break;
    case DType::I32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); break;
    case DType::I64: static_cast<int64_t*>(p)[i] = static_cast<int64_t>(v); break;
    default: break;
  }
}

// The expected element: reduce the ranks' values, finish AVG the way the kernels do.
static void expect_at(DType t, RedOp op, int n, int64_t i, void* out) {
  // Integers wrap in their own type: reduce in that type by running the CPU kernel on scalars
  // would be circular; instead reduce in double (no overflow for these values) and wrap at the end.
  double acc = value(0, i);
  if (t == DType::U8) acc = static_cast<uint8_t>(value(0, i));
  for (int r = 1; r < n; ++r) {
    double v = value(r, i);
    if (t == DType::U8) v = static_cast<uint8_t>(value(r, i));
    acc = combine(op, acc, v);
  }
  if (op == RedOp::Avg) {
    if (dtype_is_float(t)) {
      if (t == DType::F64) acc = acc / n;
      else acc = static_cast<double>(static_cast<float>(acc) / static_cast<float>(n));
      if (t == DType::F16) acc = cpu::half_to_float(cpu::float_to_half(static_cast<float>(acc)));
      if (t == DType::BF16) acc = cpu::bf16_to_float(cpu::float_to_bf16(static_cast<float>(acc)));
    } else {
      // wrap the sum to the type first, then truncate toward zero
      int64_t s = static_cast<int64_t>(acc);
      if (t == DType::I8) s = static_cast<int8_t>(s);
      if (t == DType::U8) s = static_cast<uint8_t>(s);
      if (t == DType::I32) s = static_cast<int32_t>(s);
      acc = static_cast<double>(s / n);
    }
  } else if (t == DType::U8 || t == DType::I8) {
    acc = static_cast<double>(static_cast<int64_t>(acc) & 0xff);  // wrap: put() reinterprets
    if (t == DType::I8) acc = static_cast<int8_t>(static_cast<uint8_t>(static_cast<int64_t>(acc)));
  }
  put(t, out, 0, acc);
}

static const DType kTypes[] = {DType::F32, DType::F64, DType::F16, DType::BF16,
                               DType::I8,  DType::U8,  DType::I32, DType::I64};

static void sweep(Coll coll, int n, size_t slice_bytes) {
  std::vector<int64_t> sizes = {0, 1, n - 1, n + 1, 1001, 12345};
  if (coll != Coll::AllReduce) sizes = {0, 1, 3, 257};  // per-rank elements
  std::vector<std::vector<char>> out(n);
  for (DType t : kTypes) {
    const size_t es = dtype_size(t);
    for (int opi = 0; opi < static_cast<int>(RedOp::kCount); ++opi) {
      const RedOp op = coll == Coll::AllGather ? RedOp::Sum : RedOp(opi);
      if (coll == Coll::AllGather && opi > 0) break;
      for (int64_t sz : sizes) {
        const int64_t numel = coll == Coll::AllReduce ? sz : sz * n;
        with_ring(n, slice_bytes, 30.0, [&](int r, Protocol& ring) {
          std::vector<char> in(std::max<int64_t>(1, numel) * es);
          const int64_t in_n = coll == Coll::AllGather ? sz : numel;
          for (int64_t i = 0; i < in_n; ++i)
            put(t, in.data(), i, value(r, coll == Coll::AllGather ? r * sz + i : i));
          std::vector<char> res(std::max<int64_t>(1, numel) * es);
          void* dst = coll == Coll::AllReduce ? in.data() : res.data();
          ring.run({coll, t, op, numel, in.data(), dst});
          const int64_t out_n = coll == Coll::ReduceScatter ? sz : numel;
          out[r].assign(static_cast<char*>(dst), static_cast<char*>(dst) + out_n * es);
        });
        const int64_t out_n = coll == Coll::ReduceScatter ? sz : numel;
        for (int r = 0; r < n; ++r) {
          for (int64_t i = 0; i < out_n; ++i) {
            char want[8] = {0};
            if (coll == Coll::AllGather) put(t, want, 0, value(static_cast<int>(i / sz), i));
            else expect_at(t, op, n, coll == Coll::ReduceScatter ? r * sz + i : i, want);
            if (std::memcmp(out[r].data() + i * es, want, es) != 0) {
              CHECK(false, "%s/%s n=%d %s %s numel=%lld slice=%zu rank %d element %lld wrong",
                    coll_name(coll), shm::algo_name(g_algo), n, dtype_name(t), op_name(op),
                    (long long)numel, slice_bytes, r, (long long)i);
              break;
            }
          }
          if (coll == Coll::AllReduce)
            CHECK(out[r] == out[0], "all_reduce ranks 0 and %d differ (%s %s)", r, dtype_name(t),
                  op_name(op));
        }
      }
    }
  }
}

// Large float data with rounding: results still bitwise identical across ranks.
static void bitwise_floats() {
  const int n = 4;
  const int64_t numel = 300001;
  std::vector<std::vector<float>> res(n);
  with_ring(n, 4096, 30.0, [&](int r, Protocol& ring) {
    std::mt19937 rng(r);
    std::uniform_real_distribution<float> u(-1, 1);
    std::vector<float> x(numel);
    for (auto& v : x) v = u(rng);
    ring.run({Coll::AllReduce, DType::F32, RedOp::Sum, numel, x.data(), x.data()});
    res[r] = x;
  });
  for (int r = 1; r < n; ++r) CHECK(res[r] == res[0], "rank %d differs bitwise", r);
}

static void mismatch() {
  const int n = 3;
  std::atomic<int> raised{0}, mentioned{0};
  with_ring(n, 1024, 10.0, [&](int r, Protocol& ring) {
    std::vector<float> x(100, 1.0f);
    const int64_t numel = r == 2 ? 90 : 100;
    try {
      ring.run({Coll::AllReduce, DType::F32, RedOp::Sum, numel, x.data(), x.data()});
    } catch (const RingError& e) {
      ++raised;
      if (std::string(e.what()).find("mismatched") != std::string::npos) ++mentioned;
    }
    // Broken afterwards: the next call raises at once.
    try {
      ring.run({Coll::AllReduce, DType::F32, RedOp::Sum, 100, x.data(), x.data()});
    } catch (const RingError&) {
      ++raised;
    }
  });
  CHECK(raised == 2 * n, "every rank raises twice, got %d", raised.load());
  CHECK(mentioned == n, "every message names the mismatch, got %d", mentioned.load());
}

// Calls of every size in a row on one ring, the algorithm changing between them (auto: one-shot up
// to 4 KiB): slots written by one-shot (read by every rank) are reused by the ring and back, many
// times around the FIFO; every result exact and the same on every rank.
static void alternating_algorithms() {
  const int n = 4;
  std::vector<std::vector<float>> res(n);
  g_algo = shm::Algo::Auto;
  with_ring(n, 256, 30.0, [&](int r, Protocol& ring) {
    const int64_t sizes[] = {1, 1000, 3, 50, 1024, 1025, 7, 4000, 2, 999};
    for (int rep = 0; rep < 20; ++rep) {
      for (int64_t numel : sizes) {
        std::vector<float> x(numel);
        for (int64_t i = 0; i < numel; ++i) x[i] = static_cast<float>(value(r, i + rep));
        const Call c{Coll::AllReduce, DType::F32, RedOp::Sum, numel, x.data(), x.data()};
        const bool want_oneshot = numel * 4 <= 4096;
        CHECK((ring.choose(c) == shm::Algo::OneShot) == want_oneshot, "auto chose %s for %lld floats",
              shm::algo_name(ring.choose(c)), (long long)numel);
        ring.run(c);
        for (int64_t i = 0; i < numel; ++i) {
          double want = 0;
          for (int k = 0; k < n; ++k) want += value(k, i + rep);
          if (x[i] != static_cast<float>(want)) {
            CHECK(false, "rank %d rep %d numel %lld element %lld: %g, want %g", r, rep,
                  (long long)numel, (long long)i, x[i], want);
            return;
          }
        }
        if (rep == 19 && numel == 999) res[r] = x;
      }
    }
  });
  g_algo = shm::Algo::Ring;
  for (int r = 1; r < n; ++r) CHECK(res[r] == res[0], "rank %d differs", r);
}

// Auto with measured steps (one-shot up to 4 KiB, the ring, two-shot from 8 KiB, cma from 32 KiB,
// the ring again from 128 KiB): every algorithm in turn around the FIFO, narrow and wide messages
// and cma's reads mixed (in slice-sized blocks, and whole chunks from 64 KiB); exact results, the
// same bits on every rank; reduce_scatter ignores steps.
static void alternating_steps() {
  const int n = 3;
  std::vector<std::vector<float>> res(n);
  g_algo = shm::Algo::Auto;
  g_tweak = [](int, shm::Options& o) {
    o.steps = {{8 << 10, shm::Algo::TwoShot}, {32 << 10, shm::Algo::Cma}, {64 << 10, shm::Algo::Cma, true},
               {128 << 10, shm::Algo::Ring}};
  };
  with_ring(n, 512, 30.0, [&](int r, Protocol& ring) {
    const int64_t sizes[] = {1, 1500, 3000, 9000, 40000, 7, 1025, 2048, 8191, 8192, 16385, 32767, 32768, 33000};
    for (int rep = 0; rep < 6; ++rep) {
      for (int64_t numel : sizes) {
        std::vector<float> x(numel);
        for (int64_t i = 0; i < numel; ++i) x[i] = static_cast<float>(value(r, i + rep));
        const Call c{Coll::AllReduce, DType::F32, RedOp::Sum, numel, x.data(), x.data()};
        const int64_t b = numel * 4;
        const shm::Algo want = b <= 4096 ? shm::Algo::OneShot : b < (8 << 10) ? shm::Algo::Ring
                               : b < (32 << 10) ? shm::Algo::TwoShot : b < (128 << 10) ? shm::Algo::Cma
                                                                      : shm::Algo::Ring;
        CHECK(ring.choose(c) == want, "auto with steps chose %s for %lld floats, want %s",
              shm::algo_name(ring.choose(c)), (long long)numel, shm::algo_name(want));
        if (want == shm::Algo::Cma)
          CHECK(ring.cma_block(c) == (b >= (64 << 10) ? 0u : 512u), "cma's block for %lld floats: %llu",
                (long long)numel, (unsigned long long)ring.cma_block(c));
        ring.run(c);
        for (int64_t i = 0; i < numel; ++i) {
          double want_v = 0;
          for (int k = 0; k < n; ++k) want_v += value(k, i + rep);
          if (x[i] != static_cast<float>(want_v)) {
            CHECK(false, "rank %d rep %d numel %lld element %lld: %g, want %g", r, rep,
                  (long long)numel, (long long)i, x[i], want_v);
            return;
          }
        }
        if (rep == 5 && numel == 9000) res[r] = x;
      }
    }
    const Call rs{Coll::ReduceScatter, DType::F32, RedOp::Sum, 30000, nullptr, nullptr};
    CHECK(ring.choose(rs) == shm::Algo::Ring, "reduce_scatter ignores the steps");
    CHECK(ring.cma_probe().empty(), "threads of one process read each other: %s", ring.cma_probe().c_str());
  });
  g_tweak = nullptr;
  g_algo = shm::Algo::Ring;
  for (int r = 1; r < n; ++r) CHECK(res[r] == res[0], "rank %d differs", r);
}

// Deterministic mode: auto picks one-shot (up to 4 KiB here) or two-shot, whatever Options::algo
// says; calls alternate between them around the FIFO; exact results, the same on every rank.
static void alternating_deterministic() {
  const int n = 3;
  std::vector<std::vector<float>> res(n);
  set_deterministic(true);
  with_ring(n, 512, 30.0, [&](int r, Protocol& ring) {
    const int64_t sizes[] = {5000, 1, 1024, 1025, 3, 70001, 2};
    for (int rep = 0; rep < 10; ++rep) {
      for (int64_t numel : sizes) {
        std::vector<float> x(numel);
        for (int64_t i = 0; i < numel; ++i) x[i] = static_cast<float>(value(r, i + rep));
        const Call c{Coll::AllReduce, DType::F32, RedOp::Sum, numel, x.data(), x.data()};
        const shm::Algo want = numel * 4 <= 4096 ? shm::Algo::OneShot : shm::Algo::TwoShot;
        CHECK(ring.choose(c) == want, "deterministic chose %s for %lld floats",
              shm::algo_name(ring.choose(c)), (long long)numel);
        ring.run(c);
        for (int64_t i = 0; i < numel; ++i) {
          double want_v = 0;
          for (int k = 0; k < n; ++k) want_v += value(k, i + rep);
          if (x[i] != static_cast<float>(want_v)) {
            CHECK(false, "rank %d rep %d numel %lld element %lld: %g, want %g", r, rep,
                  (long long)numel, (long long)i, x[i], want_v);
            return;
          }
        }
        if (rep == 9 && numel == 70001) res[r] = x;
      }
    }
    const Call rs{Coll::ReduceScatter, DType::F32, RedOp::Sum, 30, nullptr, nullptr};
    CHECK(ring.choose(rs) == shm::Algo::TwoShot, "deterministic reduce_scatter runs two-shot");
  });
  set_deterministic(false);
  for (int r = 1; r < n; ++r) CHECK(res[r] == res[0], "rank %d differs", r);
}

// Ranks that would run different algorithms for what they call (a different collective, or a
// different RINGREDUCE_ALGO) raise on every rank, naming the mismatch, within the timeout.
static void algorithm_mismatch(bool by_env) {
  const int n = 3;
  std::atomic<int> raised{0}, named{0};
  g_algo = shm::Algo::Auto;
  if (by_env) g_tweak = [](int r, shm::Options& o) { o.algo = r == 1 ? shm::Algo::Ring : shm::Algo::OneShot; };
  const auto t0 = std::chrono::steady_clock::now();
  with_ring(n, 1024, 10.0, [&](int r, Protocol& ring) {
    std::vector<float> x(12, 1.0f), y(4);
    try {
      if (!by_env && r == 2)  // reduce_scatter runs on the ring, the others' small all_reduce one-shot
        ring.run({Coll::ReduceScatter, DType::F32, RedOp::Sum, 12, x.data(), y.data()});
      else
        ring.run({Coll::AllReduce, DType::F32, RedOp::Sum, 12, x.data(), x.data()});
    } catch (const RingError& e) {
      ++raised;
      const std::string w = e.what();
      if (w.find(by_env ? "RINGREDUCE_ALGO" : "mismatched") != std::string::npos ||
          w.find("aborted the group") != std::string::npos)
        ++named;
    }
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  g_algo = shm::Algo::Ring;
  g_tweak = nullptr;
  CHECK(raised == n, "every rank raises (%s), got %d", by_env ? "env" : "collective", raised.load());
  CHECK(named == n, "every message names the mismatch or the abort, got %d", named.load());
  CHECK(secs < 5.0, "raised well within the timeout: %.2f s", secs);
}

// Pool: every rank's tensor in a buffer every rank sees (here: one process, so plain pointers), at
// an offset of its own; the all-reduce reads the peers' tensors in place. Exact, the same bits on
// every rank. A rank without the buffer fails every rank, naming the cause.
static void pool_sweep(int n) {
  const std::vector<int64_t> sizes = {0, 1, n - 1, n + 1, 1001, 12345};
  const int64_t max_numel = 12345;
  for (DType t : kTypes) {
    const size_t es = dtype_size(t);
    const uint64_t bytes = (max_numel + 8 * n) * es;
    std::vector<std::vector<char>> bufs(n, std::vector<char>(bytes));
    std::vector<char*> bases(n);
    for (int r = 0; r < n; ++r) bases[r] = bufs[r].data();
    for (int opi = 0; opi < static_cast<int>(RedOp::kCount); ++opi) {
      const RedOp op = RedOp(opi);
      for (int64_t numel : sizes) {
        with_ring(n, 1024, 30.0, [&](int r, Protocol& ring) {
          const uint64_t off = static_cast<uint64_t>(r) * 3 * es;  // ranks at different offsets
          char* x = bases[r] + off;
          for (int64_t i = 0; i < numel; ++i) put(t, x, i, value(r, i));
          const shm::Pool pool{&bases, bytes, off};
          const Call c{Coll::AllReduce, t, op, numel, x, x};
          CHECK(ring.choose(c, &pool) == (n == 1 ? shm::Algo::Ring : shm::Algo::Pool),
                "a pool tensor's all_reduce runs pool (n=%d)", n);
          ring.run(c, nullptr, &pool);
        });
        for (int r = 0; r < n; ++r) {
          const char* x = bases[r] + static_cast<uint64_t>(r) * 3 * es;
          for (int64_t i = 0; i < numel; ++i) {
            char want[8] = {0};
            expect_at(t, op, n, i, want);
            if (std::memcmp(x + i * es, want, es) != 0) {
              CHECK(false, "pool n=%d %s %s numel=%lld rank %d element %lld wrong", n,
                    dtype_name(t), op_name(op), (long long)numel, r, (long long)i);
              break;
            }
          }
        }
      }
    }
  }
  if (n < 2) return;
  // One rank's tensor is not in the buffer: every rank raises, within the timeout, naming it.
  std::atomic<int> raised{0}, named{0};
  std::vector<std::vector<float>> bufs(n, std::vector<float>(64, 1.0f));
  std::vector<char*> bases(n);
  for (int r = 0; r < n; ++r) bases[r] = reinterpret_cast<char*>(bufs[r].data());
  with_ring(n, 1024, 10.0, [&](int r, Protocol& ring) {
    std::vector<float> own(64, 1.0f);
    float* x = r == n - 1 ? own.data() : bufs[r].data();
    const shm::Pool pool{&bases, 64 * sizeof(float), 0};
    try {
      ring.run({Coll::AllReduce, DType::F32, RedOp::Sum, 64, x, x}, nullptr,
               r == n - 1 ? nullptr : &pool);
    } catch (const RingError& e) {
      ++raised;
      const std::string w = e.what();
      if (w.find("shared_empty") != std::string::npos || w.find("aborted the group") != std::string::npos)
        ++named;
    }
  });
  CHECK(raised == n && named == n, "pool mismatch: %d raised, %d named it (n=%d)", raised.load(),
        named.load(), n);
}

// cpu::copy_stream: memcpy's bytes for every head alignment and tail length.
static void copy_stream_exact() {
  std::vector<char> src(70000), dst(70000);
  std::mt19937 g(7);
  for (auto& c : src) c = static_cast<char>(g());
  for (size_t off : {0, 1, 15, 16, 33, 63})
    for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{64}, size_t{65}, size_t{4095}, size_t{65536 + 17}}) {
      std::fill(dst.begin(), dst.end(), 0);
      cpu::copy_stream(dst.data() + off, src.data() + 3, n);
      CHECK(std::memcmp(dst.data() + off, src.data() + 3, n) == 0, "copy_stream off %zu n %zu", off, n);
      CHECK(off == 0 || dst[off - 1] == 0, "copy_stream wrote before dst (off %zu n %zu)", off, n);
      CHECK(dst[off + n] == 0, "copy_stream wrote past the end (off %zu n %zu)", off, n);
    }
}

// RINGREDUCE_STREAM=1: every slot (and pool) write of >= kStreamMinBytes by non-temporal stores.
// 32 KiB slices: the larger dtypes' chunks take full streamed slices and short memcpy'd ones.
static void stream_sweeps() {
  g_tweak = [](int, shm::Options& o) { o.stream = shm::Options::Stream::Always; };
  for (int n : {2, 3}) {
    for (shm::Algo a : {shm::Algo::Ring, shm::Algo::OneShot, shm::Algo::TwoShot}) {
      g_algo = a;
      sweep(Coll::AllReduce, n, shm::kStreamMinBytes);
      if (a != shm::Algo::OneShot) sweep(Coll::ReduceScatter, n, shm::kStreamMinBytes);
    }
    g_algo = shm::Algo::Ring;
    sweep(Coll::AllGather, n, shm::kStreamMinBytes);
    g_algo = shm::Algo::Auto;
    pool_sweep(n);
  }
  g_tweak = nullptr;
  g_algo = shm::Algo::Ring;
}

static void timeout() {
  const int n = 3;
  std::atomic<int> raised{0};
  const auto t0 = std::chrono::steady_clock::now();
  with_ring(n, 1024, 0.5, [&](int r, Protocol& ring) {
    if (r == 1) return;  // never calls
    std::vector<float> x(1000, 1.0f);
    try {
      ring.run({Coll::AllReduce, DType::F32, RedOp::Sum, 1000, x.data(), x.data()});
    } catch (const RingError& e) {
      ++raised;
    }
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(raised == n - 1, "every calling rank raises, got %d", raised.load());
  CHECK(secs < 5.0, "raised within the timeout bound: %.2f s", secs);
}

int main() {
  for (int n = 1; n <= 5; ++n) {
    for (size_t slice : {size_t{64}, shm::kDefaultSliceBytes}) {
      sweep(Coll::AllReduce, n, slice);
      sweep(Coll::ReduceScatter, n, slice);
      sweep(Coll::AllGather, n, slice);
      g_algo = shm::Algo::OneShot;  // forced at every size: many slices when slice is 64 B
      sweep(Coll::AllReduce, n, slice);
      g_algo = shm::Algo::TwoShot;  // parts of one element when slice is 64 B
      sweep(Coll::AllReduce, n, slice);
      sweep(Coll::ReduceScatter, n, slice);
      g_algo = shm::Algo::Cma;  // threads share a pid: process_vm_readv reads this process
      sweep(Coll::AllReduce, n, slice);
      sweep(Coll::ReduceScatter, n, slice);
      g_algo = shm::Algo::Ring;
    }
  }
  g_algo = shm::Algo::Auto;
  for (int n = 1; n <= 5; ++n) pool_sweep(n);
  g_algo = shm::Algo::Ring;
  bitwise_floats();
  g_algo = shm::Algo::OneShot;
  bitwise_floats();
  g_algo = shm::Algo::TwoShot;
  bitwise_floats();
  g_algo = shm::Algo::Cma;
  bitwise_floats();
  g_algo = shm::Algo::Ring;
  copy_stream_exact();
  stream_sweeps();
  alternating_algorithms();
  alternating_steps();
  alternating_deterministic();
  algorithm_mismatch(false);
  algorithm_mismatch(true);
  mismatch();
  timeout();
  return finish("test_shm");
}
