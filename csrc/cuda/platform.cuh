// What the kernels need from the platform, in one place: the kernel launch, ordered loads and
// stores of flags at system scope, the clock, and a hint in spin loops. Under nvcc these are CUDA
// and inline PTX. Under RINGREDUCE_EMU (tests only: the emulated device of tests/native/emu/,
// compiled by the host compiler) they are C++ atomics with at least the same ordering; the rest of
// the kernel code is the same text in both builds.
#pragma once
#include <cstdint>

#ifdef RINGREDUCE_EMU
#include <chrono>
#endif

// RR_LAUNCH(kernel, grid, block, stream, args...): kernel is a plain name (take a template
// instance's address into a variable first: template arguments would split the macro's arguments).
// RR_LAUNCH_WARPS: the same, for a kernel whose warps exchange values (warp_max, warp_gather): the
// emulator, which runs fewer threads than asked, runs whole warps of it.
#ifndef RINGREDUCE_EMU
#define RR_LAUNCH(kernel, grid, block, stream, ...) \
  kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#define RR_LAUNCH_WARPS RR_LAUNCH
#else
#define RR_LAUNCH(kernel, grid, block, stream, ...) \
  ::emu::launch((grid), (block), (stream), [=] { kernel(__VA_ARGS__); })
#define RR_LAUNCH_WARPS(kernel, grid, block, stream, ...) \
  ::emu::launch((grid), (block), (stream), [=] { kernel(__VA_ARGS__); }, true)
#endif

// RR_NOINLINE: a device function compiled once per kernel, not at every call site. The span loops
// are called at 5-7 sites per kernel; inlined, they made the kernels' file the build's longest step
// (80 kernels per architecture; cicc took twice as long). A call is a few instructions per round of
// at least 32 KiB, against the round's thousands of 16-byte loads (not measured on a GPU yet).
#ifndef RINGREDUCE_EMU
#define RR_NOINLINE __noinline__
#else
#define RR_NOINLINE __attribute__((noinline))
#endif

namespace ringreduce::cuda {

#ifndef RINGREDUCE_EMU

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// A flag raised after fence_acq_rel_sys (a release pattern: one fence for several flags).
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// The ring's flag polls: relaxed (no L1 invalidation per spin, as ld.acquire does), then one
// acquire fence once the flag is seen. The workspace's barriers poll with ld_acquire_sys.
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// fence.acq_rel.sys: after a relaxed poll, the acquire; before relaxed flag stores, the release
// (of the block's earlier accesses too, once a barrier has ordered them before this thread's).
__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
// The emulator's cost model hears of every completed wait (tests/native/emu/README.md); nothing here.
__device__ __forceinline__ void note_wait(const void*) {}
__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// A GPU thread spinning alone costs nothing to its neighbours' progress.
__device__ __forceinline__ void spin_hint() {}
// LL words (p2p/ll_kernel.cu): 8 bytes, a data word and its flag, stored and loaded whole (an
// aligned 8-byte access is single-copy atomic), volatile: never from a stale L1 line.
__device__ __forceinline__ void st_ll(uint64_t* p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_ll(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
// Two LL words in one 16-byte access (p 16-byte aligned): each 8-byte half is still single-copy
// atomic, so each half carries its own flag (NCCL's LL reads 16 bytes a poll the same way).
__device__ __forceinline__ void st_ll2(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ void ld_ll2(const uint64_t* p, uint64_t* a, uint64_t* b) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(*a), "=l"(*b) : "l"(p) : "memory");
}
// The emulator's cost model counts an LL word's bytes once, when its flag matched; nothing here.
__device__ __forceinline__ void ll_arrived(const void*) {}
// The narrow wire's fp8 scales (p2p/sym_wire.cu): v[u] = the largest v[u] over the calling warp,
// in every thread of it. Every thread of the (full, converged) warp makes the call.
template <int U>
__device__ __forceinline__ void warp_max(uint32_t (&v)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
#if __CUDA_ARCH__ >= 800
    v[u] = __reduce_max_sync(0xffffffffu, v[u]);  // one redux.sync
#else
    for (int d = 16; d > 0; d >>= 1) v[u] = max(v[u], __shfl_xor_sync(0xffffffffu, v[u], d));
#endif
  }
}
// v[u] = the value `mine` of the calling warp's lane u, for u < U, in every thread of the warp
// (the same rule).
template <int U>
__device__ __forceinline__ void warp_gather(uint32_t mine, uint32_t (&v)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) v[u] = __shfl_sync(0xffffffffu, mine, u);
}

#else

// The weak memory mode (tests/native/emu/weak.cpp) hears of every acquire and release; the
// happens-before check (hb.cpp), of every flag access too (a flag's clock joined before its store,
// read after its load).
inline uint64_t ld_acquire_sys(const uint64_t* p) {
  const uint64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
  ::emu::cost_flag_load(p);
  if (::emu::hb()) ::emu::hb_flag_load(p, true);
  if (::emu::weak()) ::emu::weak_acquire();
  return v;
}
inline void st_release_sys(uint64_t* p, uint64_t v) {
  if (::emu::weak()) ::emu::weak_release();
  if (::emu::hb()) ::emu::hb_fence(), ::emu::hb_flag_store(p);
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
  ::emu::cost_flag_store(p);
}
inline void st_relaxed_sys(uint64_t* p, uint64_t v) {
  if (::emu::hb()) ::emu::hb_flag_store(p);
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
  ::emu::cost_flag_store(p);
}
inline void st_relaxed_sys(uint32_t* p, uint32_t v) {
  if (::emu::hb()) ::emu::hb_flag_store(p);
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}
inline uint32_t ld_relaxed_sys(const uint32_t* p) {
  const uint32_t v = __atomic_load_n(p, __ATOMIC_RELAXED);
  ::emu::cost_flag_load(p);
  if (::emu::hb()) ::emu::hb_flag_load(p, false);
  return v;
}
inline uint64_t ld_relaxed_sys(const uint64_t* p) {
  const uint64_t v = __atomic_load_n(p, __ATOMIC_RELAXED);
  ::emu::cost_flag_load(p);
  if (::emu::hb()) ::emu::hb_flag_load(p, false);
  return v;
}
inline void fence_acq_rel_sys() {  // fence.acq_rel.sys
  ::emu::weak_fence();
  __atomic_thread_fence(__ATOMIC_ACQ_REL);
}
// A wait on flag p has ended: the emulator's cost model advances this block's clock.
inline void note_wait(const void* p) { ::emu::cost_wait(p); }
inline uint64_t globaltimer_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}
// Fibers of a block share an OS thread and blocks share 2 cores: a spinning thread lets them run.
inline void spin_hint() { ::emu::spin_hint(); }
// LL words: the store goes through the weak memory mode as data does (late, in any order with
// other stores, but whole: weak.cpp lands an aligned 8-byte part of a granule in one store); the
// load reads memory (volatile), never the weak mode's stale copy. The happens-before check does
// not track them: a word whose flag matches is its own proof of arrival.
inline void st_ll(uint64_t* p, uint64_t v) {
  if (::emu::cost_enabled.load(std::memory_order_relaxed)) ::emu::cost_access(p, 8, true);
  if (::emu::weak()) return ::emu::weak_store(p, &v, 8);
  __atomic_store_n(p, v, __ATOMIC_RELAXED);
}
inline uint64_t ld_ll(const uint64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
// Two words, each whole (a GPU makes no promise for the 16 bytes together: neither does this).
inline void st_ll2(uint64_t* p, uint64_t a, uint64_t b) {
  st_ll(p, a);
  st_ll(p + 1, b);
}
inline void ld_ll2(const uint64_t* p, uint64_t* a, uint64_t* b) {
  *a = ld_ll(p);
  *b = ld_ll(p + 1);
}
inline void ll_arrived(const void* p) {
  if (::emu::cost_enabled.load(std::memory_order_relaxed)) ::emu::cost_access(p, 8, false);
}
// The warp's exchange: a rendezvous of its 32 fibers (a divergent call aborts).
template <int U> inline void warp_max(uint32_t (&v)[U]) { ::emu::warp_max(v, U); }
template <int U> inline void warp_gather(uint32_t mine, uint32_t (&v)[U]) { ::emu::warp_gather(mine, v, U); }

#endif

}  // namespace ringreduce::cuda
