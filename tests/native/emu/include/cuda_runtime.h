// Emulated CUDA (tests only): the subset of the CUDA runtime API and of the device language that
// csrc/cuda/ uses, so that the host compiler builds those sources and runs their kernels on CPU
// threads. What it proves and what it cannot: tests/native/emu/README.md.
//
// Device language: __global__/__device__ functions are plain C++; a launch (RR_LAUNCH in
// csrc/cuda/platform.cuh) runs every block on an OS thread of its own and the block's threads as
// fibers on it, which switch at __syncthreads() and in spin loops (spin_hint). __shared__ is
// thread_local storage: one copy per OS thread, i.e. per block.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>

#ifndef RINGREDUCE_EMU
#define RINGREDUCE_EMU 1
#endif

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static thread_local

// Values as in the CUDA runtime, so that names and numbers read the same in messages.
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInitializationError = 3,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorInvalidDevicePointer = 17,
  cudaErrorInvalidMemcpyDirection = 21,
  cudaErrorNoDevice = 100,
  cudaErrorMapBufferObjectFailed = 205,
  cudaErrorInvalidDevice = 101,
  cudaErrorPeerAccessUnsupported = 217,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  cudaErrorIllegalAddress = 700,
  cudaErrorLaunchOutOfResources = 701,
  cudaErrorLaunchFailure = 719,
  cudaErrorStreamCaptureImplicit = 906,
};
typedef cudaError_t cudaError;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
// The runtime's version as CUDA 13.0 states it (csrc/cuda/ picks APIs by it).
#ifndef CUDART_VERSION
#define CUDART_VERSION 13000
#endif
enum cudaDriverEntryPointQueryResult {
  cudaDriverEntryPointSuccess = 0,
  cudaDriverEntryPointSymbolNotFound = 1,
  cudaDriverEntryPointVersionNotSufficent = 2,
};
constexpr unsigned long long cudaEnableDefault = 0;
enum cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};
enum cudaStreamCaptureMode {
  cudaStreamCaptureModeGlobal = 0,
  cudaStreamCaptureModeThreadLocal = 1,
  cudaStreamCaptureModeRelaxed = 2,
};

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventBlockingSync 0x01
#define cudaEventDisableTiming 0x02
#define cudaHostAllocDefault 0x00
#define cudaHostAllocPortable 0x01
#define cudaHostAllocMapped 0x02
#define cudaIpcMemLazyEnablePeerAccess 0x01

struct CUstream_st;
struct CUevent_st;
typedef CUstream_st* cudaStream_t;
typedef CUevent_st* cudaEvent_t;
typedef void (*cudaHostFn_t)(void* user_data);

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct cudaIpcMemHandle_t {
  char reserved[64];
};

extern "C" {
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer);
cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int device);
cudaError_t cudaDeviceGetByPCIBusId(int* device, const char* bus_id);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorName(cudaError_t e);
const char* cudaGetErrorString(cudaError_t e);

cudaError_t cudaMalloc(void** p, size_t bytes);
cudaError_t cudaFree(void* p);
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned flags);
cudaError_t cudaMallocHost(void** p, size_t bytes);
cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned flags);
// Pins memory the caller mapped (page-locked for the device): cudaHostGetDevicePointer then gives
// its device address (the same); cudaHostUnregister forgets it.
constexpr unsigned cudaHostRegisterPortable = 1, cudaHostRegisterMapped = 2;
cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned flags);
cudaError_t cudaHostUnregister(void* p);
cudaError_t cudaFreeHost(void* p);
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemset(void* p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream);

cudaError_t cudaStreamCreate(cudaStream_t* s);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags);
cudaError_t cudaStreamDestroy(cudaStream_t s);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamQuery(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status);
// This thread's capture mode, swapped with *mode (the emulator keeps it and does nothing else).
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode);
cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* user_data);
// Driver entry points: the stream memory operations cuStreamWriteValue64 and cuStreamWaitValue64
// (CU_STREAM_WAIT_VALUE_GEQ only, compared cyclically as the driver does), as stream work of the
// emulated device; any other symbol is not found. A wait never times out, as on a GPU.
cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned version,
                                             unsigned long long flags,
                                             cudaDriverEntryPointQueryResult* status);

cudaError_t cudaEventCreate(cudaEvent_t* e);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end);

cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* p);
cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t handle, unsigned flags);
cudaError_t cudaIpcCloseMemHandle(void* p);
}

// The C++ overloads of cuda_runtime.h for typed pointers.
template <class T> inline cudaError_t cudaMalloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}
template <class T> inline cudaError_t cudaHostAlloc(T** p, size_t bytes, unsigned flags) {
  return cudaHostAlloc(reinterpret_cast<void**>(p), bytes, flags);
}

// ---- device side ------------------------------------------------------------------------------
namespace emu {
const dim3& thread_idx();  // the calling fiber's threadIdx
extern thread_local dim3 block_idx, block_dim, grid_dim;
// __syncthreads() at file:line: a block whose threads meet at different barriers (divergent
// control flow around a barrier: undefined behaviour in CUDA, a hang or a silent mismatch on a GPU)
// aborts the process naming both places.
void syncthreads(const char* file = nullptr, int line = 0);
// __syncthreads_or(pred): the same barrier, returning whether pred was non-zero on any thread.
int syncthreads_or(int pred, const char* file, int line);
// v[u] = the largest v[u] of the calling warp's threads (32 consecutive threads), for u < count
// <= 8; every thread of the warp must make the same call (a divergent one aborts, naming the warp).
void warp_max(uint32_t* v, int count);
// out[u] = the value `mine` of the warp's thread u (lane u), for u < count <= 32; the same rule.
void warp_gather(uint32_t mine, uint32_t* out, int count);
// In spin loops: lets the block's other fibers and the other OS threads run (2 cores, many blocks).
void spin_hint();
// Enqueues body on stream to run grid x block times; a bad configuration sets the last error.
// warps: the kernel exchanges values within warps (warp_max): whole warps of 32 threads run.
void launch(dim3 grid, dim3 block, cudaStream_t stream, std::function<void()> body, bool warps = false);
// The cost model (cost.cpp; emu_cost_* in emu.h): hooks of data accesses, flag stores and
// completed waits, called by the device code below and by csrc/cuda/platform.cuh.
extern std::atomic<bool> cost_enabled;
void cost_access(const void* p, size_t bytes, bool store);
void cost_flag_store(const void* p);
void cost_wait(const void* p);
void cost_flag_load(const void* p);  // a flag load: counted if it reads pinned host memory
void cost_spin();                    // a block's thread polls again (spin_hint)
void cost_map_host(const void* base, size_t bytes);  // pinned host memory (runtime.cpp)
void cost_unmap_host(const void* base);
// The weak memory mode (weak.cpp; emu_set_weak in emu.h): data accesses through per-thread store
// buffers and caches; releases flush them, acquires clear them. No-ops outside kernels.
extern std::atomic<bool> weak_on;
void weak_store(void* p, const void* v, size_t n);
void weak_load(const void* p, void* out, size_t n);
void weak_release();
void weak_acquire();
void weak_spin();
inline bool weak() { return weak_on.load(std::memory_order_relaxed); }
// The happens-before check (hb.cpp; emu_set_hb in emu.h): data stores stamped, data loads checked
// against what the block has acquired; flags carry clocks. No-ops outside kernels.
extern std::atomic<bool> hb_on;
inline bool hb() { return hb_on.load(std::memory_order_relaxed); }
void hb_access(const void* p, size_t n, bool store);
void hb_fence();
void hb_flag_store(const void* p);
void hb_flag_load(const void* p, bool acquire);
inline void weak_fence() {  // acq_rel: what came before lands, what comes after reads fresh
  if (hb()) hb_fence();
  if (!weak()) return;
  weak_release();
  weak_acquire();
}
}  // namespace emu

#define threadIdx (::emu::thread_idx())
#define blockIdx (::emu::block_idx)
#define blockDim (::emu::block_dim)
#define gridDim (::emu::grid_dim)

#define __syncthreads() ::emu::syncthreads(__FILE__, __LINE__)
#define __syncthreads_or(pred) ::emu::syncthreads_or((pred), __FILE__, __LINE__)
inline void __threadfence() {
  ::emu::weak_fence();
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
inline void __threadfence_system() {
  ::emu::weak_fence();
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
inline unsigned atomicCAS(unsigned* p, unsigned compare, unsigned value) {
  ::emu::weak_fence();
  if (::emu::hb()) ::emu::hb_flag_load(p, true);
  __atomic_compare_exchange_n(p, &compare, value, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  if (::emu::hb()) ::emu::hb_flag_store(p);
  return compare;
}
inline unsigned atomicCAS_system(unsigned* p, unsigned compare, unsigned value) {
  return atomicCAS(p, compare, value);
}
// atomicMax on shared memory (sym_wire.cu): a block's threads are fibers of one OS thread that
// switch only at barriers and spin hints, so a plain read-modify-write is atomic among them.
inline unsigned atomicMax(unsigned* p, unsigned v) {
  const unsigned old = *p;
  if (v > old) *p = v;
  return old;
}
// Rounded float arithmetic that nvcc never fuses into an FMA; the emulator builds with
// -ffp-contract=off (cmake/emu.cmake), so plain operators round alike.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
// Cache-hint loads and stores: plain accesses on the CPU (its caches are coherent). The kernels
// move all their data through these, so the cost model counts it here.
template <class T> inline T __ldcg(const T* p) {
  if (::emu::cost_enabled.load(std::memory_order_relaxed)) ::emu::cost_access(p, sizeof(T), false);
  if (::emu::hb()) ::emu::hb_access(p, sizeof(T), false);
  if (::emu::weak()) {
    T v;
    ::emu::weak_load(p, &v, sizeof(T));
    return v;
  }
  return *p;
}
template <class T> inline void __stcg(T* p, T v) {
  if (::emu::cost_enabled.load(std::memory_order_relaxed)) ::emu::cost_access(p, sizeof(T), true);
  if (::emu::hb()) ::emu::hb_access(p, sizeof(T), true);
  if (::emu::weak()) return ::emu::weak_store(p, &v, sizeof(T));
  *p = v;
}
