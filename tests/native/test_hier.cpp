// Native test of the two-level CUDA transport (csrc/cuda/hier/endpoint.cpp) on the emulated device:
// ranks are threads, each on an emulated device of its own, grouped into emulated hosts; inside a
// host the p2p transport (CUDA IPC mappings of the emulator), between hosts the nccl transport over
// the in-process NCCL stand-in (tests/native/emu/nccl_standin.cpp).
// (1) the schedule: 2 hosts x 2 ranks, 3 x 2, 2 x 3 and 4 x 1, hosts of consecutive ranks and
//     interleaved ones (rank r on host r % H), every collective, dtype and op, in place and not,
//     sizes under one piece, of many pieces (a tiny piece size) and with a remainder under L;
//     results checked exactly and bitwise equal on every rank (tests/native/cuda_check.h);
// (2) a lost host: its ranks never call; every survivor fails within the timeout, naming the host
//     between hosts, and the survivors' host rings are stopped (no rank waits past it);
// (3) deterministic mode is refused with a message saying what runs it;
// (4) the narrow wire between hosts (all_reduce, bf16 / e4m3 / e5m2, float32 / bf16 / fp16
//     tensors, SUM and AVG): the CPU's two-level wire bit for bit (each host's partial sum in the
//     tensor's dtype, AVG divided first, rounded onto the wire in blocks of 128 from the tensor's
//     start, folded in host order in float32 and rounded again: cpu/wire.h's functions), in pieces
//     and with a tail under one piece's unit; float16's wire and other collectives refused;
// (5) the bytes between hosts (the stand-in's count of every ncclSend): per rank 2(H-1)/H of 1/L
//     of the tensor for float32, and the wire's share of that (bf16 0.5, fp8 0.26).
#include <dlfcn.h>
#include <nccl.h>

#include <thread>

#include "cuda/hier/endpoint.h"
#include "cuda_check.h"
#include "emu.h"
#include "wire_check.h"

namespace rc = ringreduce::cuda;
using Clock = std::chrono::steady_clock;

static const char* kLib = RR_TEST_NCCL_LIB;

// H hosts of L ranks; rank r's host: r / L (consecutive) or r % H (interleaved). Rank r runs on
// emulated device r.
struct Hosts {
  std::vector<std::unique_ptr<rc::hier::Endpoint>> eps;
  std::vector<Rank> ranks;
  std::vector<std::vector<int>> by_host;
  Hosts(int H, int L, bool interleaved, size_t piece_bytes, double timeout_s = 20.0) {
    const int N = H * L;
    by_host.assign(H, {});
    for (int r = 0; r < N; ++r) by_host[interleaved ? r % H : r / L].push_back(r);
    auto host_of = [&](int r) { return interleaved ? r % H : r / L; };
    auto local_of = [&](int r) {
      const auto& v = by_host[host_of(r)];
      return static_cast<int>(std::find(v.begin(), v.end(), r) - v.begin());
    };
    // The host rings (p2p, every rank of a host mapping the others, as the binding connects them).
    std::vector<std::unique_ptr<rc::p2p::Endpoint>> intra(N);
    for (int r = 0; r < N; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(r));
      rc::p2p::Options o;
      o.rank = local_of(r);
      o.nranks = L;
      o.timeout_s = timeout_s + 5.0;  // the step between hosts times out first (the binding's grace)
      o.chunk_bytes = 4096;          // many workspace pieces per call too
      intra[r] = std::make_unique<rc::p2p::Endpoint>(o);
    }
    for (int h = 0; h < H; ++h) {
      std::vector<std::string> handles;
      for (int r : by_host[h]) {
        RR_CUDA_CHECK(cudaSetDevice(r));
        handles.push_back(intra[r]->handle());
      }
      for (int r : by_host[h]) {
        RR_CUDA_CHECK(cudaSetDevice(r));
        intra[r]->connect(handles);
      }
    }
    // The rings between hosts: local rank j of every host, in host order (collective: a thread each).
    std::vector<std::unique_ptr<rc::nccl::Endpoint>> cross(N);
    std::vector<std::string> ids(L), errors(N);
    for (int j = 0; j < L; ++j) ids[j] = rc::nccl::unique_id(kLib);
    std::vector<std::thread> ths;
    for (int r = 0; r < N; ++r)
      ths.emplace_back([&, r] {
        try {
          RR_CUDA_CHECK(cudaSetDevice(r));
          rc::nccl::Options o;
          o.rank = host_of(r);
          o.nranks = H;
          o.timeout_s = timeout_s;
          o.lib = kLib;
          cross[r] = std::make_unique<rc::nccl::Endpoint>(o, ids[local_of(r)]);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& t : ths) t.join();
    for (int r = 0; r < N; ++r)
      if (!errors[r].empty()) throw rr::RingError(errors[r]);
    for (int r = 0; r < N; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(r));
      rc::hier::Options o;
      o.rank = r;
      o.hosts = by_host;
      o.piece_bytes = piece_bytes;
      eps.push_back(std::make_unique<rc::hier::Endpoint>(o, std::move(intra[r]), std::move(cross[r])));
      Rank k;
      k.device = r;
      RR_CUDA_CHECK(cudaStreamCreateWithFlags(&k.stream, cudaStreamNonBlocking));
      rc::hier::Endpoint* ep = eps.back().get();
      k.run = [ep](const rr::Call& c, cudaStream_t s) { ep->run(c, s); };
      k.failure = [ep] { return ep->failure(); };
      ranks.push_back(k);
    }
  }
  ~Hosts() {
    for (Rank& k : ranks) {
      cudaSetDevice(k.device);
      cudaStreamSynchronize(k.stream);
    }
    // Close in two phases, as the binding does: every rank unmaps before any frees.
    const bool broken = [&] {
      for (auto& e : eps)
        if (!e->failure().empty()) return true;
      return false;
    }();
    for (size_t r = 0; r < eps.size(); ++r) {
      cudaSetDevice(ranks[r].device);
      eps[r]->unmap_peers();
    }
    for (size_t r = 0; r < eps.size(); ++r) {
      cudaSetDevice(ranks[r].device);
      eps[r]->close(!broken);
    }
    for (Rank& k : ranks) cudaStreamDestroy(k.stream);
  }
};

// (1) every collective, dtype and op, against the exact reference.
static void test_sweep() {
  int cases = 0;
  const auto t0 = Clock::now();
  struct Shape {
    int H, L;
    bool interleaved;
    size_t piece;
  };
  for (const Shape& s : {Shape{2, 2, false, 512}, Shape{2, 2, true, 512}, Shape{3, 2, false, 768},
                         Shape{2, 3, true, 768}, Shape{4, 1, false, 512}, Shape{2, 2, false, rc::hier::kDefaultPieceBytes}}) {
    Hosts g(s.H, s.L, s.interleaved, s.piece);
    const int N = s.H * s.L;
    char what[96];
    std::snprintf(what, sizeof what, "hier %d hosts x %d%s, pieces of %zu B", s.H, s.L,
                  s.interleaved ? " interleaved" : "", s.piece);
    // under one piece, many pieces, a remainder under L (all_reduce), numel < N
    cases += sweep(g.ranks, {0, 1, N - 1, N + 1, 16 * N * 3 + 7, 1000 * N + 5}, what);
  }
  std::printf("hier sweep: %d cases (%.1f s)\n", cases, seconds_since(t0));
}

// (2) host 1 never calls: every rank of host 0 fails within the timeout, naming host 1.
static void test_lost_host() {
  const double timeout = 2.0;
  Hosts g(2, 2, false, 512, timeout);
  std::vector<std::unique_ptr<DevBuf>> bufs;
  for (int r = 0; r < 4; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(r));
    bufs.push_back(std::make_unique<DevBuf>(4096 * 4));
  }
  const auto t0 = Clock::now();
  for (int r : {0, 1}) {
    RR_CUDA_CHECK(cudaSetDevice(r));
    g.ranks[r].run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 4096, bufs[r]->p, bufs[r]->p},
                   g.ranks[r].stream);
  }
  std::string f[2];
  for (;;) {
    for (int r : {0, 1}) f[r] = g.eps[r]->failure();
    const bool named = contains(f[0], "the other host, host 1 (ranks 2, 3)") &&
                       contains(f[1], "the other host, host 1 (ranks 2, 3)");
    if (named || seconds_since(t0) > timeout + 10) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const double took = seconds_since(t0);
  for (int r : {0, 1}) {
    EXPECT(contains(f[r], "with the other host, host 1 (ranks 2, 3)") && contains(f[r], "between hosts") &&
               !contains(f[r], "host 0 (ranks 0, 1), host 1"),
           "lost host: rank %d's failure does not name host 1 between hosts: '%s'", r, f[r].c_str());
    RR_CUDA_CHECK(cudaSetDevice(r));
    const cudaError_t e = cudaStreamSynchronize(g.ranks[r].stream);  // nothing waits on
    EXPECT(e == cudaSuccess, "lost host: rank %d's stream: %s", r, cudaGetErrorString(e));
  }
  EXPECT(took < timeout + 8, "lost host: the survivors took %.1f s to fail (timeout %.0f s)", took, timeout);
  std::printf("lost host: survivors failed in %.1f s: %s\n", took, f[0].c_str());
  // the lost host's ranks still close (their rings were never used)
}

// (2) Three hosts of one rank, host 2 never calls: the survivors fail within the timeout, naming
// the other hosts of their ring (which of them never came, NCCL's groups do not say).
static void test_lost_host_of_three() {
  const double timeout = 2.0;
  Hosts g(3, 1, false, 512, timeout);
  std::vector<std::unique_ptr<DevBuf>> bufs;
  for (int r = 0; r < 3; ++r) {
    RR_CUDA_CHECK(cudaSetDevice(r));
    bufs.push_back(std::make_unique<DevBuf>(4096 * 4));
  }
  const auto t0 = Clock::now();
  for (int r : {0, 1}) {
    RR_CUDA_CHECK(cudaSetDevice(r));
    g.ranks[r].run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 4096, bufs[r]->p, bufs[r]->p},
                   g.ranks[r].stream);
  }
  std::string f[2];
  while (seconds_since(t0) < timeout + 10 && (f[0].empty() || f[1].empty())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    for (int r : {0, 1}) f[r] = g.eps[r]->failure();
  }
  EXPECT(contains(f[0], "one of the other hosts: host 1 (rank 1), host 2 (rank 2)"),
         "lost host of three: rank 0's failure: '%s'", f[0].c_str());
  EXPECT(contains(f[1], "one of the other hosts: host 0 (rank 0), host 2 (rank 2)"),
         "lost host of three: rank 1's failure: '%s'", f[1].c_str());
  EXPECT(seconds_since(t0) < timeout + 8, "lost host of three: the survivors took %.1f s", seconds_since(t0));
  for (int r : {0, 1}) {  // their streams run out (before the buffers go)
    RR_CUDA_CHECK(cudaSetDevice(r));
    EXPECT(cudaStreamSynchronize(g.ranks[r].stream) == cudaSuccess, "lost host of three: rank %d's stream", r);
  }
}

// (3) deterministic mode runs the flat nccl ring, not this plan.
static void test_deterministic_refused() {
  Hosts g(2, 1, false, 512);
  rr::set_deterministic(true);
  RR_CUDA_CHECK(cudaSetDevice(0));
  DevBuf buf(64);
  bool threw = false;
  try {
    g.ranks[0].run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 4, buf.p, buf.p}, g.ranks[0].stream);
  } catch (const rr::RingError& e) {
    threw = contains(e.what(), "deterministic") && contains(e.what(), "nccl");
  }
  rr::set_deterministic(false);
  EXPECT(threw, "deterministic mode: the two-level plan must refuse, naming the flat nccl ring");
}

// (4) The CPU's two-level wire for every rank's input host[r] (numel elements of dtype t).
static std::vector<char> wire_reference(const Hosts& g, const std::vector<std::vector<char>>& host, rr::DType t,
                                        rr::RedOp op, rr::Wire w, int64_t numel) {
  const size_t es = rr::dtype_size(t);
  const int H = static_cast<int>(g.by_host.size()), N = static_cast<int>(host.size());
  const int64_t padded = (numel + rr::kWireBlock - 1) / rr::kWireBlock * rr::kWireBlock;
  std::vector<std::vector<char>> part(H, std::vector<char>(padded * es + 1, 0)), enc(H);
  std::vector<const void*> srcs(H);
  for (int h = 0; h < H; ++h) {
    std::vector<const char*> xs;
    for (int64_t i = 0; i < numel; ++i) {
      xs.clear();
      for (int r : g.by_host[h]) xs.push_back(&host[r][i * es]);
      det_fold(t, rr::RedOp::Sum, xs, &part[h][i * es]);  // the host's ring: local rank order
      if (op == rr::RedOp::Avg)
        det_put(t, &part[h][i * es], static_cast<float>(det_get(t, &part[h][i * es])) / static_cast<float>(N));
    }
    enc[h].assign(rr::wire_span_bytes(w, padded) + 1, 0);
    rr::cpu::wire_encode(w, t, part[h].data(), padded, enc[h].data());
    srcs[h] = enc[h].data();
  }
  std::vector<char> want(padded * es + 1), wout(rr::wire_span_bytes(w, padded) + 1);
  rr::cpu::wire_reduce(w, srcs.data(), H, padded, 1, wout.data(), t, want.data());
  want.resize(numel * es);
  return want;
}

static void test_wire() {
  int cases = 0;
  int64_t changed = 0;
  const auto t0 = Clock::now();
  struct Shape {
    int H, L;
    bool interleaved;
  };
  for (const Shape& sh : {Shape{2, 2, false}, Shape{3, 2, true}, Shape{2, 1, false}}) {
    Hosts g(sh.H, sh.L, sh.interleaved, 4096);  // pieces of 4 KiB: several a call
    const int N = sh.H * sh.L;
    const int64_t unit = N * rr::kWireBlock;
    for (rr::Wire w : {rr::Wire::BF16, rr::Wire::E4M3, rr::Wire::E5M2})
      for (rr::DType t : {rr::DType::F32, rr::DType::BF16, rr::DType::F16})
        for (rr::RedOp op : {rr::RedOp::Sum, rr::RedOp::Avg})
          for (int64_t numel : {int64_t{1}, int64_t{129}, unit - 1, unit, 5 * unit + 77}) {
            const size_t es = rr::dtype_size(t);
            std::vector<std::vector<char>> host(N);
            std::vector<std::unique_ptr<DevBuf>> bufs;
            for (int r = 0; r < N; ++r) {
              host[r].assign((numel + 1) * es, 0x5a);
              for (int64_t i = 0; i < numel; ++i) wire_put(t, &host[r][i * es], i, r, static_cast<int>(numel));
              RR_CUDA_CHECK(cudaSetDevice(r));
              bufs.push_back(std::make_unique<DevBuf>((numel + 1) * es));
              fill_on(g.ranks[r].stream, bufs[r]->p, host[r]);
            }
            for (int r = 0; r < N; ++r) {
              RR_CUDA_CHECK(cudaSetDevice(r));
              g.ranks[r].run({rr::Coll::AllReduce, t, op, numel, bufs[r]->p, bufs[r]->p, w}, g.ranks[r].stream);
            }
            const std::vector<char> want = wire_reference(g, host, t, op, w, numel);
            for (int r = 0; r < N; ++r) {
              RR_CUDA_CHECK(cudaSetDevice(r));
              RR_CUDA_CHECK(cudaStreamSynchronize(g.ranks[r].stream));
              const std::string f = g.eps[r]->failure();
              EXPECT(f.empty(), "hier wire: rank %d failed: %s", r, f.c_str());
              std::vector<char> got((numel + 1) * es);
              RR_CUDA_CHECK(cudaMemcpy(got.data(), bufs[r]->p, got.size(), cudaMemcpyDeviceToHost));
              EXPECT(static_cast<unsigned char>(got[numel * es]) == 0x5a, "hier wire: rank %d wrote past its tensor", r);
              for (int64_t i = 0; i < numel; ++i) {
                if (r == 0) {  // the wire must change something, or this proves nothing
                  std::vector<const char*> xs;
                  for (int q = 0; q < N; ++q) xs.push_back(&host[q][i * es]);
                  char plain[8];
                  det_fold(t, op, xs, plain);
                  changed += std::memcmp(plain, &want[i * es], es) != 0;
                }
                if (std::memcmp(&got[i * es], &want[i * es], es) != 0) {
                  EXPECT(false, "hier wire %d hosts x %d: %s %s wire=%s numel=%lld rank %d element %lld: got %.9g "
                         "want %.9g", sh.H, sh.L, rr::dtype_name(t), rr::op_name(op), rr::wire_name(w),
                         (long long)numel, r, (long long)i, det_get(t, &got[i * es]), det_get(t, &want[i * es]));
                  break;
                }
              }
            }
            ++cases;
          }
  }
  EXPECT(changed > 1000, "hier wire: the wire changed only %lld elements", (long long)changed);
  // float16's wire and a wire reduce_scatter are refused, naming what runs
  Hosts g(2, 1, false, 4096);
  RR_CUDA_CHECK(cudaSetDevice(0));
  DevBuf buf(1024);
  for (const rr::Call& c : {rr::Call{rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, 8, buf.p, buf.p, rr::Wire::F16},
                            rr::Call{rr::Coll::ReduceScatter, rr::DType::F32, rr::RedOp::Sum, 8, buf.p, buf.p + 16, rr::Wire::BF16}}) {
    bool threw = false;
    try {
      g.ranks[0].run(c, g.ranks[0].stream);
    } catch (const std::invalid_argument& e) {
      threw = contains(e.what(), "wire_dtype=") && contains(e.what(), "bfloat16 or float8");
    }
    EXPECT(threw, "hier wire: %s with wire %s must be refused", rr::coll_name(c.coll), rr::wire_name(c.wire));
  }
  std::printf("hier wire: %d cases, %lld elements differ from the plain fold (%.1f s)\n", cases, (long long)changed,
              seconds_since(t0));
}

// (5) Bytes sent between hosts by every rank together, against the two-level plan's optimum.
static void test_bytes_between_hosts() {
  void* lib = dlopen(kLib, RTLD_NOW);
  auto sent = reinterpret_cast<uint64_t (*)()>(lib ? dlsym(lib, "standin_sent_bytes") : nullptr);
  EXPECT(sent != nullptr, "the NCCL stand-in has no standin_sent_bytes");
  if (!sent) return;
  for (int H : {2, 3}) {
    const int L = 2, N = H * L;
    Hosts g(H, L, false, rc::hier::kDefaultPieceBytes);
    const int64_t numel = int64_t{1} << 18;  // 1 MiB of float32: one piece
    const double S = 4.0 * numel, ideal = N * 2.0 * (H - 1) / H * S / L;
    std::vector<std::unique_ptr<DevBuf>> bufs;
    for (int r = 0; r < N; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(r));
      bufs.push_back(std::make_unique<DevBuf>(numel * 4));
      set_on(g.ranks[r].stream, bufs[r]->p, 0, numel * 4);
    }
    double f32 = 0;
    for (rr::Wire w : {rr::Wire::None, rr::Wire::BF16, rr::Wire::E4M3}) {
      const uint64_t before = sent();
      for (int r = 0; r < N; ++r) {
        RR_CUDA_CHECK(cudaSetDevice(r));
        g.ranks[r].run({rr::Coll::AllReduce, rr::DType::F32, rr::RedOp::Sum, numel, bufs[r]->p, bufs[r]->p, w},
                       g.ranks[r].stream);
      }
      for (int r = 0; r < N; ++r) RR_CUDA_CHECK(cudaStreamSynchronize(g.ranks[r].stream));
      const double bytes = static_cast<double>(sent() - before);
      if (w == rr::Wire::None) {
        f32 = bytes;  // plus the calls' 32-byte descriptors
        EXPECT(bytes >= ideal && bytes <= 1.01 * ideal, "%d hosts x %d, float32: %.0f bytes between hosts, "
               "ideal %.0f (2(H-1)/H of 1/L of the tensor per rank)", H, L, bytes, ideal);
      } else {
        // every host's rows to every host: the two steps' bytes with two hosts, H/2 times them above
        const double share = (w == rr::Wire::BF16 ? 0.5 : 0.25 + 1.0 / 128) * (H == 2 ? 1.0 : H / 2.0);
        EXPECT(bytes <= 1.02 * share * f32, "%d hosts x %d, wire %s: %.0f bytes between hosts, %.3f of "
               "float32's (want <= %.3f)", H, L, rr::wire_name(w), bytes, bytes / f32, 1.02 * share);
      }
      std::printf("bytes between hosts, %d hosts x %d, 1 MiB float32, wire %s: %.0f (%.3f of the ideal)\n",
                  H, L, rr::wire_name(w), bytes, bytes / ideal);
    }
  }
}

int main(int argc, char** argv) {
  emu_set_device_count(6);
  try {
    run_test(argc, argv, "test_sweep", [&] { test_sweep(); });
    run_test(argc, argv, "test_lost_host", [&] { test_lost_host(); });
    run_test(argc, argv, "test_lost_host_of_three", [&] { test_lost_host_of_three(); });
    run_test(argc, argv, "test_deterministic_refused", [&] { test_deterministic_refused(); });
    run_test(argc, argv, "test_wire", [&] { test_wire(); });
    run_test(argc, argv, "test_bytes_between_hosts", [&] { test_bytes_between_hosts(); });
  } catch (const std::exception& e) {
    std::printf("FAIL: exception: %s\n", e.what());
    return 1;
  }
  std::printf(g_failures ? "test_hier: %d failures\n" : "test_hier: OK\n", g_failures);
  return g_failures ? 1 : 0;
}
