// Helpers of the native CUDA tests (test_p2p_*.cpp, test_cuda_reduce.cpp, test_nccl.cpp): element values and
// exact references, device buffers, and one collective checked across ranks played by one thread.
// Torch-free; built against the emulated device in every CI run and against CUDA where nvcc is.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpu/reduce.h"
#include "cuda/host.h"
#include "cuda/nccl/reduce.h"
#include "ring/call.h"

namespace rr = ringreduce;

inline int g_failures = 0;
#define EXPECT(cond, ...)                                           \
  do {                                                              \
    if (!(cond)) {                                                  \
      if (++g_failures <= 30) {                                     \
        std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
        std::printf(__VA_ARGS__);                                   \
        std::printf("\n");                                          \
      }                                                             \
    }                                                               \
  } while (0)

inline const rr::DType kDtypes[] = {rr::DType::F32, rr::DType::F64, rr::DType::F16, rr::DType::BF16,
                                    rr::DType::I8,  rr::DType::U8,  rr::DType::I32, rr::DType::I64};
inline const rr::RedOp kOps[] = {rr::RedOp::Sum, rr::RedOp::Avg, rr::RedOp::Min, rr::RedOp::Max,
                                 rr::RedOp::Prod};

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Host values as doubles <-> element bytes, with the device's conversions.
inline double get(rr::DType t, const char* p) {
  switch (t) {
    case rr::DType::F32: { float v; std::memcpy(&v, p, 4); return v; }
    case rr::DType::F64: { double v; std::memcpy(&v, p, 8); return v; }
    case rr::DType::F16: { __half_raw r; std::memcpy(&r.x, p, 2); return __half2float(__half(r)); }
    case rr::DType::BF16: {
      __nv_bfloat16_raw r; std::memcpy(&r.x, p, 2); return __bfloat162float(__nv_bfloat16(r));
    }
    case rr::DType::I8: return static_cast<int8_t>(*p);
    case rr::DType::U8: return static_cast<uint8_t>(*p);
    case rr::DType::I32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case rr::DType::I64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
    default: return 0;
  }
}
inline void put(rr::DType t, char* p, double v) {
  switch (t) {
    case rr::DType::F32: { float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
    case rr::DType::F64: std::memcpy(p, &v, 8); break;
    case rr::DType::F16: {
      __half_raw r = __half_raw(__float2half_rn(static_cast<float>(v))); std::memcpy(p, &r.x, 2); break;
    }
    case rr::DType::BF16: {
      __nv_bfloat16_raw r = __nv_bfloat16_raw(__float2bfloat16_rn(static_cast<float>(v)));
      std::memcpy(p, &r.x, 2);
      break;
    }
    case rr::DType::I8: { int8_t x = static_cast<int8_t>(v); std::memcpy(p, &x, 1); break; }
    case rr::DType::U8: { uint8_t x = static_cast<uint8_t>(v); std::memcpy(p, &x, 1); break; }
    case rr::DType::I32: { int32_t x = static_cast<int32_t>(v); std::memcpy(p, &x, 4); break; }
    case rr::DType::I64: { int64_t x = static_cast<int64_t>(v); std::memcpy(p, &x, 8); break; }
    default: break;
  }
}

// a op b for values that are exact in every dtype (small integers), then AVG's division as the
// device does it: floats in their compute type (fp32 for fp16/bf16), integers truncating.
inline double ref_op(rr::RedOp op, double a, double b) {
  switch (op) {
    case rr::RedOp::Min: return b < a ? b : a;
    case rr::RedOp::Max: return a < b ? b : a;
    case rr::RedOp::Prod: return a * b;
    default: return a + b;
  }
}
inline double ref_avg(rr::DType t, double sum, int div) {
  if (!rr::dtype_is_float(t)) return std::trunc(sum / div);
  if (t == rr::DType::F64) return sum / div;
  return static_cast<float>(sum) / static_cast<float>(div);
}

// Small integers: every op and dtype is exact, so expectations are exact.
inline double value(rr::DType t, int64_t i, int salt) {
  const int64_t v = (i * 7 + salt * 3 + 1) % 5;
  return t == rr::DType::U8 ? static_cast<double>(v % 4) : static_cast<double>(v - 2);
}

// p: the allocation plus offset bytes (an unaligned buffer when offset % 16 != 0).
// Or, not owned: base + off in memory someone else frees (a registered buffer).
struct DevBuf {
  char* p = nullptr;
  size_t offset = 0;
  bool owned = true;
  explicit DevBuf(size_t bytes, size_t off = 0) : offset(off) {
    RR_CUDA_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : 1));
    p += offset;
  }
  DevBuf(char* base, size_t off) : p(base + off), offset(off), owned(false) {}
  ~DevBuf() {
    if (owned) cudaFree(p - offset);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

// Inputs and outputs are filled on the stream of the rank that reads them: the ranks' streams are
// non-blocking, so they do not wait for the legacy default stream, where cudaMemcpy (from pageable
// memory) and cudaMemset may still be running when they return (on an H100 a sweep once read an
// output the memset had not written yet). Stream order costs no device-wide synchronisation.
// host must stay alive until the stream has run the copy.
inline void fill_on(cudaStream_t s, char* dst, const std::vector<char>& host) {
  RR_CUDA_CHECK(cudaMemcpyAsync(dst, host.data(), host.size(), cudaMemcpyHostToDevice, s));
}
inline void set_on(cudaStream_t s, char* dst, int byte, size_t bytes) {
  RR_CUDA_CHECK(cudaMemsetAsync(dst, byte, bytes, s));
}

// One rank of a ring as the tests drive it (p2p::Endpoint or nccl::Endpoint behind the functions).
struct Rank {
  int device = 0;
  cudaStream_t stream = nullptr;
  std::function<void(const rr::Call&, cudaStream_t)> run;
  std::function<std::string()> failure;
};

// One collective on every rank, in place (all_reduce always; reduce_scatter: output = this rank's
// chunk of the input; all_gather: input = this rank's chunk of the output) or not; checks every
// rank's output exactly, that nothing past the output was written, that an out-of-place input is
// untouched, and that all_reduce/all_gather results are bitwise the same on every rank.
// shift: the tensors start this many elements past a 16-byte aligned address (unaligned tensors).
// at: an all_reduce's tensor of rank r starts at (*at)[r] + shift elements (a registered buffer).
inline void check_collective(std::vector<Rank>& ranks, rr::Coll coll, rr::DType t, rr::RedOp op,
                             int64_t numel, bool inplace, const char* what, int shift = 0,
                             const std::vector<char*>* at = nullptr) {
  const int n = static_cast<int>(ranks.size());
  const size_t es = rr::dtype_size(t);
  const int64_t m = numel / n;
  const bool ag = coll == rr::Coll::AllGather, rs = coll == rr::Coll::ReduceScatter;
  const int64_t in_n = ag ? m : numel, out_n = rs ? m : numel;
  const int64_t big = std::max(in_n, out_n);
  std::vector<std::unique_ptr<DevBuf>> ins, outs;
  std::vector<std::vector<char>> host_in(n);
  std::vector<char*> in_p(n), out_p(n);
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(ranks[r].device));
    // The buffer is one element longer: that element must stay as it was.
    host_in[r].assign((big + 1) * es, 0x5a);
    for (int64_t i = 0; i < in_n; ++i)
      put(t, &host_in[r][((ag && inplace ? r * m : 0) + i) * es], value(t, i + (ag ? r * m : 0), r));
    if (at && coll == rr::Coll::AllReduce)
      ins.push_back(std::make_unique<DevBuf>((*at)[r], shift * es));
    else
      ins.push_back(std::make_unique<DevBuf>((big + 1 + shift) * es, shift * es));
    fill_on(ranks[r].stream, ins[r]->p, host_in[r]);
    if (coll == rr::Coll::AllReduce || inplace) {
      outs.push_back(nullptr);
      in_p[r] = ins[r]->p + (ag && inplace ? r * m * es : 0);
      out_p[r] = ins[r]->p + (rs && inplace ? r * m * es : 0);
    } else {
      outs.push_back(std::make_unique<DevBuf>((out_n + 1 + shift) * es, shift * es));
      set_on(ranks[r].stream, outs[r]->p, 0x5a, (out_n + 1) * es);
      in_p[r] = ins[r]->p;
      out_p[r] = outs[r]->p;
    }
  }
  for (int r = 0; r < n; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(ranks[r].device));
    ranks[r].run({coll, t, op, numel, in_p[r], out_p[r]}, ranks[r].stream);
  }
  for (int r = 0; r < n; ++r) RR_CUDA_CHECK(cudaStreamSynchronize(ranks[r].stream));
  std::vector<char> first;
  for (int r = 0; r < n; ++r) {
    const std::string f = ranks[r].failure();
    EXPECT(f.empty(), "%s: rank %d failed: %s", what, r, f.c_str());
    std::vector<char> h((out_n + 1) * es);
    RR_CUDA_CHECK(cudaMemcpy(h.data(), out_p[r], (out_n + 1) * es, cudaMemcpyDeviceToHost));
    const int64_t shift = rs ? r * m : 0;
    for (int64_t i = 0; i < out_n; ++i) {
      const int64_t gi = i + shift;
      double want;
      if (ag) {
        want = value(t, gi, static_cast<int>(gi / m));
      } else {
        want = value(t, gi, 0);
        for (int q = 1; q < n; ++q) want = ref_op(op, want, value(t, gi, q));
        if (op == rr::RedOp::Avg) want = ref_avg(t, want, n);
      }
      std::vector<char> w(es);
      put(t, w.data(), want);
      if (std::memcmp(&h[i * es], w.data(), es) != 0) {
        EXPECT(false, "%s: %s n=%d %s %s numel=%lld%s rank %d element %lld: got %g want %g", what,
               rr::coll_name(coll), n, rr::dtype_name(t), rr::op_name(op), (long long)numel,
               inplace ? " in place" : "", r, (long long)gi, get(t, &h[i * es]), want);
        break;
      }
    }
    // The element past the output (past the whole buffer when in place) is untouched.
    const bool whole = coll == rr::Coll::AllReduce || inplace;
    const char* past = whole ? nullptr : &h[out_n * es];
    std::vector<char> tail(es);
    if (whole) RR_CUDA_CHECK(cudaMemcpy(tail.data(), ins[r]->p + big * es, es, cudaMemcpyDeviceToHost));
    EXPECT(static_cast<unsigned char>((whole ? tail.data() : past)[0]) == 0x5a,
           "%s: %s rank %d wrote past its output", what, rr::coll_name(coll), r);
    if (!whole) {  // out of place: the input is as it was
      std::vector<char> back((big + 1) * es);
      RR_CUDA_CHECK(cudaMemcpy(back.data(), ins[r]->p, (big + 1) * es, cudaMemcpyDeviceToHost));
      EXPECT(back == host_in[r], "%s: %s rank %d modified its input", what, rr::coll_name(coll), r);
    }
    if (coll != rr::Coll::ReduceScatter) {
      h.resize(out_n * es);
      if (r == 0) first = h;
      else EXPECT(first == h, "%s: %s rank %d differs from rank 0", what, rr::coll_name(coll), r);
    }
  }
}

// c as the binding passes it on stream: with whether the stream is capturing a graph (the one
// fact the binding asks CUDA for the transports: Call::captured).
inline rr::Call bound(rr::Call c, cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  RR_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
  c.captured = st != cudaStreamCaptureStatusNone;
  return c;
}

// A one-element all_reduce on rank k must throw a RingError whose message contains part.
inline bool run_throws(Rank& k, int r, const DevBuf& buf, const char* part) {
  cudaSetDevice(k.device);
  try {
    k.run(bound({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 1, buf.p, buf.p}, k.stream), k.stream);
  } catch (const rr::RingError& e) {
    EXPECT(contains(e.what(), part), "rank %d: '%s' lacks '%s'", r, e.what(), part);
    return true;
  }
  return false;
}

// Runs test fn unless the command line names other tests (substrings of their names); tests named
// weak_* (the emulator's weak memory mode) run only when named.
inline void run_test(int argc, char** argv, const char* name, const std::function<void()>& fn) {
  bool wanted = argc < 2 && std::strncmp(name, "weak_", 5) != 0;
  for (int i = 1; i < argc; ++i) wanted |= std::strstr(name, argv[i]) != nullptr;
  if (!wanted) return;
  const auto t0 = std::chrono::steady_clock::now();
  // Every test ends by its own deadline (RR_TEST_DEADLINE seconds, default 300): a wait that never
  // ends fails the test with its name, not the caller's timeout with nothing.
  const char* env = std::getenv("RR_TEST_DEADLINE");
  const double deadline = env && *env ? std::atof(env) : 300.0;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lk(mu);
    if (cv.wait_for(lk, std::chrono::duration<double>(deadline), [&] { return done; })) return;
    std::printf("FAIL %s: not finished after %.0f s (RR_TEST_DEADLINE); %d failures before\n", name,
                deadline, g_failures);
    std::fflush(stdout);
    std::_Exit(1);  // the test's threads may be stuck: nothing else can end them
  });
  struct Stop {
    std::mutex& mu;
    std::condition_variable& cv;
    bool& done;
    std::thread& th;
    ~Stop() {
      {
        std::lock_guard<std::mutex> lk(mu);
        done = true;
      }
      cv.notify_all();
      th.join();
    }
  } stop{mu, cv, done, watchdog};
  fn();
  std::printf("-- %s: %.1f s\n", name, seconds_since(t0));
}

// Every collective x dtype x op x size, in place and not, on one set of ranks (many calls in a row).
inline int sweep(std::vector<Rank>& ranks, const std::vector<int64_t>& sizes, const char* what,
                 int shift = 0, const std::vector<char*>* at = nullptr) {
  const int n = static_cast<int>(ranks.size());
  int cases = 0;
  for (rr::Coll coll : {rr::Coll::AllReduce, rr::Coll::ReduceScatter, rr::Coll::AllGather})
    for (rr::DType t : kDtypes)
      for (rr::RedOp op : kOps) {
        if (coll == rr::Coll::AllGather && op != rr::RedOp::Sum) continue;
        for (int64_t numel : sizes) {
          const int64_t total = coll == rr::Coll::AllReduce ? numel : (numel / n) * n;
          for (bool inplace : {true, false}) {
            if (coll == rr::Coll::AllReduce && !inplace) continue;
            const int failed_before = g_failures;
            check_collective(ranks, coll, t, op, total, inplace, what, shift, at);
            ++cases;
            // A wrong result leaves the ring in an unknown state: the rest of the sweep would only
            // add minutes (a broken two-shot ran every case of a 10,000-case sweep).
            if (g_failures > failed_before) return cases;
          }
        }
      }
  return cases;
}
