// The emulated CUDA runtime (tests only). One OS thread per stream runs the stream's work in order,
// so work on different streams runs concurrently (the ring kernels of two ranks spin on each
// other's flags: a runtime that ran launched work batch by batch would deadlock). A launch runs each
// block on an OS thread of its own and the block's threads as ucontext fibers that switch at
// __syncthreads() and spin_hint(), in an order that changes from round to round so that races
// inside a block show. Device memory is a shared anonymous mapping: an IPC open maps the same pages
// again at another address, as another process would see them; freeing unmaps (a later access
// faults) and, while IPC mappings of it remain, first overwrites it with 0xff, as if reused.
#include <sched.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "cuda_runtime.h"
#include "emu.h"

namespace emu {

thread_local dim3 block_idx, block_dim, grid_dim;

// weak.cpp
void weak_block_begin(size_t threads, uint64_t seed);
void weak_block_end();
void weak_barrier_arrive();
void weak_barrier_release();

// hb.cpp
void hb_block_begin(int device);
void hb_block_end();

// cost.cpp
void cost_map(const void* base, size_t bytes, int device, uint64_t id);
void cost_unmap(const void* base);
void cost_block_begin(int device, uint64_t clock);
uint64_t cost_block_end();
void cost_kernel_end(int device, uint64_t clock);
void cost_copy(int device, const void* dst, const void* src, size_t bytes);
void cost_reset_stream_clocks();
void cost_spin();
void cost_map_host(const void* base, size_t bytes);
void cost_unmap_host(const void* base);

namespace {

constexpr int kMaxDevices = 64;
constexpr uint8_t kFreshByte = 0xa5;  // new device/pinned memory: not zero, as on a GPU
constexpr uint8_t kFreedByte = 0xff;  // freed while still mapped elsewhere
constexpr size_t kFiberStack = 128 << 10;
constexpr auto kPoll = std::chrono::milliseconds(5);  // re-check of sticky errors in host waits
// The longest the legacy default stream holds work nobody waits for (see CUstream_st).
constexpr auto kLegacyLag = std::chrono::milliseconds(50);

int env_int(const char* name, int def, int lo, int hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return def;
  const int x = std::atoi(v);
  return std::min(hi, std::max(lo, x));
}

std::atomic<int> g_devices{env_int("EMU_CUDA_DEVICES", 1, 1, kMaxDevices)};
const int g_block_threads = env_int("EMU_BLOCK_THREADS", 8, 2, 1024);
const int g_sms = env_int("EMU_CUDA_SMS", 8, 1, 1024);
std::atomic<uint64_t> g_launches{0};
std::atomic<int> g_failing_launches{0};  // emu_fail_launches: the next ones fail with this error
std::atomic<int> g_launch_error{cudaSuccess};

// Residency: a device runs at most g_sms blocks at once (one block of the p2p kernels fills an SM:
// 512 threads of 110-128 registers); further blocks wait, in launch order, until one ends, as the
// GPU's block scheduler makes them. Kernels whose blocks wait for each other across ranks sharing
// a device with more blocks than it holds deadlock here as there (and end on their deadlines).
struct Sms {
  std::mutex mu;
  std::condition_variable cv;
  int busy = 0;
};
Sms g_resident[kMaxDevices];
void sm_acquire(int device) {
  Sms& s = g_resident[device];
  std::unique_lock<std::mutex> lk(s.mu);
  s.cv.wait(lk, [&] { return s.busy < g_sms; });
  ++s.busy;
}
void sm_release(int device) {
  Sms& s = g_resident[device];
  {
    std::lock_guard<std::mutex> lk(s.mu);
    --s.busy;
  }
  s.cv.notify_all();
}
std::atomic<int> g_sticky[kMaxDevices];
std::atomic<char> g_no_peer[kMaxDevices][kMaxDevices];

thread_local int tl_device = 0;
thread_local cudaError_t tl_last = cudaSuccess;

cudaError_t fail(cudaError_t e) {
  tl_last = e;
  return e;
}
cudaError_t sticky(int dev) { return static_cast<cudaError_t>(g_sticky[dev].load()); }
// Every API call on a broken context returns its error, as CUDA's do.
// Test hook (emu_watch_calls): API calls from threads other than the watching one, counted.
std::atomic<bool> g_watch_calls{false};
std::thread::id g_watching;
std::atomic<uint64_t> g_other_calls{0};
#define EMU_CALL()                                                                          \
  do {                                                                                      \
    if (emu::g_watch_calls.load(std::memory_order_acquire) &&                               \
        std::this_thread::get_id() != emu::g_watching)                                      \
      emu::g_other_calls.fetch_add(1);                                                      \
  } while (0)
#define EMU_ENTER()                               \
  do {                                            \
    if (cudaError_t s_ = sticky(tl_device)) return fail(s_); \
  } while (0)

// ---- fibers --------------------------------------------------------------------------------------
// A switch saves the callee-saved registers and the stack pointer, and loads another fiber's: on
// x86-64 a few instructions (ucontext's swapcontext makes a sigprocmask system call per switch,
// which tripled the run time of the tests); elsewhere ucontext.
#if defined(__x86_64__)
extern "C" void emu_fiber_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .type emu_fiber_switch, @function
emu_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_fiber_switch, .-emu_fiber_switch
)");
struct Context {
  void* sp = nullptr;
};
#else
struct Context {
  ucontext_t uc;
};
#endif

struct Fiber {
  enum State { kRun, kBarrier, kWarp, kDone };
  Context ctx;
  dim3 tid;
  State state = kRun;
  void* stack = nullptr;
  const char* file = nullptr;  // the __syncthreads() it waits at (kBarrier)
  int line = 0;
  unsigned or_calls = 0;  // __syncthreads_or() calls made
  unsigned warp_calls = 0;  // warp_max() calls made (kWarp: the one it waits in)
  int warp_count = 0;       // how many values it passed to that call
};

// Warps: 32 consecutive threads (linear index), as on a GPU.
constexpr size_t kWarpSize = 32;
constexpr int kWarpVals = 8;  // values one warp_max() call reduces at most

struct Block {
  Context sched;
  std::vector<Fiber> fibers;
  Fiber* cur = nullptr;
  const std::function<void()>* body = nullptr;
  bool yielded = false;
  // __syncthreads_or's votes, by call number mod 3: a thread clears the word of the call after
  // next, which no thread can still be reading (all have passed this call's barrier) or writing.
  int or_votes[3] = {};
  // warp_max's values, [fiber][kWarpVals], by call number mod 2: a thread writes call k + 2's
  // values only after every thread of its warp has passed call k + 1, so after they read call k's.
  std::vector<uint32_t> warp_vals[2];
};

// Releases the warps whose every thread waits in the same warp_max() call. A warp that cannot go
// on (a thread in another call, at __syncthreads() or finished while the others wait in one) is
// divergent: undefined on a GPU (a hang or wrong values); here an abort naming the warp.
bool release_warps(Block& b, dim3 bidx, int device) {
  bool any = false;
  for (size_t w0 = 0; w0 < b.fibers.size(); w0 += kWarpSize) {
    const size_t w1 = std::min(b.fibers.size(), w0 + kWarpSize);
    size_t waiting = 0, stuck = 0;
    for (size_t i = w0; i < w1; ++i) {
      waiting += b.fibers[i].state == Fiber::kWarp;
      stuck += b.fibers[i].state != Fiber::kRun;
    }
    if (waiting == 0) continue;
    bool same = waiting == w1 - w0;
    for (size_t i = w0 + 1; same && i < w1; ++i)
      same = b.fibers[i].warp_calls == b.fibers[w0].warp_calls && b.fibers[i].warp_count == b.fibers[w0].warp_count;
    if (!same && stuck < w1 - w0) continue;  // a thread still runs: it may come to the call
    if (!same) {
      std::fprintf(stderr, "emu: divergent warp_max() in warp %zu of block %u on device %d: not every "
                   "thread of the warp is in the same call\n", w0 / kWarpSize, bidx.x, device);
      std::fflush(stderr);
      std::printf("FAIL emu: divergent warp_max() in warp %zu\n", w0 / kWarpSize);
      std::fflush(stdout);
      std::abort();
    }
    for (size_t i = w0; i < w1; ++i) b.fibers[i].state = Fiber::kRun;
    any = true;
  }
  return any;
}

thread_local Block* tl_block = nullptr;
const dim3 kHostThread{0, 0, 0};

void switch_to(Context& save, Context& load) {
#if defined(__x86_64__)
  emu_fiber_switch(&save.sp, load.sp);
#else
  swapcontext(&save.uc, &load.uc);
#endif
}

// First frame of every fiber (on the block's OS thread, so tl_block is its block).
void fiber_main() {
  Block* b = tl_block;
  (*b->body)();
  b->cur->state = Fiber::kDone;
  switch_to(b->cur->ctx, b->sched);  // never resumed
  std::abort();
}

// Stacks are reused across launches (a mapping and its guard page per fiber per launch cost more
// system time than the kernels).
std::mutex g_stacks_mu;
std::vector<void*> g_stacks;

void* map_stack() {
  {
    std::lock_guard<std::mutex> lk(g_stacks_mu);
    if (!g_stacks.empty()) {
      void* p = g_stacks.back();
      g_stacks.pop_back();
      return p;
    }
  }
  void* p = mmap(nullptr, kFiberStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) {
    std::perror("emu: fiber stack");
    std::abort();
  }
  mprotect(p, 4096, PROT_NONE);  // guard page: an overflow faults instead of corrupting
  return p;
}

void make_fiber(Fiber& f) {
  f.stack = map_stack();
#if defined(__x86_64__)
  // The stack as emu_fiber_switch leaves it: six saved registers, then the return address
  // (fiber_main), then a fake return address of fiber_main, 16-byte aligned as after a call.
  auto* top = reinterpret_cast<uintptr_t*>(static_cast<char*>(f.stack) + kFiberStack);
  top[-1] = 0;
  top[-2] = reinterpret_cast<uintptr_t>(&fiber_main);
  for (int i = 3; i <= 8; ++i) top[-i] = 0;
  f.ctx.sp = top - 8;
#else
  getcontext(&f.ctx.uc);
  f.ctx.uc.uc_stack.ss_sp = f.stack;
  f.ctx.uc.uc_stack.ss_size = kFiberStack;
  f.ctx.uc.uc_link = nullptr;
  makecontext(&f.ctx.uc, fiber_main, 0);
#endif
}

void run_block(const std::function<void()>* body, dim3 bidx, dim3 bdim, dim3 gdim, uint64_t seed,
               int device, uint64_t clock, uint64_t* end_clock) {
  tl_device = device;
  cost_block_begin(device, clock);
  block_idx = bidx;
  block_dim = bdim;
  grid_dim = gdim;
  Block b;
  b.body = body;
  const size_t n = static_cast<size_t>(bdim.x) * bdim.y * bdim.z;
  b.fibers.resize(n);
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.tid = dim3(static_cast<unsigned>(i % bdim.x), static_cast<unsigned>(i / bdim.x % bdim.y),
                 static_cast<unsigned>(i / (static_cast<size_t>(bdim.x) * bdim.y)));
    make_fiber(f);
  }
  tl_block = &b;
  weak_block_begin(n, seed);
  hb_block_begin(device);
  size_t done = 0;
  uint64_t rng = seed | 1;
  while (done < n) {
    b.yielded = false;
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;  // xorshift: where each round starts
    const size_t start = rng % n;
    for (size_t k = 0; k < n; ++k) {
      Fiber& f = b.fibers[(start + k) % n];
      if (f.state != Fiber::kRun) continue;
      b.cur = &f;
      switch_to(b.sched, f.ctx);
      if (f.state == Fiber::kDone) ++done;
    }
    if (release_warps(b, bidx, device)) continue;
    bool running = false, waiting = false;
    for (Fiber& f : b.fibers) {
      running |= f.state == Fiber::kRun;
      waiting |= f.state == Fiber::kBarrier;
    }
    if (!running && waiting) {  // every live thread is at __syncthreads(): release them
      const Fiber* first = nullptr;
      for (const Fiber& f : b.fibers) {
        if (f.state != Fiber::kBarrier || !f.file) continue;
        if (!first) {
          first = &f;
        } else if (f.line != first->line || std::strcmp(f.file, first->file) != 0) {
          std::fprintf(stderr, "emu: divergent __syncthreads() in block %u on device %d: thread %u waits "
                       "at %s:%d, thread %u at %s:%d\n", bidx.x, device, first->tid.x, first->file,
                       first->line, f.tid.x, f.file, f.line);
          std::fflush(stderr);
          std::printf("FAIL emu: divergent __syncthreads(): %s:%d and %s:%d\n", first->file, first->line,
                      f.file, f.line);
          std::fflush(stdout);
          std::abort();
        }
      }
      weak_barrier_release();
      for (Fiber& f : b.fibers)
        if (f.state == Fiber::kBarrier) f.state = Fiber::kRun;
    }
    if (b.yielded) sched_yield();
  }
  weak_block_end();  // kernel end: every store lands
  hb_block_end();
  tl_block = nullptr;
  *end_clock = cost_block_end();
  std::lock_guard<std::mutex> lk(g_stacks_mu);
  for (Fiber& f : b.fibers) g_stacks.push_back(f.stack);
}

}  // namespace

const dim3& thread_idx() { return tl_block ? tl_block->cur->tid : kHostThread; }
int current_fiber() { return tl_block ? static_cast<int>(tl_block->cur - tl_block->fibers.data()) : -1; }

void syncthreads(const char* file, int line) {
  Block* b = tl_block;
  if (!b) return;
  weak_barrier_arrive();
  Fiber* f = b->cur;
  f->state = Fiber::kBarrier;
  f->file = file;
  f->line = line;
  switch_to(f->ctx, b->sched);
}

int syncthreads_or(int pred, const char* file, int line) {
  Block* b = tl_block;
  if (!b) return pred != 0;
  const unsigned call = b->cur->or_calls++;
  b->or_votes[call % 3] |= pred != 0;
  syncthreads(file, line);
  const int any = b->or_votes[call % 3];
  b->or_votes[(call + 2) % 3] = 0;
  return any;
}

// A warp's rendezvous: the thread's count values into the warp's table; back when every thread
// of the warp is in the same call. Returns the warp's rows ([lane][kWarpVals]), valid until this
// thread's next call.
const uint32_t* warp_rendezvous(const uint32_t* v, int count) {
  Block* b = tl_block;
  if (count < 1 || count > kWarpVals) {
    std::fprintf(stderr, "emu: a warp exchange of %d values (at most %d)\n", count, kWarpVals);
    std::abort();
  }
  Fiber* f = b->cur;
  const size_t i = static_cast<size_t>(f - b->fibers.data()), n = b->fibers.size();
  std::vector<uint32_t>& vals = b->warp_vals[f->warp_calls % 2];
  if (vals.empty()) vals.resize(n * kWarpVals);
  std::copy(v, v + count, vals.begin() + i * kWarpVals);
  f->warp_count = count;
  f->state = Fiber::kWarp;
  switch_to(f->ctx, b->sched);  // back when every thread of the warp is in this call
  ++f->warp_calls;
  return vals.data() + i / kWarpSize * kWarpSize * kWarpVals;
}

size_t warp_lanes() {
  const size_t i = static_cast<size_t>(tl_block->cur - tl_block->fibers.data()), n = tl_block->fibers.size();
  return std::min(kWarpSize, n - i / kWarpSize * kWarpSize);
}

void warp_max(uint32_t* v, int count) {
  if (!tl_block) return;  // the host: a warp of one
  const uint32_t* rows = warp_rendezvous(v, count);
  for (int u = 0; u < count; ++u)
    for (size_t l = 0; l < warp_lanes(); ++l) v[u] = std::max(v[u], rows[l * kWarpVals + u]);
}

void warp_gather(uint32_t mine, uint32_t* out, int count) {
  if (!tl_block) {
    for (int u = 0; u < count; ++u) out[u] = u == 0 ? mine : 0;
    return;
  }
  const uint32_t* rows = warp_rendezvous(&mine, 1);
  for (int u = 0; u < count; ++u) out[u] = static_cast<size_t>(u) < warp_lanes() ? rows[u * kWarpVals] : 0;
}

void spin_hint() {
  Block* b = tl_block;
  if (!b) {
    sched_yield();
    return;
  }
  b->yielded = true;
  cost_spin();
  if (weak()) weak_spin();
  switch_to(b->cur->ctx, b->sched);
}

}  // namespace emu

using emu::fail;
using emu::sticky;
using emu::tl_device;

// ---- streams and events ----------------------------------------------------------------------------
// How many ops a stream has run, in a block of its own that outlives the stream (a legacy-stream op
// may still wait on a blocking stream that has been destroyed meanwhile).
struct Progress {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t done = 0;
};

// Three kinds, as in CUDA: the legacy default stream (one per device), blocking streams (the
// default flags), which wait for the legacy stream's earlier work and make it wait for theirs,
// and non-blocking streams, which do neither. The legacy stream runs its work late: an op waits
// there until someone waits for the stream (a synchronize, a dependent op) or kLegacyLag passes,
// so that host-asynchronous calls (cudaMemset, cudaMemcpy from pageable memory) land late, as they
// may on a GPU, and code that forgets to order them shows it.
// A hardware queue shared by streams (emu_set_connections): its ops run in enqueue order, one at a
// time, across the streams on it (each op waits for its ticket).
struct Connection {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t next = 0, serving = 0;
};

struct CUstream_st {
  enum Kind { kLegacy, kBlocking, kNonBlocking };
  int device = 0;
  std::shared_ptr<Connection> conn;  // null: a queue of its own
  Kind kind;
  uint64_t clock = 0;  // the cost model's clock: where the last kernel on this stream ended
  std::atomic<bool> capturing{false};  // emu_set_capturing (global mode)
  std::atomic<bool> capture_invalidated{false};
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> q;
  bool busy = false, stop = false;
  uint64_t pushed = 0;  // ops enqueued (mu)
  int waiters = 0;      // threads waiting for this stream's work (mu): the legacy stream hurries
  std::shared_ptr<Progress> prog = std::make_shared<Progress>();
  std::thread th;

  CUstream_st(int dev, Kind k) : device(dev), kind(k) {
    th = std::thread([this] { loop(); });
  }
  ~CUstream_st() {
    {
      std::lock_guard<std::mutex> lk(mu);
      stop = true;
    }
    cv.notify_all();
    th.join();
  }
  void loop() {
    tl_device = device;
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      cv.wait(lk, [&] { return stop || !q.empty(); });
      if (q.empty()) return;  // stopped and drained
      if (kind == kLegacy) cv.wait_for(lk, emu::kLegacyLag, [&] { return stop || waiters > 0; });
      std::function<void()> op = std::move(q.front());
      q.pop_front();
      busy = true;
      lk.unlock();
      if (!sticky(device)) op();  // a broken context runs nothing more
      {
        std::lock_guard<std::mutex> plk(prog->mu);
        ++prog->done;
      }
      prog->cv.notify_all();
      lk.lock();
      busy = false;
      cv.notify_all();
    }
  }
  uint64_t push(std::function<void()> op) {
    uint64_t n;
    {
      std::lock_guard<std::mutex> lk(mu);
      if (conn) {  // the ticket is taken under this stream's lock: its ops keep their order
        uint64_t t;
        {
          std::lock_guard<std::mutex> clk(conn->mu);
          t = conn->next++;
        }
        op = [c = conn, t, dev = device, op = std::move(op)] {
          {
            std::unique_lock<std::mutex> clk(c->mu);
            while (c->serving != t && !sticky(dev)) c->cv.wait_for(clk, emu::kPoll);
          }
          op();
          {
            std::lock_guard<std::mutex> clk(c->mu);
            ++c->serving;
          }
          c->cv.notify_all();
        };
      }
      q.push_back(std::move(op));
      n = ++pushed;
    }
    cv.notify_all();
    return n;
  }
  void drain() {
    std::unique_lock<std::mutex> lk(mu);
    ++waiters;
    cv.notify_all();
    cv.wait(lk, [&] { return q.empty() && !busy; });
    --waiters;
  }
  bool idle() {
    std::lock_guard<std::mutex> lk(mu);
    return q.empty() && !busy;
  }
  uint64_t enqueued() {
    std::lock_guard<std::mutex> lk(mu);
    return pushed;
  }
  // Waits until this stream has run its first n ops (hurrying a legacy stream meanwhile).
  void wait_done(uint64_t n) {
    {
      std::lock_guard<std::mutex> lk(mu);
      ++waiters;
    }
    cv.notify_all();
    {
      std::unique_lock<std::mutex> plk(prog->mu);
      while (prog->done < n && !sticky(device)) prog->cv.wait_for(plk, emu::kPoll);
    }
    std::lock_guard<std::mutex> lk(mu);
    --waiters;
  }
};

namespace {

struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0, completed = 0;
  std::chrono::steady_clock::time_point completed_at;  // of the newest completed record
  int device = 0;
  bool done() const { return completed >= recorded; }
};

std::mutex g_streams_mu;
std::set<CUstream_st*> g_streams;
std::atomic<int> g_connections{0};  // emu_set_connections; g_queues, g_queue_next under g_streams_mu
std::map<int, std::vector<std::shared_ptr<Connection>>> g_queues;
std::map<int, uint64_t> g_queue_next;
CUstream_st* g_null[emu::kMaxDevices];
std::mutex g_order_mu;  // a push and the dependencies it takes are one step (no cycles)

CUstream_st* resolve(cudaStream_t s) {
  if (s) return s;
  std::lock_guard<std::mutex> lk(g_streams_mu);
  CUstream_st*& n = g_null[tl_device];
  if (!n) {
    n = new CUstream_st(tl_device, CUstream_st::kLegacy);  // lives as long as the process
    g_streams.insert(n);
  }
  return n;
}

bool valid_stream(cudaStream_t s) {
  if (!s) return true;
  std::lock_guard<std::mutex> lk(g_streams_mu);
  return g_streams.count(s) != 0;
}

// Enqueues op on s with the legacy stream's implicit synchronisation: an op on the legacy stream
// first waits for the work enqueued before it on the device's blocking streams; an op on a blocking
// stream first waits for the legacy stream's earlier work. Non-blocking streams wait for nothing.
void enqueue(cudaStream_t s, std::function<void()> op) {
  CUstream_st* st = resolve(s);
  if (st->kind == CUstream_st::kNonBlocking) {
    st->push(std::move(op));
    return;
  }
  std::lock_guard<std::mutex> order(g_order_mu);
  std::vector<std::pair<CUstream_st*, uint64_t>> legacy;  // (stream, ops to wait for)
  std::vector<std::pair<std::shared_ptr<Progress>, uint64_t>> blocking;
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    if (st->kind == CUstream_st::kBlocking) {
      if (CUstream_st* n = g_null[st->device]) legacy.push_back({n, n->enqueued()});
    } else {
      for (CUstream_st* b : g_streams)
        if (b->kind == CUstream_st::kBlocking && b->device == st->device)
          blocking.push_back({b->prog, b->enqueued()});
    }
  }
  if (legacy.empty() && blocking.empty()) {
    st->push(std::move(op));
    return;
  }
  const int dev = st->device;
  st->push([legacy, blocking, dev, op = std::move(op)] {
    for (auto& [n, k] : legacy) n->wait_done(k);
    for (auto& [p, k] : blocking) {
      std::unique_lock<std::mutex> plk(p->mu);
      while (p->done < k && !sticky(dev)) p->cv.wait_for(plk, emu::kPoll);
    }
    op();
  });
}

// Waits on the host for pred (under st.mu), giving up with the device's sticky error.
template <class Pred>
cudaError_t host_wait(EventState& st, Pred pred) {
  std::unique_lock<std::mutex> lk(st.mu);
  while (!pred()) {
    if (cudaError_t e = sticky(st.device)) return e;
    st.cv.wait_for(lk, emu::kPoll);
  }
  return cudaSuccess;
}

}  // namespace

struct CUevent_st {
  std::shared_ptr<EventState> st = std::make_shared<EventState>();
};

// ---- memory -----------------------------------------------------------------------------------------
namespace {

struct Alloc {
  char* base;
  size_t mapped;  // bytes mapped (whole pages)
  int device;
  uint64_t id;
  int opened = 0;  // IPC mappings of it still open
  bool freed = false;
};

std::mutex g_mem_mu;
std::map<uintptr_t, Alloc> g_dev;            // device allocations by base
std::map<uint64_t, uintptr_t> g_dev_by_id;
std::map<uintptr_t, uint64_t> g_alias;       // IPC mapping -> allocation id
std::atomic<uint64_t> g_frees_while_mapped{0};  // cudaFree of memory a peer still maps
struct HostAlloc {
  char* base;     // of the mapping, guard page included
  size_t mapped;
  size_t bytes;   // asked for, from the pointer handed out
  bool registered = false;  // cudaHostRegister'ed memory of the caller's (not ours to unmap)
};
std::map<uintptr_t, HostAlloc> g_host;       // pinned host allocations by the pointer handed out
uint64_t g_next_id = 1;
constexpr char kIpcMagic[8] = {'R', 'R', 'E', 'M', 'U', 'I', 'P', 'C'};

size_t page_round(size_t n) {
  const size_t pg = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (n + pg - 1) / pg * pg;
}

Alloc* alloc_containing(const void* p) {  // g_mem_mu held
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_dev.upper_bound(a);
  if (it == g_dev.begin()) return nullptr;
  --it;
  Alloc& al = it->second;
  return !al.freed && a < it->first + al.mapped ? &al : nullptr;
}

bool device_memory(const void* p) {  // an allocation of any device, or an IPC mapping of one
  std::lock_guard<std::mutex> lk(g_mem_mu);
  if (alloc_containing(p)) return true;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_alias.upper_bound(a);
  if (it == g_alias.begin()) return false;
  --it;
  auto id = g_dev_by_id.find(it->second);
  return id != g_dev_by_id.end() && a < it->first + g_dev[id->second].mapped;
}
bool pinned_memory(const void* p) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = g_host.upper_bound(a);
  if (it == g_host.begin()) return false;
  --it;
  return a < it->first + std::max<size_t>(it->second.bytes, 1);
}

}  // namespace

extern "C" {

// ---- errors and devices -----------------------------------------------------------------------------
cudaError_t cudaGetLastError() {
  EMU_CALL();
  const cudaError_t e = emu::tl_last;
  emu::tl_last = cudaSuccess;
  if (cudaError_t s = sticky(tl_device)) return s;
  return e;
}
cudaError_t cudaPeekAtLastError() {
  EMU_CALL();
  if (cudaError_t s = sticky(tl_device)) return s;
  return emu::tl_last;
}

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorMapBufferObjectFailed: return "cudaErrorMapBufferObjectFailed";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorPeerAccessUnsupported: return "cudaErrorPeerAccessUnsupported";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorStreamCaptureImplicit: return "cudaErrorStreamCaptureImplicit";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorPeerAccessUnsupported: return "peer access is not supported between these two devices";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    default: return "emulated CUDA error";
  }
}

cudaError_t cudaGetDeviceCount(int* count) {
  EMU_CALL();
  *count = emu::g_devices.load();
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  EMU_CALL();
  *device = tl_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  EMU_CALL();
  if (device < 0 || device >= emu::g_devices.load()) return fail(cudaErrorInvalidDevice);
  tl_device = device;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  EMU_CALL();
  if (device < 0 || device >= emu::g_devices.load()) return fail(cudaErrorInvalidDevice);
  if (static_cast<int>(attr) == 122) {  // CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
    *value = 1;
    return cudaSuccess;
  }
  if (attr != cudaDevAttrMultiProcessorCount) return fail(cudaErrorInvalidValue);
  *value = emu::g_sms;
  return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  EMU_CALL();
  const int n = emu::g_devices.load();
  if (device < 0 || device >= n || peer < 0 || peer >= n) return fail(cudaErrorInvalidDevice);
  *can = device != peer && !emu::g_no_peer[device][peer].load();
  return cudaSuccess;
}
cudaError_t cudaDeviceGetPCIBusId(char* bus_id, int len, int device) {
  EMU_CALL();
  if (device < 0 || device >= emu::g_devices.load()) return fail(cudaErrorInvalidDevice);
  std::snprintf(bus_id, static_cast<size_t>(len), "0000:%02x:00.0", 0x10 + device);
  return cudaSuccess;
}
cudaError_t cudaDeviceGetByPCIBusId(int* device, const char* bus_id) {
  EMU_CALL();
  unsigned bus = 0;
  if (std::sscanf(bus_id, "0000:%x:00.0", &bus) != 1) return fail(cudaErrorInvalidValue);
  const int d = static_cast<int>(bus) - 0x10;
  if (d < 0 || d >= emu::g_devices.load()) return fail(cudaErrorInvalidDevice);
  *device = d;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  EMU_CALL();
  std::vector<CUstream_st*> mine;
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    for (CUstream_st* s : g_streams)
      if (s->device == tl_device) mine.push_back(s);
  }
  for (CUstream_st* s : mine) s->drain();
  EMU_ENTER();
  return cudaSuccess;
}

// ---- memory -------------------------------------------------------------------------------------------
cudaError_t cudaMalloc(void** p, size_t bytes) {
  EMU_CALL();
  EMU_ENTER();
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  const size_t mapped = page_round(bytes);
  void* m = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return fail(cudaErrorMemoryAllocation);
  std::memset(m, emu::kFreshByte, mapped);
  std::lock_guard<std::mutex> lk(g_mem_mu);
  const uint64_t id = g_next_id++;
  g_dev[reinterpret_cast<uintptr_t>(m)] = Alloc{static_cast<char*>(m), mapped, tl_device, id};
  g_dev_by_id[id] = reinterpret_cast<uintptr_t>(m);
  emu::cost_map(m, mapped, tl_device, id);
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaFree(void* p) {
  EMU_CALL();
  if (!p) return cudaSuccess;
  // CUDA synchronises here; the legacy stream's late work (a memset, a copy) must not land on unmapped
  // memory. Other streams are not waited for: a freed buffer a kernel still uses faults, as it should.
  std::vector<CUstream_st*> legacy;
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    for (CUstream_st* n : g_null)
      if (n) legacy.push_back(n);
  }
  for (CUstream_st* n : legacy) n->drain();
  std::lock_guard<std::mutex> lk(g_mem_mu);
  auto it = g_dev.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_dev.end() || it->second.freed) return fail(cudaErrorInvalidValue);
  Alloc& a = it->second;
  emu::cost_unmap(a.base);
  if (a.opened > 0) {  // still mapped by a peer: it reads whatever the memory is reused for
    // Undefined in CUDA (the documentation of cudaIpcOpenMemHandle): counted, and said.
    ++g_frees_while_mapped;
    std::fprintf(stderr, "emulator: cudaFree of %zu bytes of device %d that %d IPC mapping(s) still map\n",
                 a.mapped, a.device, a.opened);
    std::memset(a.base, emu::kFreedByte, a.mapped);
    munmap(a.base, a.mapped);
    a.freed = true;
    return cudaSuccess;
  }
  munmap(a.base, a.mapped);
  g_dev_by_id.erase(a.id);
  g_dev.erase(it);
  return cudaSuccess;
}

// Pinned host memory ends (to within 128 bytes, its alignment) at an inaccessible page: an access
// past the end faults, as an overrun of a struct the host and the kernels share should.
constexpr size_t kHostAlign = 128;
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) {
  EMU_CALL();
  EMU_ENTER();
  const size_t used = (std::max<size_t>(bytes, 1) + kHostAlign - 1) / kHostAlign * kHostAlign;
  const size_t page = page_round(1), mapped = page_round(used) + page;
  void* m = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return fail(cudaErrorMemoryAllocation);
  char* guard = static_cast<char*>(m) + mapped - page;
  if (mprotect(guard, page, PROT_NONE) != 0) {
    munmap(m, mapped);
    return fail(cudaErrorMemoryAllocation);
  }
  char* user = guard - used;
  std::memset(user, emu::kFreshByte, bytes);
  std::lock_guard<std::mutex> lk(g_mem_mu);
  g_host[reinterpret_cast<uintptr_t>(user)] = HostAlloc{static_cast<char*>(m), mapped, bytes};
  emu::cost_map_host(user, bytes);
  *p = user;
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) { return cudaHostAlloc(p, bytes, 0); }

cudaError_t cudaHostGetDevicePointer(void** dev, void* host, unsigned) {
  EMU_CALL();
  std::lock_guard<std::mutex> lk(g_mem_mu);
  if (!g_host.count(reinterpret_cast<uintptr_t>(host))) return fail(cudaErrorInvalidValue);
  *dev = host;  // unified addressing: the device sees host memory at the same address
  return cudaSuccess;
}

cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned) {
  EMU_CALL();
  EMU_ENTER();
  if (!p || !bytes) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lk(g_mem_mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (g_host.count(a)) return fail(cudaErrorInvalidValue);  // CUDA: already registered
  g_host[a] = HostAlloc{static_cast<char*>(p), bytes, bytes, true};
  emu::cost_map_host(p, bytes);
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* p) {
  EMU_CALL();
  std::lock_guard<std::mutex> lk(g_mem_mu);
  auto it = g_host.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_host.end() || !it->second.registered) return fail(cudaErrorInvalidValue);
  emu::cost_unmap_host(p);
  g_host.erase(it);
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* p) {
  EMU_CALL();
  if (!p) return cudaSuccess;
  std::lock_guard<std::mutex> lk(g_mem_mu);
  auto it = g_host.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_host.end() || it->second.registered) return fail(cudaErrorInvalidValue);
  munmap(it->second.base, it->second.mapped);
  emu::cost_unmap_host(p);
  g_host.erase(it);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t s) {
  EMU_CALL();
  EMU_ENTER();
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  if (bytes) {
    const int dev = resolve(s)->device;
    enqueue(s, [=] {
      emu::cost_copy(dev, dst, src, bytes);
      std::memmove(dst, src, bytes);
    });
  }
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
  EMU_CALL();
  EMU_ENTER();
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  if (bytes) enqueue(s, [=] { std::memset(p, value, bytes); });
  return cudaSuccess;
}
// What the synchronous forms do (CUDA's "API synchronization behavior"): a copy from pageable host
// memory to the device returns once the source is staged, before the copy lands; a device-to-device
// copy and a memset of device memory return at once; the others return when done. All run on the
// legacy stream, late (CUstream_st).
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  EMU_CALL();
  const bool to_dev = device_memory(dst), from_dev = device_memory(src);
  if (to_dev && !from_dev && !pinned_memory(src) && bytes) {
    EMU_ENTER();
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + bytes);
    const int dev = tl_device;
    enqueue(nullptr, [=] {
      emu::cost_copy(dev, dst, staged->data(), bytes);
      std::memcpy(dst, staged->data(), bytes);
    });
    return cudaSuccess;
  }
  if (cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, nullptr)) return e;
  if (to_dev && from_dev) return cudaSuccess;
  return cudaStreamSynchronize(nullptr);
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  EMU_CALL();
  if (cudaError_t e = cudaMemsetAsync(p, value, bytes, nullptr)) return e;
  if (!pinned_memory(p)) return cudaSuccess;
  return cudaStreamSynchronize(nullptr);
}

// ---- streams ---------------------------------------------------------------------------------------------
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  EMU_CALL();
  EMU_ENTER();
  auto* st = new CUstream_st(tl_device, flags & cudaStreamNonBlocking ? CUstream_st::kNonBlocking
                                                                      : CUstream_st::kBlocking);
  std::lock_guard<std::mutex> lk(g_streams_mu);
  if (const int k = g_connections.load()) {  // round robin over the device's k queues
    auto& queues = g_queues[st->device];
    if (queues.size() != static_cast<size_t>(k)) {
      queues.clear();
      for (int i = 0; i < k; ++i) queues.push_back(std::make_shared<Connection>());
    }
    st->conn = queues[g_queue_next[st->device]++ % k];
  }
  g_streams.insert(st);
  *s = st;
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, 0); }

// Unlike CUDA, which returns at once, this waits until the stream's work is done.
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  EMU_CALL();
  if (!s) return fail(cudaErrorInvalidResourceHandle);
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    if (!g_streams.erase(s)) return fail(cudaErrorInvalidResourceHandle);
  }
  delete s;  // drains, then joins its thread
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  EMU_CALL();
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  CUstream_st* st = resolve(s);
  st->drain();
  if (!s) {  // the legacy stream: and the blocking streams it synchronises with
    std::vector<CUstream_st*> blocking;
    {
      std::lock_guard<std::mutex> lk(g_streams_mu);
      for (CUstream_st* b : g_streams)
        if (b->kind == CUstream_st::kBlocking && b->device == st->device) blocking.push_back(b);
    }
    for (CUstream_st* b : blocking) b->drain();
  }
  if (cudaError_t e = sticky(st->device)) return fail(e);
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  EMU_CALL();
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  CUstream_st* st = resolve(s);
  if (cudaError_t e = sticky(st->device)) return fail(e);
  return st->idle() ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  EMU_CALL();
  EMU_ENTER();
  if (!e || !valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  std::shared_ptr<EventState> st = e->st;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lk(st->mu);
    target = st->recorded;  // the most recent record at the time of the call
  }
  if (target == 0) return cudaSuccess;
  enqueue(s, [st, target] { host_wait(*st, [&] { return st->completed >= target; }); });
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
  EMU_CALL();
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  *status = s && s->capturing ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

namespace {
thread_local cudaStreamCaptureMode tl_capture_mode = cudaStreamCaptureModeGlobal;
std::atomic<int> g_captures{0};  // streams capturing (global mode)

// An event query or synchronize: unsafe while a stream captures in global mode, unless this
// thread is in relaxed mode; then refused, and every capture in progress is invalidated.
cudaError_t unsafe_call_during_capture() {
  if (g_captures.load() == 0 || tl_capture_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    for (CUstream_st* s : g_streams)
      if (s->capturing) s->capture_invalidated = true;
  }
  return fail(cudaErrorStreamCaptureImplicit);
}
}  // namespace

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  EMU_CALL();
  if (!mode) return fail(cudaErrorInvalidValue);
  std::swap(tl_capture_mode, *mode);
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* user_data) {
  EMU_CALL();
  EMU_ENTER();
  if (!valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  enqueue(s, [fn, user_data] { fn(user_data); });
  return cudaSuccess;
}

// ---- stream memory operations (driver entry points) -----------------------------------------------------
namespace {
constexpr int kCuSuccess = 0, kCuInvalidValue = 1, kCuInvalidHandle = 400;  // CUresult values

int write_value64(cudaStream_t s, unsigned long long at, unsigned long long value, unsigned flags) {
  if (sticky(tl_device)) return 999;
  if (!valid_stream(s)) return kCuInvalidHandle;
  if (flags != 0 || !at || at % 8) return kCuInvalidValue;
  auto* p = reinterpret_cast<uint64_t*>(at);
  // CU_STREAM_WRITE_VALUE_DEFAULT: earlier work of the stream lands first (it has: stream order).
  enqueue(s, [p, value] { __atomic_store_n(p, value, __ATOMIC_SEQ_CST); });
  return kCuSuccess;
}

int wait_value64(cudaStream_t s, unsigned long long at, unsigned long long value, unsigned flags) {
  if (sticky(tl_device)) return 999;
  if (!valid_stream(s)) return kCuInvalidHandle;
  if (flags != 0 || !at || at % 8) return kCuInvalidValue;  // GEQ only
  auto* p = reinterpret_cast<const uint64_t*>(at);
  const int dev = resolve(s)->device;
  enqueue(s, [p, value, dev] {
    while (static_cast<int64_t>(__atomic_load_n(p, __ATOMIC_ACQUIRE) - value) < 0 && !sticky(dev))
      std::this_thread::sleep_for(std::chrono::microseconds(20));
  });
  return kCuSuccess;
}
}  // namespace

// cuMemGetAddressRange: the allocation (of this process's device memory) holding p.
static int address_range(uint64_t* base, size_t* bytes, uint64_t p) {
  std::lock_guard<std::mutex> lk(g_mem_mu);
  const Alloc* a = alloc_containing(reinterpret_cast<const void*>(p));
  if (!a) return 1;  // CUDA_ERROR_INVALID_VALUE
  *base = reinterpret_cast<uint64_t>(a->base);
  *bytes = a->mapped;
  return 0;
}

cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned,
                                             unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
  if (!symbol || !fn) return fail(cudaErrorInvalidValue);
  const std::string name = symbol;
  *fn = name == "cuStreamWriteValue64"   ? reinterpret_cast<void*>(&write_value64)
        : name == "cuStreamWaitValue64"  ? reinterpret_cast<void*>(&wait_value64)
        : name == "cuMemGetAddressRange" ? reinterpret_cast<void*>(&address_range)
                                         : nullptr;
  if (status) *status = *fn ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  return cudaSuccess;
}

// ---- events ----------------------------------------------------------------------------------------------
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  EMU_CALL();
  EMU_ENTER();
  *e = new CUevent_st;
  (*e)->st->device = tl_device;
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  EMU_CALL();
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  delete e;  // a pending record keeps the state alive
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  EMU_CALL();
  EMU_ENTER();
  if (!e || !valid_stream(s)) return fail(cudaErrorInvalidResourceHandle);
  std::shared_ptr<EventState> st = e->st;
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lk(st->mu);
    seq = ++st->recorded;
  }
  enqueue(s, [st, seq] {
    std::lock_guard<std::mutex> lk(st->mu);
    st->completed = std::max(st->completed, seq);
    st->completed_at = std::chrono::steady_clock::now();
    st->cv.notify_all();
  });
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  EMU_CALL();
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  if (cudaError_t c = unsafe_call_during_capture()) return c;
  EventState& st = *e->st;
  if (cudaError_t s = sticky(st.device)) return fail(s);
  std::lock_guard<std::mutex> lk(st.mu);
  return st.done() ? cudaSuccess : cudaErrorNotReady;
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  EMU_CALL();
  if (!ms || !start || !end) return fail(cudaErrorInvalidResourceHandle);
  std::chrono::steady_clock::time_point a, b;
  {
    std::lock_guard<std::mutex> lk(start->st->mu);
    if (!start->st->recorded || !start->st->done()) return fail(cudaErrorNotReady);
    a = start->st->completed_at;
  }
  {
    std::lock_guard<std::mutex> lk(end->st->mu);
    if (!end->st->recorded || !end->st->done()) return fail(cudaErrorNotReady);
    b = end->st->completed_at;
  }
  *ms = std::chrono::duration<float, std::milli>(b - a).count();
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  EMU_CALL();
  if (!e) return fail(cudaErrorInvalidResourceHandle);
  if (cudaError_t c = unsafe_call_during_capture()) return c;
  std::shared_ptr<EventState> st = e->st;
  uint64_t target;
  {
    std::lock_guard<std::mutex> lk(st->mu);
    target = st->recorded;
  }
  if (cudaError_t r = host_wait(*st, [&] { return st->completed >= target; })) return fail(r);
  return cudaSuccess;
}

namespace {
std::atomic<uint64_t> g_ipc_opens{0};
std::atomic<int> g_failing_opens{0};
}  // namespace

// ---- IPC ---------------------------------------------------------------------------------------------------
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* p) {
  EMU_CALL();
  EMU_ENTER();
  // IPC calls are not stream work: CUDA refuses them on a thread in global capture mode while
  // any stream captures in that mode, and invalidates the capture.
  if (cudaError_t e = unsafe_call_during_capture()) return e;
  std::lock_guard<std::mutex> lk(g_mem_mu);
  const Alloc* a = alloc_containing(p);
  if (!a) return fail(cudaErrorInvalidValue);
  std::memset(handle, 0, sizeof *handle);
  const int32_t pid = getpid();
  std::memcpy(handle->reserved, kIpcMagic, 8);
  std::memcpy(handle->reserved + 8, &pid, 4);
  std::memcpy(handle->reserved + 16, &a->id, 8);
  return cudaSuccess;
}

// The allocation's pages mapped again at a new address (the base of the allocation, as in CUDA).
// Between the threads of one process only: the emulated IPC of ranks played by threads.
cudaError_t cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t handle, unsigned) {
  EMU_CALL();
  EMU_ENTER();
  // Maps memory, as cudaMalloc does: not during a capture in global mode.
  if (cudaError_t e = unsafe_call_during_capture()) return e;
  g_ipc_opens.fetch_add(1);
  if (g_failing_opens.load() > 0 && g_failing_opens.fetch_sub(1) > 0) return fail(cudaErrorMapBufferObjectFailed);
  int32_t pid = 0;
  uint64_t id = 0;
  std::memcpy(&pid, handle.reserved + 8, 4);
  std::memcpy(&id, handle.reserved + 16, 8);
  if (std::memcmp(handle.reserved, kIpcMagic, 8) != 0 || pid != getpid()) return fail(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lk(g_mem_mu);
  auto it = g_dev_by_id.find(id);
  if (it == g_dev_by_id.end()) return fail(cudaErrorInvalidValue);
  Alloc& a = g_dev[it->second];
  if (a.freed) return fail(cudaErrorInvalidValue);
  if (a.device != tl_device && emu::g_no_peer[tl_device][a.device].load())
    return fail(cudaErrorPeerAccessUnsupported);
  void* m = mremap(a.base, 0, a.mapped, MREMAP_MAYMOVE);  // a second mapping of shared pages
  if (m == MAP_FAILED) return fail(cudaErrorMemoryAllocation);
  ++a.opened;
  g_alias[reinterpret_cast<uintptr_t>(m)] = id;
  emu::cost_map(m, a.mapped, a.device, id);
  *p = m;
  return cudaSuccess;
}

cudaError_t cudaIpcCloseMemHandle(void* p) {
  EMU_CALL();
  if (cudaError_t e = unsafe_call_during_capture()) return e;  // unmaps memory: as an open
  std::lock_guard<std::mutex> lk(g_mem_mu);
  auto it = g_alias.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_alias.end()) return fail(cudaErrorInvalidValue);
  auto id = g_dev_by_id.find(it->second);
  Alloc& a = g_dev[id->second];
  emu::cost_unmap(p);
  munmap(p, a.mapped);
  g_alias.erase(it);
  if (--a.opened == 0 && a.freed) {
    g_dev.erase(id->second);
    g_dev_by_id.erase(id);
  }
  return cudaSuccess;
}

// ---- hooks ---------------------------------------------------------------------------------------------------
void emu_set_device_count(int n) { emu::g_devices = std::min(emu::kMaxDevices, std::max(1, n)); }
void emu_set_peer_access(int a, int b, int can) { emu::g_no_peer[a][b] = !can; }
cudaError_t emu_inject_fault(cudaStream_t s, cudaError_t e) {
  EMU_ENTER();
  CUstream_st* st = resolve(s);
  const int dev = st->device;
  enqueue(s, [dev, e] { emu::g_sticky[dev] = e; });
  return cudaSuccess;
}
void emu_clear_fault(int device) { emu::g_sticky[device] = cudaSuccess; }
void emu_set_connections(int k) {
  std::lock_guard<std::mutex> lk(g_streams_mu);
  g_connections.store(k > 0 ? k : 0);
  g_queues.clear();  // streams keep the queues they have
  g_queue_next.clear();
}
void emu_set_capturing(cudaStream_t stream, int capturing) {
  const bool was = stream->capturing.exchange(capturing != 0);
  if (capturing && !was) stream->capture_invalidated = false;
  if (was != (capturing != 0)) g_captures += capturing ? 1 : -1;
}
int emu_capture_invalidated(cudaStream_t stream) { return stream->capture_invalidated ? 1 : 0; }
int emu_block_threads() { return emu::g_block_threads; }
uint64_t emu_launches() { return emu::g_launches.load(); }
uint64_t emu_frees_while_mapped() { return g_frees_while_mapped.load(); }
uint64_t emu_ipc_opens() { return g_ipc_opens.load(); }
void emu_fail_ipc_opens(int n) { g_failing_opens.store(n); }
void emu_watch_calls(int on) {
  emu::g_watch_calls.store(false);
  emu::g_watching = std::this_thread::get_id();
  emu::g_other_calls.store(0);
  emu::g_watch_calls.store(on != 0, std::memory_order_release);
}
uint64_t emu_other_thread_calls() { return emu::g_other_calls.load(); }
void emu_fail_launches(int n, cudaError_t e) {
  emu::g_launch_error = e;
  emu::g_failing_launches = n;
}

}  // extern "C"

// ---- launches ---------------------------------------------------------------------------------------------------
void emu::launch(dim3 grid, dim3 block, cudaStream_t stream, std::function<void()> body, bool warps) {
  if (cudaError_t s = sticky(tl_device)) {
    fail(s);
    return;
  }
  const uint64_t blocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (blocks == 0 || threads == 0 || threads > 1024 || block.z > 64) {
    fail(cudaErrorInvalidConfiguration);
    return;
  }
  if (!valid_stream(stream)) {
    fail(cudaErrorInvalidResourceHandle);
    return;
  }
  for (int k = g_failing_launches.load(); k > 0;)
    if (g_failing_launches.compare_exchange_weak(k, k - 1)) {
      fail(static_cast<cudaError_t>(g_launch_error.load()));  // not sticky, as a launch refused
      return;
    }
  dim3 run = block;
  if (block.y == 1 && block.z == 1) run.x = std::min<unsigned>(block.x, g_block_threads);
  // A kernel of warps (RR_LAUNCH_WARPS) runs whole ones: EMU_BLOCK_THREADS rounded to them.
  const unsigned warp = static_cast<unsigned>(kWarpSize);
  if (warps && block.x % warp == 0) run.x = std::max(warp, run.x / warp * warp);
  const uint64_t seed = ++g_launches * 0x9e3779b97f4a7c15ull;
  CUstream_st* st = resolve(stream);
  enqueue(stream, [st, grid, run, blocks, seed, body = std::move(body)] {
    std::vector<std::thread> ths;
    std::vector<uint64_t> ends(blocks, 0);
    ths.reserve(blocks);
    for (uint64_t b = 0; b < blocks; ++b) {
      const dim3 idx(static_cast<unsigned>(b % grid.x), static_cast<unsigned>(b / grid.x % grid.y),
                     static_cast<unsigned>(b / (static_cast<uint64_t>(grid.x) * grid.y)));
      sm_acquire(st->device);  // in block order: a block starts once an earlier one fits
      ths.emplace_back([&body, idx, run, grid, seed, b, st, &ends] {
        run_block(&body, idx, run, grid, seed + b, st->device, st->clock, &ends[b]);
        sm_release(st->device);
      });
    }
    for (std::thread& t : ths) t.join();
    st->clock = *std::max_element(ends.begin(), ends.end());
    cost_kernel_end(st->device, st->clock);
  });
}

void emu::cost_reset_stream_clocks() {
  std::lock_guard<std::mutex> lk(g_streams_mu);
  for (CUstream_st* s : g_streams) s->clock = 0;
}
