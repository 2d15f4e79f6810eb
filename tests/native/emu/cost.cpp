// The emulated device's cost model (tests/native/emu/README.md, "Counting costs"): what a GPU timer
// cannot tell us here, counted instead. Per device: bytes read and written in its own memory and in
// other devices' memory (through IPC mappings), completed waits on local and remote flags, remote
// flag stores, and a logical clock in half round trips (one-way latencies) that follows the chain
// of dependent remote accesses across blocks, kernels and ranks:
//   - a store to a flag is stamped with the time it lands: the writer's clock, plus one one-way
//     latency if the flag is remote or the block has written remote data before it (release);
//   - a completed wait on a local flag moves the waiter's clock to the flag's stamp at least; on a
//     remote flag, to a round trip past the later of the two (a poll must go and come back);
//   - a remote data load costs a round trip, once per clock value: loads issued without a wait in
//     between are in flight together;
//   - remote data stores are posted: they cost the writer nothing, the flag that follows carries
//     their latency;
//   - a flag load from pinned host memory before the block first spun in a wait costs a round trip
//     and is counted (host_reads): on a GPU a PCIe read on the path of every call. A wait's own
//     occasional check of a host word is not (it runs only once the wait is long).
// A kernel's blocks start at their stream's clock; the stream's clock becomes the latest block's.
// Off unless emu_cost_enable(1): every hook returns at the first branch.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <shared_mutex>
#include <unordered_map>
#include <vector>

#include "cuda_runtime.h"
#include "emu.h"

namespace emu {

std::atomic<bool> cost_enabled{false};
void cost_reset_stream_clocks();  // runtime.cpp
int current_fiber();              // runtime.cpp: the calling thread's index in its block, or -1

namespace {

constexpr int kMaxDevices = 64;

struct Range {
  uintptr_t begin, end;
  int device;
  uint64_t id;  // the allocation: its IPC mappings share it, so flags match across mappings
};
std::shared_mutex g_ranges_mu;
std::vector<Range> g_ranges;  // sorted by begin
std::atomic<uint64_t> g_ranges_ver{1};

struct Counters {
  std::atomic<uint64_t> v[11];
};
Counters g_dev[kMaxDevices];
// Those before kClock are counted per block (Block::n) and summed at its end.
enum { kRemoteRead, kRemoteWrite, kLocalRead, kLocalWrite, kRemoteWaits, kLocalWaits, kRemotePosts,
       kHostReads, kLaunches, kClock, kThreadWaits };
std::vector<std::pair<uintptr_t, uintptr_t>> g_host_ranges;  // pinned host memory; g_ranges_mu

std::mutex g_stamps_mu;
std::unordered_map<uint64_t, uint64_t> g_stamps;  // flag (allocation id, offset) -> landing time

// The calling block's state: every fiber of a block runs on one OS thread.
struct Block {
  int device = -1;  // -1: not in a kernel (host code): not counted
  uint64_t clock = 0;
  uint64_t read_at = ~0ull;  // the clock at which the last remote load returned
  bool remote_written = false;
  bool spun = false;  // a thread of the block has polled again in a wait
  uint64_t n[kClock] = {};
  std::vector<uint32_t> waits;  // completed waits by thread (fiber) of the block
  uint64_t hit_ver = 0;
  Range hit[4]{};  // the last ranges found (a kernel's accesses alternate between a few)
  int next = 0;
};
thread_local Block tl;

// The range holding p, or null (host memory).
const Range* find(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uint64_t ver = g_ranges_ver.load(std::memory_order_acquire);
  if (tl.hit_ver == ver) {
    for (const Range& h : tl.hit)
      if (a >= h.begin && a < h.end) return &h;
  } else {
    for (Range& h : tl.hit) h = Range{};
    tl.hit_ver = ver;
  }
  std::shared_lock<std::shared_mutex> lk(g_ranges_mu);
  auto it = std::upper_bound(g_ranges.begin(), g_ranges.end(), a,
                             [](uintptr_t x, const Range& r) { return x < r.begin; });
  if (it == g_ranges.begin()) return nullptr;
  --it;
  if (a >= it->end) return nullptr;
  Range& h = tl.hit[tl.next++ & 3];
  h = *it;
  return &h;
}

uint64_t key(const Range& r, const void* p) {
  return (r.id << 36) ^ (reinterpret_cast<uintptr_t>(p) - r.begin);
}

}  // namespace

// For the happens-before check (hb.cpp): p's key, the same through every mapping of its allocation.
bool cost_key(const void* p, uint64_t* k) {
  const Range* r = find(p);
  if (!r) return false;
  *k = key(*r, p);
  return true;
}

void cost_map(const void* base, size_t bytes, int device, uint64_t id) {
  std::unique_lock<std::shared_mutex> lk(g_ranges_mu);
  const Range r{reinterpret_cast<uintptr_t>(base), reinterpret_cast<uintptr_t>(base) + bytes, device, id};
  g_ranges.insert(std::upper_bound(g_ranges.begin(), g_ranges.end(), r.begin,
                                   [](uintptr_t x, const Range& q) { return x < q.begin; }),
                  r);
  g_ranges_ver.fetch_add(1, std::memory_order_release);
}

void cost_unmap(const void* base) {
  std::unique_lock<std::shared_mutex> lk(g_ranges_mu);
  const uintptr_t b = reinterpret_cast<uintptr_t>(base);
  g_ranges.erase(std::remove_if(g_ranges.begin(), g_ranges.end(), [&](const Range& r) { return r.begin == b; }),
                 g_ranges.end());
  g_ranges_ver.fetch_add(1, std::memory_order_release);
}

void cost_map_host(const void* base, size_t bytes) {
  std::unique_lock<std::shared_mutex> lk(g_ranges_mu);
  const uintptr_t b = reinterpret_cast<uintptr_t>(base);
  g_host_ranges.emplace_back(b, b + bytes);
}

void cost_unmap_host(const void* base) {
  std::unique_lock<std::shared_mutex> lk(g_ranges_mu);
  const uintptr_t b = reinterpret_cast<uintptr_t>(base);
  g_host_ranges.erase(std::remove_if(g_host_ranges.begin(), g_host_ranges.end(),
                                     [&](const std::pair<uintptr_t, uintptr_t>& r) { return r.first == b; }),
                      g_host_ranges.end());
}

void cost_spin() { tl.spun = true; }

void cost_flag_load(const void* p) {
  if (!cost_enabled.load(std::memory_order_relaxed) || tl.device < 0 || tl.spun) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  bool host = false;
  {
    std::shared_lock<std::shared_mutex> lk(g_ranges_mu);
    for (const auto& r : g_host_ranges) host = host || (a >= r.first && a < r.second);
  }
  if (!host) return;
  ++tl.n[kHostReads];
  tl.clock += 2;
}

void cost_access(const void* p, size_t bytes, bool store) {
  if (tl.device < 0) return;
  const Range* r = find(p);
  const bool remote = r && r->device != tl.device;
  if (!remote) {
    tl.n[store ? kLocalWrite : kLocalRead] += bytes;
    return;
  }
  if (store) {
    tl.n[kRemoteWrite] += bytes;
    tl.remote_written = true;
    return;
  }
  tl.n[kRemoteRead] += bytes;
  if (tl.read_at != tl.clock) {
    tl.clock += 2;
    tl.read_at = tl.clock;
  }
}

void cost_flag_store(const void* p) {
  if (!cost_enabled.load(std::memory_order_relaxed) || tl.device < 0) return;
  const Range* r = find(p);
  if (!r) return;
  const bool remote = r->device != tl.device;
  if (remote) ++tl.n[kRemotePosts];
  const uint64_t lands = tl.clock + (remote || tl.remote_written ? 1 : 0);
  std::lock_guard<std::mutex> lk(g_stamps_mu);
  uint64_t& s = g_stamps[key(*r, p)];
  s = std::max(s, lands);
}

void cost_wait(const void* p) {
  if (!cost_enabled.load(std::memory_order_relaxed) || tl.device < 0) return;
  const Range* r = find(p);
  if (!r) return;
  uint64_t s = 0;
  {
    std::lock_guard<std::mutex> lk(g_stamps_mu);
    auto it = g_stamps.find(key(*r, p));
    if (it != g_stamps.end()) s = it->second;
  }
  const int f = current_fiber();
  if (f >= 0) {
    if (tl.waits.size() <= static_cast<size_t>(f)) tl.waits.resize(f + 1);
    ++tl.waits[f];
  }
  if (r->device != tl.device) {
    ++tl.n[kRemoteWaits];
    tl.clock = std::max(tl.clock + 2, s + 1);
  } else {
    ++tl.n[kLocalWaits];
    tl.clock = std::max(tl.clock, s);
  }
}

void cost_block_begin(int device, uint64_t clock) {
  tl.device = cost_enabled.load(std::memory_order_relaxed) ? device : -1;
  tl.clock = clock;
  tl.read_at = ~0ull;
  tl.remote_written = false;
  tl.spun = false;
  std::memset(tl.n, 0, sizeof tl.n);
  tl.waits.clear();
}

uint64_t cost_block_end() {
  if (tl.device < 0) return tl.clock;
  Counters& c = g_dev[tl.device];
  for (int i = 0; i < kClock; ++i)
    if (tl.n[i]) c.v[i].fetch_add(tl.n[i], std::memory_order_relaxed);
  // The most waits one thread of the block made: a barrier is one wait per thread and peer, so a
  // kernel whose thread q waits for peer q counts its barriers here.
  uint64_t most = 0;
  for (uint32_t w : tl.waits) most = std::max<uint64_t>(most, w);
  uint64_t cur = c.v[kThreadWaits].load();
  while (cur < most && !c.v[kThreadWaits].compare_exchange_weak(cur, most)) {
  }
  tl.device = -1;
  return tl.clock;
}

void cost_kernel_end(int device, uint64_t clock) {
  if (!cost_enabled.load(std::memory_order_relaxed)) return;
  Counters& c = g_dev[device];
  c.v[kLaunches].fetch_add(1, std::memory_order_relaxed);
  uint64_t cur = c.v[kClock].load();
  while (cur < clock && !c.v[kClock].compare_exchange_weak(cur, clock)) {
  }
}

void cost_copy(int device, const void* dst, const void* src, size_t bytes) {
  if (!cost_enabled.load(std::memory_order_relaxed)) return;
  const Range* s = find(src);
  const Range* d = find(dst);
  if (!s || !d) return;  // to or from host memory: not the device's traffic
  Counters& c = g_dev[device];
  c.v[s->device == device ? kLocalRead : kRemoteRead].fetch_add(bytes);
  c.v[d->device == device ? kLocalWrite : kRemoteWrite].fetch_add(bytes);
}

}  // namespace emu

extern "C" {

void emu_cost_enable(int on) { emu::cost_enabled = on != 0; }

void emu_cost_reset() {
  for (auto& d : emu::g_dev)
    for (auto& v : d.v) v = 0;
  std::lock_guard<std::mutex> lk(emu::g_stamps_mu);
  emu::g_stamps.clear();
  emu::cost_reset_stream_clocks();
}

void emu_cost_get(int device, EmuCost* out) {
  const auto& v = emu::g_dev[device].v;
  out->remote_read = v[emu::kRemoteRead];
  out->remote_write = v[emu::kRemoteWrite];
  out->local_read = v[emu::kLocalRead];
  out->local_write = v[emu::kLocalWrite];
  out->remote_waits = v[emu::kRemoteWaits];
  out->local_waits = v[emu::kLocalWaits];
  out->remote_posts = v[emu::kRemotePosts];
  out->launches = v[emu::kLaunches];
  out->half_round_trips = v[emu::kClock];
  out->max_thread_waits = v[emu::kThreadWaits];
  out->host_reads = v[emu::kHostReads];
}

}  // extern "C"
