// Counts what one collective of the p2p transport costs, on the emulated device (no GPU can be
// timed here): `gpu_cost_emu WORLD COLL ALGO BYTES...` runs, for each size, one warm-up call and
// then one counted call of float32 on WORLD ranks (rank r on emulated device r, IPC mappings as
// between processes), and prints one JSON object per size: the plan and, per rank, the counts of
// tests/native/emu/cost.cpp. benchmarks/gpu_cost.py runs it and applies the time model.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cuda/host.h"
#include "cuda/shape.h"
#include "cuda/p2p/endpoint.h"
#include "emu.h"
#include "../tests/native/held_memory.h"
#include "runtime/shm_map.h"

#include <unistd.h>

namespace rr = ringreduce;
namespace p2p = ringreduce::cuda::p2p;

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s WORLD all_reduce|reduce_scatter|all_gather auto|ring|oneshot|twoshot|copy|ll|registered|recurring BYTES...\n", argv[0]);
    return 2;
  }
  const int n = std::atoi(argv[1]);
  const std::string coll_s = argv[2], algo_s = argv[3];
  const rr::Coll coll = coll_s == "all_reduce" ? rr::Coll::AllReduce
                        : coll_s == "reduce_scatter" ? rr::Coll::ReduceScatter : rr::Coll::AllGather;
  p2p::Algo algo = p2p::Algo::Auto;
  for (p2p::Algo a : {p2p::Algo::Ring, p2p::Algo::OneShot, p2p::Algo::TwoShot, p2p::Algo::Copy, p2p::Algo::LL})
    if (algo_s == p2p::algo_name(a)) algo = a;
  // registered: all_reduce of tensors in registered buffers (Endpoint::reg_alloc; Auto picks it).
  // recurring: of ordinary tensors, with the group's board of imported memory (as the torch binding
  // attaches it): the counted call is the second on the same tensors (Auto picks Imported).
  const bool registered = algo_s == "registered", recurring = algo_s == "recurring";
  if ((registered || recurring) && coll != rr::Coll::AllReduce) {
    std::fprintf(stderr, "gpu_cost_emu: %s is for all_reduce only\n", algo_s.c_str());
    return 2;
  }
  emu_set_device_count(n);
  HeldMemory held;  // recurring: the tensors' memory, as torch's allocator would hold it
  try {
    std::vector<std::unique_ptr<p2p::Endpoint>> rings;
    std::vector<cudaStream_t> streams(n);
    std::vector<std::string> handles;
    for (int r = 0; r < n; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(r));
      p2p::Options o;
      o.rank = r;
      o.nranks = n;
      o.algo = algo;
      o.timeout_s = 600;
      // As the torch binding reads them: the workspace's piece size
      if (const char* v = std::getenv("RINGREDUCE_CUDA_CHUNK_BYTES")) o.chunk_bytes = std::atoll(v);
      // and the workspace's most blocks
      if (const char* v = std::getenv("RINGREDUCE_CUDA_SYM_BLOCKS")) o.sym_blocks = std::atoi(v);
      rings.push_back(std::make_unique<p2p::Endpoint>(o));
      handles.push_back(rings.back()->handle());
      RR_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking));
    }
    for (int r = 0; r < n; ++r) {
      RR_CUDA_CHECK(cudaSetDevice(r));
      rings[r]->connect(handles);
    }
    if (rings[0]->copies()) {  // the copy algorithm's counters, shared as the torch binding does
      const std::string name = "/rr-cost-copy-" + std::to_string(getpid());
      for (int r = 0; r < n; ++r) {
        RR_CUDA_CHECK(cudaSetDevice(r));
        rings[r]->copy_attach(name, r == 0);
      }
      rr::runtime::shm_unlink(name);
    }
    if (recurring) {  // the board, shared as the torch binding does
      const std::string name = "/rr-cost-board-" + std::to_string(getpid());
      for (int r = 0; r < n; ++r) {
        rings[r]->set_holder(held.holder());
        rings[r]->board_attach(name, r == 0);
      }
      rr::runtime::shm_unlink(name);
    }
    for (int i = 4; i < argc; ++i) {
      const int64_t numel = (std::atoll(argv[i]) / 4 / n) * n;
      std::vector<char*> in(n), out(n);
      std::vector<std::shared_ptr<char>> held_in(n);
      std::vector<std::string> reg_handles(n);
      std::vector<int> reg_ids(n);
      for (int r = 0; r < n; ++r) {
        RR_CUDA_CHECK(cudaSetDevice(r));
        const size_t in_b = (coll == rr::Coll::AllGather ? numel / n : numel) * 4;
        const size_t out_b = (coll == rr::Coll::ReduceScatter ? numel / n : numel) * 4;
        if (registered) {  // every rank's buffer, mapped by all (freed when the rings close)
          std::string h;
          const int id = rings[r]->reg_alloc(in_b ? in_b : 4, &h);
          reg_handles[r] = h;
          reg_ids[r] = id;
          in[r] = rings[r]->reg_memory(id).get();
        } else {
          if (recurring) {  // freed as torch frees a tensor: when its last owner (a hold) lets go
            held_in[r] = held.alloc(in_b ? in_b : 4);
            in[r] = held_in[r].get();
          } else {
            RR_CUDA_CHECK(cudaMalloc(&in[r], in_b ? in_b : 4));
          }
        }
        if (!registered) RR_CUDA_CHECK(cudaMalloc(&out[r], out_b ? out_b : 4));
        // On the rank's stream: a legacy-stream memset is not ordered before it (non-blocking).
        RR_CUDA_CHECK(cudaMemsetAsync(in[r], 0, in_b ? in_b : 4, streams[r]));
      }
      for (int r = 0; r < n && registered; ++r) {
        RR_CUDA_CHECK(cudaSetDevice(r));
        rings[r]->reg_connect(reg_ids[r], reg_handles);
      }
      // The plan below asks with rank 0's tensor (a registered one is planned by where it is).
      rr::Call base{coll, rr::DType::F32, rr::RedOp::Sum, numel, registered ? in[0] : nullptr,
                    registered ? in[0] : nullptr};
      // RINGREDUCE_WIRE=bf16|fp16|fp8|fp8e5m2: the narrow wire (benchmarks/gpu_cost.py --wire).
      if (const char* w = std::getenv("RINGREDUCE_WIRE")) {
        const std::string s = w;
        base.wire = s == "bf16" ? rr::Wire::BF16 : s == "fp16" ? rr::Wire::F16
                    : s == "fp8" ? rr::Wire::E4M3 : s == "fp8e5m2" ? rr::Wire::E5M2 : rr::Wire::None;
      }
      for (int pass = 0; pass < 2; ++pass) {  // a warm-up, then the counted call
        if (pass == 1) {
          emu_cost_reset();
          emu_cost_enable(1);
        }
        for (int r = 0; r < n; ++r) {
          RR_CUDA_CHECK(cudaSetDevice(r));
          rr::Call c = base;
          c.in = in[r];
          c.out = coll == rr::Coll::AllReduce ? in[r] : out[r];
          rings[r]->run(c, streams[r]);
        }
        for (int r = 0; r < n; ++r) RR_CUDA_CHECK(cudaStreamSynchronize(streams[r]));
        emu_cost_enable(0);
      }
      for (int r = 0; r < n; ++r)
        if (!rings[r]->failure().empty()) {
          std::fprintf(stderr, "rank %d failed: %s\n", r, rings[r]->failure().c_str());
          return 1;
        }
      const p2p::Plan p = rings[0]->plan_of(base);
      // The kernels' data loops: threads per block and 16-byte loads in flight per thread.
      const int loads = p.algo == p2p::Algo::Ring ? rr::cuda::kRingLoadsInFlight
                                                  : rr::cuda::kFoldLoadsInFlight;
      std::printf("{\"world\": %d, \"coll\": \"%s\", \"wire\": \"%s\", \"algo\": \"%s\", \"bytes\": %lld, \"blocks\": %d, "
                  "\"slice_bytes\": %lld, \"steps\": %lld, \"threads\": %d, \"loads_in_flight\": %d, "
                  "\"device_bytes\": %zu, \"ranks\": [",
                  n, coll_s.c_str(), base.wire == rr::Wire::None ? "none" : rr::wire_name(base.wire),
                  p2p::algo_name(p.algo), static_cast<long long>(numel * 4), p.blocks,
                  static_cast<long long>(p.slice_elems * 4), static_cast<long long>(p.steps),
                  rr::cuda::kThreads, loads, rings[0]->area_bytes());
      for (int r = 0; r < n; ++r) {
        EmuCost c;
        emu_cost_get(r, &c);
        std::printf("%s{\"remote_read\": %llu, \"remote_write\": %llu, \"local_read\": %llu, "
                    "\"local_write\": %llu, \"remote_waits\": %llu, \"local_waits\": %llu, "
                    "\"remote_posts\": %llu, \"launches\": %llu, \"half_round_trips\": %llu, "
                    "\"thread_waits\": %llu, \"host_reads\": %llu}",
                    r ? ", " : "", (unsigned long long)c.remote_read, (unsigned long long)c.remote_write,
                    (unsigned long long)c.local_read, (unsigned long long)c.local_write,
                    (unsigned long long)c.remote_waits, (unsigned long long)c.local_waits,
                    (unsigned long long)c.remote_posts, (unsigned long long)c.launches,
                    (unsigned long long)c.half_round_trips, (unsigned long long)c.max_thread_waits,
                    (unsigned long long)c.host_reads);
      }
      std::printf("]}\n");
      std::fflush(stdout);
      // An imported allocation is withdrawn, the peers unmap it, then the reaper's hold frees it.
      const int freed = held.freed();
      held_in.assign(n, nullptr);
      while (recurring && held.freed() < freed + n) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      for (int r = 0; r < n; ++r) {
        RR_CUDA_CHECK(cudaSetDevice(r));
        if (!registered && !recurring) cudaFree(in[r]);
        cudaFree(out[r]);
      }
    }
    for (int r = 0; r < n; ++r) rings[r]->close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpu_cost_emu: %s\n", e.what());
    return 1;
  }
  return 0;
}
