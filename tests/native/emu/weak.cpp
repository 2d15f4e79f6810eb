// The weak memory mode of the emulated device (emu_set_weak, EMU_WEAK; tests/native/emu/README.md).
// x86 keeps stores in order and loads fresh, which hides a missing fence. In this mode, inside a
// kernel, the data accesses (__stcg/__ldcg, through which the kernels move all data and headers)
// behave as a weak GPU's may:
// - a store sits in its thread's buffer and reaches memory late and in random order, unless a
//   release (a release store, __threadfence*, an acq_rel fence, an atomic) flushes it first;
//   __syncthreads hands a thread's buffered stores to its block, so that the next release of any
//   thread of the block flushes them too (cumulativity), and kernel end flushes everything;
// - a load may return the value this thread read earlier at that address (its private cache)
//   until an acquire (ld.acquire, an acq_rel fence, an atomic) by the thread, or by another
//   thread of its block followed by a __syncthreads, clears it.
// Flags (atomics) are read and written directly: they are what the protocols order by. Granules
// are 16 bytes (the widest access, always naturally aligned). All state is per block: a block's
// threads are fibers on one OS thread, so nothing here takes a lock.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda_runtime.h"
#include "emu.h"

namespace emu {

int current_fiber();  // runtime.cpp: the running fiber's index in its block, -1 outside kernels
std::atomic<bool> weak_on{false};

namespace {

constexpr size_t kThreadBuffer = 8;  // stores a thread holds before one is forced out
constexpr size_t kBlockBuffer = 32;
constexpr unsigned kFlushOneIn = 16;  // chance per store that a random buffered store lands
constexpr size_t kCacheLines = 64;    // direct-mapped

uint64_t env_seed() {
  const char* v = std::getenv("EMU_WEAK");
  return v && *v ? std::strtoull(v, nullptr, 0) : 0;
}
std::atomic<uint64_t> g_seed{env_seed()};
const bool g_env_init = (weak_on = g_seed.load() != 0, true);

struct Entry {
  uintptr_t granule;
  uint16_t mask;  // bytes of the granule this entry holds
  uint8_t data[16];
};
struct Line {
  uintptr_t granule = 0;  // 0: empty
  uint8_t data[16];
};
struct Thread {
  std::vector<Entry> buf;
  Line cache[kCacheLines];
};
struct Block {
  std::vector<Thread> th;
  std::vector<Entry> shared;  // handed over at __syncthreads, flushed by the block's next release
  bool acquired = false;      // an acquire since the last barrier
  uint64_t rng = 1;
  bool on = false;
};
thread_local Block tl;

uint64_t next(Block& b) {
  b.rng ^= b.rng << 13, b.rng ^= b.rng >> 7, b.rng ^= b.rng << 17;
  return b.rng;
}
Line& line_of(Thread& t, uintptr_t g) { return t.cache[(g >> 4) % kCacheLines]; }
void forget(uintptr_t g) {  // a store of this block: no thread of it may read older bytes there
  for (Thread& t : tl.th) {
    Line& l = line_of(t, g);
    if (l.granule == g) l.granule = 0;
  }
}
void write_out(const Entry& e) {
  // An aligned 8-byte part held whole lands in one store (an LL word: data and flag together, as
  // the GPU's single-copy atomic 8-byte store); other bytes one by one.
  auto* m = reinterpret_cast<uint8_t*>(e.granule);
  for (int h = 0; h < 16; h += 8) {
    if (((e.mask >> h) & 0xff) == 0xff) {
      uint64_t v;
      std::memcpy(&v, e.data + h, 8);
      __atomic_store_n(reinterpret_cast<uint64_t*>(m + h), v, __ATOMIC_RELAXED);
      continue;
    }
    for (int i = h; i < h + 8; ++i)
      if (e.mask >> i & 1) m[i] = e.data[i];
  }
}
Entry* find(std::vector<Entry>& v, uintptr_t g) {
  for (Entry& e : v)
    if (e.granule == g) return &e;
  return nullptr;
}
void merge(std::vector<Entry>& v, const Entry& e) {
  if (Entry* old = find(v, e.granule)) {
    for (int i = 0; i < 16; ++i)
      if (e.mask >> i & 1) old->data[i] = e.data[i];
    old->mask |= e.mask;
  } else {
    v.push_back(e);
  }
}
void remove_at(std::vector<Entry>& v, size_t i) {
  v[i] = v.back();
  v.pop_back();
}
void flush_shared_at(size_t i) {
  write_out(tl.shared[i]);
  remove_at(tl.shared, i);
}
void flush_thread_at(Thread& t, size_t i) {
  // The block's copy of this granule is older: it lands first (coherence).
  for (size_t k = 0; k < tl.shared.size(); ++k)
    if (tl.shared[k].granule == t.buf[i].granule) {
      flush_shared_at(k);
      break;
    }
  write_out(t.buf[i]);
  remove_at(t.buf, i);
}
Thread* me() {
  if (!tl.on) return nullptr;
  const int i = current_fiber();
  return i < 0 ? nullptr : &tl.th[static_cast<size_t>(i)];
}

}  // namespace

void weak_block_begin(size_t threads, uint64_t seed) {
  tl.on = weak_on.load(std::memory_order_relaxed);
  if (!tl.on) return;
  tl.th.assign(threads, Thread{});
  tl.shared.clear();
  tl.acquired = false;
  tl.rng = (seed ^ g_seed.load() * 0x9e3779b97f4a7c15ull) | 1;
}

void weak_block_end() {
  if (!tl.on) return;
  while (!tl.shared.empty()) flush_shared_at(next(tl) % tl.shared.size());
  for (Thread& t : tl.th)
    while (!t.buf.empty()) flush_thread_at(t, next(tl) % t.buf.size());
  tl.on = false;
}

void weak_store(void* p, const void* v, size_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), g = a & ~uintptr_t{15};
  Thread* t = me();
  if (!t || (a & 15) + n > 16) {
    std::memcpy(p, v, n);
    return;
  }
  Entry e{g, static_cast<uint16_t>(((1u << n) - 1) << (a & 15)), {}};
  std::memcpy(e.data + (a & 15), v, n);
  merge(t->buf, e);
  forget(g);
  if (t->buf.size() > kThreadBuffer || next(tl) % kFlushOneIn == 0)
    flush_thread_at(*t, next(tl) % t->buf.size());
}

void weak_load(const void* p, void* out, size_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p), g = a & ~uintptr_t{15};
  Thread* t = me();
  if (!t || (a & 15) + n > 16) {
    std::memcpy(out, p, n);
    return;
  }
  Line& l = line_of(*t, g);
  if (l.granule != g) {  // a miss: memory as it is now, kept for the next load without an acquire
    std::memcpy(l.data, reinterpret_cast<const void*>(g), 16);
    l.granule = g;
  }
  uint8_t d[16];
  std::memcpy(d, l.data, 16);
  for (const Entry* e : {find(tl.shared, g), find(t->buf, g)})  // older, then this thread's own
    if (e)
      for (int i = 0; i < 16; ++i)
        if (e->mask >> i & 1) d[i] = e->data[i];
  std::memcpy(out, d + (a & 15), n);
}

void weak_release() {
  Thread* t = me();
  if (!t) return;
  while (!tl.shared.empty()) flush_shared_at(next(tl) % tl.shared.size());
  while (!t->buf.empty()) flush_thread_at(*t, next(tl) % t->buf.size());
}

// A thread polling a flag (spin_hint): its buffered stores still drain, one now and then, as a
// GPU's do without any fence (forward progress; the LL protocol's words rely on nothing else).
void weak_spin() {
  Thread* t = me();
  if (!t || next(tl) % 4) return;
  if (!t->buf.empty()) flush_thread_at(*t, next(tl) % t->buf.size());
  else if (!tl.shared.empty()) flush_shared_at(next(tl) % tl.shared.size());
}

void weak_acquire() {
  Thread* t = me();
  if (!t) return;
  for (Line& l : t->cache) l.granule = 0;
  tl.acquired = true;
}

void weak_barrier_arrive() {
  Thread* t = me();
  if (!t) return;
  for (const Entry& e : t->buf) merge(tl.shared, e);
  t->buf.clear();
  while (tl.shared.size() > kBlockBuffer) flush_shared_at(next(tl) % tl.shared.size());
}

void weak_barrier_release() {
  if (!tl.on || !tl.acquired) return;
  for (Thread& t : tl.th)
    for (Line& l : t.cache) l.granule = 0;
  tl.acquired = false;
}

}  // namespace emu

extern "C" void emu_set_weak(uint64_t seed) {
  emu::g_seed = seed;
  emu::weak_on = seed != 0;
}
