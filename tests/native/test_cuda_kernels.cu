// Native test of the CUDA kernels, no torch: (1) launch_reduce against a host reference for every
// dtype and op, odd sizes, aligned and unaligned offsets, bitwise; (2) the p2p ring kernel with
// ranks as streams of one process (areas used directly instead of IPC), all collectives, exact
// expectations from small integer values; (3) a silent rank: the others stop with a timeout.
// Exits 0 with a message when there is no CUDA device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "cuda/kernels.h"
#include "cuda/p2p.h"

namespace rr = ringreduce;
namespace rc = ringreduce::cuda;

static int g_failures = 0;
#define EXPECT(cond, ...)                                      \
  do {                                                         \
    if (!(cond)) {                                             \
      if (++g_failures <= 20) {                                \
        std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
        std::printf(__VA_ARGS__);                              \
        std::printf("\n");                                     \
      }                                                        \
    }                                                          \
  } while (0)

static const rr::DType kDtypes[] = {rr::DType::F32, rr::DType::F64, rr::DType::F16, rr::DType::BF16,
                                    rr::DType::I8,  rr::DType::U8,  rr::DType::I32, rr::DType::I64};
static const rr::RedOp kOps[] = {rr::RedOp::Sum, rr::RedOp::Avg, rr::RedOp::Min, rr::RedOp::Max,
                                 rr::RedOp::Prod};

// Host values as doubles <-> element bytes, with the device's conversions.
static double get(rr::DType t, const char* p) {
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
static void put(rr::DType t, char* p, double v) {
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
static bool is_float(rr::DType t) { return rr::dtype_is_float(t); }

// a op b for values that are exact in every dtype (small integers), then AVG's division as the
// device does it: floats in their compute type (fp32 for fp16/bf16), integers truncating.
static double ref_op(rr::RedOp op, double a, double b) {
  switch (op) {
    case rr::RedOp::Min: return b < a ? b : a;
    case rr::RedOp::Max: return a < b ? b : a;
    case rr::RedOp::Prod: return a * b;
    default: return a + b;
  }
}
static double ref_avg(rr::DType t, double sum, int div) {
  if (!is_float(t)) return std::trunc(sum / div);
  if (t == rr::DType::F64) return sum / div;
  return static_cast<float>(sum) / static_cast<float>(div);
}

// Small integers: every op and dtype is exact, so expectations are exact.
static double value(rr::DType t, int64_t i, int salt) {
  const int64_t v = (i * 7 + salt * 3 + 1) % 5;
  return t == rr::DType::U8 ? static_cast<double>(v % 4) : static_cast<double>(v - 2);
}

struct DevBuf {
  char* p = nullptr;
  explicit DevBuf(size_t bytes) { RR_CUDA_CHECK(cudaMalloc(&p, bytes > 0 ? bytes : 1)); }
  ~DevBuf() { cudaFree(p); }
};

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
          rc::launch_reduce(t, op, d.p + off[2] * es, a.p + off[0] * es, b.p + off[1] * es, n, div,
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

// (2) the p2p ring kernel, ranks as streams of one process.
struct Group {
  int n;
  std::vector<std::unique_ptr<rc::p2p::Ring>> rings;
  std::vector<cudaStream_t> streams;
  Group(int n_, int channels, size_t slice_bytes, double timeout_s) : n(n_) {
    for (int r = 0; r < n; ++r) {
      rc::p2p::Options o;
      o.rank = r;
      o.nranks = n;
      o.channels = channels;
      o.slice_bytes = slice_bytes;
      o.timeout_s = timeout_s;
      rings.push_back(std::make_unique<rc::p2p::Ring>(o));
      cudaStream_t s;
      RR_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      streams.push_back(s);
    }
    for (int r = 0; r < n; ++r) rings[r]->connect_local(*rings[(r + n - 1) % n], *rings[(r + 1) % n]);
  }
  ~Group() {
    for (auto s : streams) cudaStreamDestroy(s);
  }
};

static void ring_case(Group& g, rr::Coll coll, rr::DType t, rr::RedOp op, int64_t numel) {
  const int n = g.n;
  const size_t es = rr::dtype_size(t);
  const int64_t in_n = coll == rr::Coll::AllGather ? numel / n : numel;
  const int64_t out_n = coll == rr::Coll::ReduceScatter ? numel / n : numel;
  std::vector<std::unique_ptr<DevBuf>> ins, outs;
  for (int r = 0; r < n; ++r) {
    std::vector<char> h(in_n * es + 1);
    for (int64_t i = 0; i < in_n; ++i)
      put(t, &h[i * es], value(t, i + (coll == rr::Coll::AllGather ? r * in_n : 0), r));
    ins.push_back(std::make_unique<DevBuf>(in_n * es));
    RR_CUDA_CHECK(cudaMemcpy(ins[r]->p, h.data(), in_n * es, cudaMemcpyHostToDevice));
    if (coll == rr::Coll::AllReduce) {
      outs.push_back(nullptr);  // in place
    } else {
      outs.push_back(std::make_unique<DevBuf>(out_n * es));
      RR_CUDA_CHECK(cudaMemset(outs[r]->p, 0x5a, out_n * es));
    }
  }
  for (int r = 0; r < n; ++r) {
    char* out = outs[r] ? outs[r]->p : ins[r]->p;
    g.rings[r]->run({coll, t, op, numel, ins[r]->p, out}, g.streams[r]);
  }
  for (int r = 0; r < n; ++r) RR_CUDA_CHECK(cudaStreamSynchronize(g.streams[r]));
  std::vector<char> first;
  for (int r = 0; r < n; ++r) {
    const std::string f = g.rings[r]->failure();
    EXPECT(f.empty(), "rank %d failed: %s", r, f.c_str());
    std::vector<char> h(out_n * es + 1);
    RR_CUDA_CHECK(cudaMemcpy(h.data(), outs[r] ? outs[r]->p : ins[r]->p, out_n * es,
                             cudaMemcpyDeviceToHost));
    const int64_t shift = coll == rr::Coll::ReduceScatter ? r * out_n : 0;
    for (int64_t i = 0; i < out_n; ++i) {
      const int64_t gi = i + shift;
      double want;
      if (coll == rr::Coll::AllGather) {
        want = value(t, gi, static_cast<int>(gi / (numel / n)));
      } else {
        want = value(t, gi, 0);
        for (int q = 1; q < n; ++q) want = ref_op(op, want, value(t, gi, q));
        if (op == rr::RedOp::Avg) want = ref_avg(t, want, n);
      }
      std::vector<char> w(es);
      put(t, w.data(), want);
      if (std::memcmp(&h[i * es], w.data(), es) != 0) {
        EXPECT(false, "%s n=%d %s %s numel=%lld rank %d element %lld: got %g want %g",
               rr::coll_name(coll), n, rr::dtype_name(t), rr::op_name(op), (long long)numel, r,
               (long long)gi, get(t, &h[i * es]), want);
        break;
      }
    }
    if (coll == rr::Coll::AllReduce || coll == rr::Coll::AllGather) {  // every rank the same bytes
      if (r == 0) first = h;
      else EXPECT(first == h, "%s: rank %d differs from rank 0", rr::coll_name(coll), r);
    }
  }
}

static void test_ring() {
  int cases = 0;
  for (int n = 2; n <= 4; ++n) {
    // A tiny slice (64 B) forces many pipeline steps; the default shows the usual path.
    const size_t slices[] = {64, rc::p2p::kDefaultSliceBytes};
    const int channels[] = {3, rc::p2p::kDefaultChannels};
    for (int c = 0; c < 2; ++c) {
      Group g(n, channels[c], slices[c], 20.0);
      const int64_t sizes[] = {0, 1, n - 1, n + 1, 1000 * n + 7, 3 * 65536 + 5};
      for (rr::Coll coll : {rr::Coll::AllReduce, rr::Coll::ReduceScatter, rr::Coll::AllGather})
        for (rr::DType t : kDtypes)
          for (rr::RedOp op : kOps) {
            if (coll == rr::Coll::AllGather && op != rr::RedOp::Sum) continue;
            for (int64_t numel : sizes) {
              const int64_t m = coll == rr::Coll::AllReduce ? numel : (numel / n) * n;
              ring_case(g, coll, t, op, m);
              ++cases;
            }
          }
    }
  }
  std::printf("p2p ring: %d cases\n", cases);
}

// (3) rank n-1 never calls: the others stop within the timeout, with a message saying why.
static void test_timeout() {
  const int n = 3;
  Group g(n, 2, 4096, 1.0);
  DevBuf buf(4096 * 4);
  for (int r = 0; r < n - 1; ++r)
    g.rings[r]->run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 4096, buf.p, buf.p},
                    g.streams[r]);
  for (int r = 0; r < n - 1; ++r) RR_CUDA_CHECK(cudaStreamSynchronize(g.streams[r]));
  for (int r = 0; r < n - 1; ++r) {
    const std::string f = g.rings[r]->failure();
    EXPECT(f.find("timed out") != std::string::npos || f.find("stopped because") != std::string::npos,
           "rank %d: failure is '%s'", r, f.c_str());
    bool threw = false;
    try {
      g.rings[r]->run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 1, buf.p, buf.p},
                      g.streams[r]);
    } catch (const rr::RingError&) {
      threw = true;
    }
    EXPECT(threw, "rank %d: a broken ring accepted another call", r);
  }
  std::printf("timeout: rank 0 says: %s\n", g.rings[0]->failure().c_str());
}

int main() {
  // The ranks' kernels spin until their neighbours' kernels run, so all must run at once. Streams
  // beyond CUDA_DEVICE_MAX_CONNECTIONS (default 8) share hardware queues and are serialized behind
  // each other; a Group of 4 rings makes 8 streams (rank + side streams). Before CUDA starts.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("test_cuda_kernels: no CUDA device, skipped\n");
    return 0;
  }
  try {
    test_reduce();
    test_ring();
    test_timeout();
  } catch (const std::exception& e) {
    std::printf("FAIL: exception: %s\n", e.what());
    return 1;
  }
  std::printf(g_failures ? "test_cuda_kernels: %d failures\n" : "test_cuda_kernels: OK\n", g_failures);
  return g_failures ? 1 : 0;
}
