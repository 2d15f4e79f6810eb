// What one cross-process handshake costs on one GPU, by mechanism: the question issue 36 item 3
// (ranks sharing a GPU without MPS) turns on, answered before any transport code is written.
// Two processes share GPU 0 (forked before either touches CUDA); each runs ITERS "calls" of:
//   spin:      one kernel per call: writes the call's number into the peer's flag (IPC device
//              memory), spins on its own flag until the peer's number arrives. Our direct
//              kernels' handshake; without MPS the two kernels cannot run at once.
//   memop:     no kernel: cuStreamWriteValue32 into the peer's flag, cuStreamWaitValue32 on its
//              own, both queued on the stream and carried out by the GPU's front end.
//   memop_host: the same with the flags in shared pinned host memory (cudaHostRegister).
//   copy_memop: a 4 KiB cudaMemcpyAsync into the peer's IPC buffer, then memop's write and wait,
//              then a one-block kernel that reads what arrived: a no-spin all-reduce's skeleton.
// Prints us per call (median of 5 batches, rank 0's wall clock around the batch's
// cudaStreamSynchronize). A mode that exceeds its time limit is reported, not waited for.
// Build: nvcc -O2 -std=c++17 -arch=sm_90 benchmarks/gpu_handshake.cu -o gpu_handshake
// Run:   ./gpu_handshake [calls per batch, 200] [seconds per mode, 15]   (with and without MPS)
#include <cuda.h>
#include <cuda_runtime.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

namespace {

constexpr int kBatches = 5;
int g_limit_s = 15;               // per mode, both processes (argv[2])
constexpr size_t kCopy = 4096;    // copy_memop's message

struct Shared {  // one page shared by the parent and both children (mmap before fork)
  cudaIpcMemHandle_t mem[2];
  std::atomic<int> published, go, done;
  uint32_t host_flag[2][32];  // memop_host: [rank][0], own cache line each
  double us[kBatches];
  char error[256];
};

__global__ void spin_call(volatile uint32_t* mine, uint32_t* peer, uint32_t call, int* timed_out) {
  *reinterpret_cast<volatile uint32_t*>(peer) = call;
  __threadfence_system();
  uint64_t t0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  while (*mine < call) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 > 2000000000ull) {  // 2 s: the peer never came
      *timed_out = 1;
      return;
    }
  }
}

__global__ void touch(const uint4* in, uint4* out) {
  const int i = threadIdx.x;
  if (i < static_cast<int>(kCopy / 16)) out[i] = in[i];
}

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      snprintf(sh->error, sizeof sh->error, "%s: %s", #x, cudaGetErrorString(e_));          \
      _exit(3);                                                                             \
    }                                                                                       \
  } while (0)
#define CU(x)                                                                               \
  do {                                                                                      \
    CUresult r_ = (x);                                                                      \
    if (r_ != CUDA_SUCCESS) {                                                               \
      snprintf(sh->error, sizeof sh->error, "%s: CUresult %d", #x, static_cast<int>(r_));   \
      _exit(3);                                                                             \
    }                                                                                       \
  } while (0)

// The driver's stream memory operations, found through the runtime (no link against libcuda,
// which build machines without a driver lack).
using MemOpFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
MemOpFn driver_fn(Shared* sh, const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q));
  if (!fn || q != cudaDriverEntryPointSuccess) {
    snprintf(sh->error, sizeof sh->error, "driver entry point %s not found", name);
    _exit(3);
  }
  return reinterpret_cast<MemOpFn>(fn);
}

void wait_for(std::atomic<int>& a, int v) {
  while (a.load() < v) usleep(100);
}

// One child: rank r of the pair, running `mode` for kBatches batches of iters calls.
void child(Shared* sh, int r, const char* mode, int iters) {
  CK(cudaSetDevice(0));
  // Own area: flag (4 B) at 0, copy_memop's receive buffer at 4096.
  char* mine = nullptr;
  CK(cudaMalloc(&mine, 2 * kCopy));
  CK(cudaMemset(mine, 0, 2 * kCopy));
  CK(cudaIpcGetMemHandle(&sh->mem[r], mine));
  sh->published.fetch_add(1);
  wait_for(sh->published, 2);
  char* peer = nullptr;
  CK(cudaIpcOpenMemHandle(reinterpret_cast<void**>(&peer), sh->mem[1 - r],
                          cudaIpcMemLazyEnablePeerAccess));
  uint32_t* my_flag = reinterpret_cast<uint32_t*>(mine);
  uint32_t* peer_flag = reinterpret_cast<uint32_t*>(peer);
  const bool host = strcmp(mode, "memop_host") == 0;
  if (host) {
    CK(cudaHostRegister(sh->host_flag, sizeof sh->host_flag, cudaHostRegisterMapped));
    uint32_t* dev = nullptr;
    CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&dev), sh->host_flag, 0));
    my_flag = dev + 32 * r;
    peer_flag = dev + 32 * (1 - r);
  }
  const MemOpFn write32 = driver_fn(sh, "cuStreamWriteValue32");
  const MemOpFn wait32 = driver_fn(sh, "cuStreamWaitValue32");
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  char* src = nullptr;
  int* timed_out = nullptr;
  CK(cudaMalloc(&src, kCopy));
  CK(cudaMallocManaged(&timed_out, sizeof(int)));
  *timed_out = 0;
  CK(cudaDeviceSynchronize());
  uint32_t call = 0;
  auto one = [&] {
    ++call;
    if (strcmp(mode, "spin") == 0) {
      spin_call<<<1, 1, 0, s>>>(my_flag, peer_flag, call, timed_out);
      return;
    }
    if (strcmp(mode, "copy_memop") == 0)
      CK(cudaMemcpyAsync(peer + kCopy, src, kCopy, cudaMemcpyDeviceToDevice, s));
    CU(write32(s, reinterpret_cast<CUdeviceptr>(peer_flag), call, CU_STREAM_WRITE_VALUE_DEFAULT));
    CU(wait32(s, reinterpret_cast<CUdeviceptr>(my_flag), call, CU_STREAM_WAIT_VALUE_GEQ));
    if (strcmp(mode, "copy_memop") == 0)
      touch<<<1, kCopy / 16, 0, s>>>(reinterpret_cast<const uint4*>(mine + kCopy),
                                     reinterpret_cast<uint4*>(src));
  };
  for (int i = 0; i < 3; ++i) one();  // warm-up
  CK(cudaStreamSynchronize(s));
  for (int b = 0; b < kBatches; ++b) {
    sh->go.fetch_add(1);  // both ranks start a batch together
    wait_for(sh->go, 2 * (b + 1));
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) one();
    CK(cudaStreamSynchronize(s));
    const auto t1 = std::chrono::steady_clock::now();
    if (*timed_out) {
      snprintf(sh->error, sizeof sh->error, "a spin wait timed out (2 s)");
      _exit(4);
    }
    if (r == 0) sh->us[b] = std::chrono::duration<double, std::micro>(t1 - t0).count() / iters;
  }
  sh->done.fetch_add(1);
  _exit(0);
}

// Runs one mode in two fresh processes; prints its line.
void run_mode(const char* mode, int iters) {
  auto* sh = static_cast<Shared*>(mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE,
                                       MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  new (sh) Shared{};
  pid_t pid[2];
  for (int r = 0; r < 2; ++r) {
    pid[r] = fork();
    if (pid[r] == 0) child(sh, r, mode, iters);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(g_limit_s);
  bool ended[2] = {false, false};
  int left = 2;
  bool failed = false;
  while (left && std::chrono::steady_clock::now() < deadline) {
    for (int r = 0; r < 2; ++r) {
      int st = 0;
      if (!ended[r] && waitpid(pid[r], &st, WNOHANG) == pid[r]) {
        ended[r] = true, --left;
        failed |= !WIFEXITED(st) || WEXITSTATUS(st) != 0;
      }
    }
    if (failed) break;  // the other process would wait for it until the limit
    usleep(1000);
  }
  for (int r = 0; r < 2; ++r)
    if (!ended[r]) {
      kill(pid[r], SIGKILL);
      waitpid(pid[r], nullptr, 0);
    }
  if (failed) {
    printf("%-11s %6d  failed: %s\n", mode, iters, sh->error[0] ? sh->error : "a process died");
  } else if (left) {
    const int batches = static_cast<int>(
        std::count_if(sh->us, sh->us + kBatches, [](double u) { return u > 0; }));
    printf("%-11s %6d  ran past %d s (%d of %d batches)%s%s\n", mode, iters, g_limit_s, batches,
           kBatches, sh->error[0] ? ": " : "", sh->error);
  } else if (sh->done.load() != 2) {
    printf("%-11s %6d  failed: %s\n", mode, iters, sh->error[0] ? sh->error : "a process died");
  } else {
    std::vector<double> v(sh->us, sh->us + kBatches);
    std::sort(v.begin(), v.end());
    printf("%-11s %6d  %10.2f us per call (batches %.2f .. %.2f)\n", mode, iters, v[kBatches / 2],
           v.front(), v.back());
  }
  fflush(stdout);
  munmap(sh, sizeof(Shared));
}

}  // namespace

int main(int argc, char** argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 200;
  if (argc > 2) g_limit_s = atoi(argv[2]);
  printf("# gpu_handshake: 2 processes on GPU 0, %d calls per batch, median of %d batches\n", iters,
         kBatches);
  printf("%-11s %6s  %s\n", "mode", "calls", "time");
  fflush(stdout);
  // spin first with few calls: without MPS each call may wait a whole time slice.
  run_mode("spin", std::max(1, iters / 10));
  for (const char* m : {"memop", "memop_host", "copy_memop"}) run_mode(m, iters);
  return 0;
}
