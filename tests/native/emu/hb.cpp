// The happens-before check of the emulated device (emu_set_hb, EMU_HB; tests/native/emu/README.md):
// a data load in a kernel must see a store that happens before it. The weak mode (weak.cpp) makes
// a missing release visible by landing stores late; a missing acquire needs a stale value at the
// right moment, which timing on 2 cores rarely gives. This check needs no timing: it follows the
// synchronization itself, as a race detector does, with vector clocks.
// - Agents are running blocks (every thread of a block is one agent: __syncthreads orders them,
//   so what is checked is the order between blocks and ranks). A block's clock advances at each of
//   its releases; its data stores (__stcg) are stamped (agent, clock), per byte.
// - A release (a fence, a release store, an atomic) takes a snapshot of the block's vector clock;
//   a flag store after it (st.relaxed after fence.acq_rel, st.release) joins the snapshot into the
//   flag's clock. A relaxed flag load joins the flag's clock into the block's pending clock, which
//   only an acquire turns into knowledge (a later fence or atomic by the block; ld.acquire joins
//   at once): C++'s and PTX's fence-synchronization, where a relaxed poll with no acquire after it
//   orders nothing.
// - A data load of a byte another agent stored is a race unless that store's clock is in the
//   block's vector clock. Kernels that ended are in every later block's clock (stream order and
//   host synchronization are taken as given: ordering between kernels is not what this checks).
// Off unless enabled: every hook returns at its first branch. Only stores and loads through
// __stcg/__ldcg (all data and headers the kernels move) are stamped and checked.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_runtime.h"
#include "emu.h"

namespace emu {

bool cost_key(const void* p, uint64_t* key);  // cost.cpp: (allocation, offset), the same in every mapping

std::atomic<bool> hb_on{false};

namespace {

using VC = std::vector<uint32_t>;
void join(VC& into, const VC& from) {
  if (into.size() < from.size()) into.resize(from.size(), 0);
  for (size_t i = 0; i < from.size(); ++i)
    if (from[i] > into[i]) into[i] = from[i];
}
uint32_t at(const VC& v, uint32_t a) { return a < v.size() ? v[a] : 0; }

const bool g_env_init = [] {
  const char* v = std::getenv("EMU_HB");
  hb_on = v && *v && *v != '0';
  return true;
}();

// Agents: ids reused by later blocks, each id's clock only growing, so a stamp of an earlier user
// of an id is never mistaken for a later one's.
std::mutex g_mu;
VC g_ended;                    // every ended block's final clock
std::vector<uint32_t> g_free;  // ids no running block holds
VC g_last;                     // per id: the last clock it reached

struct Stamp {
  uint32_t agent = 0, clock = 0;  // clock 0: never stored by a kernel
};
// One stamp for the 16 bytes while one store wrote them all (the kernels' vector stores); per byte
// once stores of different blocks share the granule (the elements at the ends of blocks' parts).
struct Granule {
  Stamp all;
  std::unique_ptr<Stamp[]> bytes;
  const Stamp& at(size_t i) const { return bytes ? bytes[i] : all; }
};
constexpr int kShards = 32;
struct Shard {
  std::mutex mu;
  std::unordered_map<uint64_t, Granule> data;  // key of a 16-byte granule -> its bytes' stamps
  std::unordered_map<uint64_t, VC> flags;      // key of a flag -> its clock
};
Shard g_shards[kShards];
Shard& shard(uint64_t key) { return g_shards[(key >> 4) * 0x9e3779b97f4a7c15ull >> 59]; }

std::atomic<uint64_t> g_races{0};
std::mutex g_report_mu;
std::string g_first;

struct Block {
  bool on = false;
  int device = -1;
  uint32_t agent = 0, start = 0, clock = 0;
  VC vc, pending, released;
  bool has_release = false;
};
thread_local Block tl;

uint64_t key_of(const void* p) {
  uint64_t k;
  if (!cost_key(p, &k)) k = reinterpret_cast<uintptr_t>(p) | (1ull << 63);  // host memory
  return k;
}

void report(uint64_t key, const Stamp& s) {
  if (g_races.fetch_add(1) != 0) return;
  char msg[320];
  std::snprintf(msg, sizeof msg,
                "block %u of a kernel on device %d loaded bytes at allocation %llu + %llu that agent "
                "(block) %u stored at its clock %u: no release of that store and acquire of it here "
                "order them (this block knows that agent's clock %u)",
                block_idx.x, tl.device, static_cast<unsigned long long>(key >> 36),
                static_cast<unsigned long long>(key & ((1ull << 36) - 1)), s.agent, s.clock,
                at(tl.vc, s.agent));
  std::lock_guard<std::mutex> lk(g_report_mu);
  g_first = msg;
}

}  // namespace

void hb_block_begin(int device) {
  tl.on = hb_on.load(std::memory_order_relaxed);
  if (!tl.on) return;
  tl.device = device;
  std::lock_guard<std::mutex> lk(g_mu);
  if (g_free.empty()) {
    g_free.push_back(static_cast<uint32_t>(g_last.size()));
    g_last.push_back(0);
  }
  tl.agent = g_free.back();
  g_free.pop_back();
  tl.start = tl.clock = g_last[tl.agent] + 1;
  tl.vc = g_ended;
  tl.pending.clear();
  tl.released.clear();
  tl.has_release = false;
}

void hb_block_end() {
  if (!tl.on) return;
  tl.on = false;
  if (tl.vc.size() <= tl.agent) tl.vc.resize(tl.agent + 1, 0);
  tl.vc[tl.agent] = tl.clock;
  std::lock_guard<std::mutex> lk(g_mu);
  join(g_ended, tl.vc);
  g_last[tl.agent] = tl.clock;
  g_free.push_back(tl.agent);
}

void hb_access(const void* p, size_t n, bool store) {
  if (!tl.on) return;
  const uint64_t k = key_of(p), g = k & ~uint64_t{15};
  const size_t off = k & 15, end = off + n < 16 ? off + n : 16;  // accesses never cross a granule
  Shard& s = shard(g);
  std::lock_guard<std::mutex> lk(s.mu);
  if (store) {
    Granule& gr = s.data[g];
    const Stamp st{tl.agent, tl.clock};
    if (off == 0 && end == 16) {
      gr.all = st;
      gr.bytes.reset();
    } else if (gr.bytes || gr.all.agent != st.agent || gr.all.clock != st.clock) {
      if (!gr.bytes) {
        gr.bytes.reset(new Stamp[16]);
        for (size_t i = 0; i < 16; ++i) gr.bytes[i] = gr.all;
      }
      for (size_t i = off; i < end; ++i) gr.bytes[i] = st;
    }
    return;
  }
  auto it = s.data.find(g);
  if (it == s.data.end()) return;
  for (size_t i = off; i < end; ++i) {
    const Stamp& st = it->second.at(i);
    if (st.clock == 0 || (st.agent == tl.agent && st.clock >= tl.start) || st.clock <= at(tl.vc, st.agent))
      continue;
    report(k, st);
    return;
  }
}

void hb_fence() {  // acquire what relaxed loads saw, then release everything so far
  if (!tl.on) return;
  join(tl.vc, tl.pending);
  tl.released = tl.vc;
  if (tl.released.size() <= tl.agent) tl.released.resize(tl.agent + 1, 0);
  tl.released[tl.agent] = tl.clock++;
  tl.has_release = true;
}

void hb_flag_store(const void* p) {
  if (!tl.on || !tl.has_release) return;
  const uint64_t k = key_of(p);
  Shard& s = shard(k);
  std::lock_guard<std::mutex> lk(s.mu);
  join(s.flags[k], tl.released);
}

void hb_flag_load(const void* p, bool acquire) {
  if (!tl.on) return;
  const uint64_t k = key_of(p);
  Shard& s = shard(k);
  std::lock_guard<std::mutex> lk(s.mu);
  auto it = s.flags.find(k);
  if (it != s.flags.end()) join(acquire ? tl.vc : tl.pending, it->second);
}

}  // namespace emu

extern "C" void emu_set_hb(int on) {
  emu::hb_on = on != 0;
  emu::g_races = 0;
  std::lock_guard<std::mutex> lk(emu::g_report_mu);
  emu::g_first.clear();
}
extern "C" uint64_t emu_hb_races() { return emu::g_races.load(); }
extern "C" const char* emu_hb_first_race() {
  static thread_local std::string copy;
  std::lock_guard<std::mutex> lk(emu::g_report_mu);
  copy = emu::g_first;
  return copy.c_str();
}

namespace {
// EMU_HB=1 on a whole test binary: the count is said at exit (the tests check it only in their
// weak-mode scopes).
struct SayAtExit {
  ~SayAtExit() {
    if (std::getenv("EMU_HB") && emu::g_races.load())
      std::fprintf(stderr, "emu: happens-before check: %llu loads not ordered after their stores; the first: %s\n",
                   static_cast<unsigned long long>(emu::g_races.load()), emu::g_first.c_str());
  }
} g_say_at_exit;
}  // namespace
