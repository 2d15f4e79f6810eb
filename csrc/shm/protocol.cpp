#include "shm/protocol.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <new>

#include "ring/loop.h"
#include "ring/schedule.h"
#include "runtime/peers.h"
#include "runtime/transport.h"

namespace ringreduce {

namespace shm {
namespace {

constexpr uint32_t kMagic = 0x52524431;  // "RRD1"
// How long one futex sleep lasts before the waiter re-checks abort, deadline and peer liveness.
constexpr auto kSleepSlice = std::chrono::milliseconds(10);
// How often a waiter looks in /proc for the peer it waits on.
constexpr auto kPeerCheck = std::chrono::milliseconds(50);

using Clock = std::chrono::steady_clock;

// What cma_probe reads from a peer (at the address the peer published in its RankArea).
const uint64_t kProbeWord = 0x636d612d70726f62ull;  // "cma-prob"

bool uses_cma(const Options& o) {
  if (o.algo == Algo::Cma) return true;
  for (const Step& s : o.steps)
    if (s.algo == Algo::Cma) return true;
  return false;
}

size_t slot_stride(size_t slice_bytes) { return sizeof(MsgHeader) + round_up(slice_bytes, 64); }

// Wrap-around safe "v has reached target" for the 32-bit futex counters.
bool reached(uint32_t v, uint32_t target) { return static_cast<int32_t>(v - target) >= 0; }

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  timespec ts{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kSleepSlice).count()};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}
void post(Counter& c, uint32_t v) {
  c.value.store(v, std::memory_order_seq_cst);
  if (c.waiters.load(std::memory_order_seq_cst) != 0) futex_wake(&c.value);
}

}  // namespace


namespace {

std::string describe(uint8_t coll, uint8_t dtype, uint8_t op, int64_t numel, uint8_t wire = 0) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "%s(numel=%lld, dtype=%s, op=%s%s%s)", coll_name(Coll(coll)),
                static_cast<long long>(numel), dtype_name(DType(dtype)), op_name(RedOp(op)),
                wire ? ", wire_dtype=" : "", wire ? wire_name(Wire(wire)) : "");
  return buf;
}

}  // namespace

size_t segment_bytes(int nranks, size_t slice_bytes) {
  return sizeof(GroupHeader) + nranks * sizeof(RankArea) + nranks * kSlots * slot_stride(slice_bytes);
}

void init_segment(void* base, int nranks, size_t slice_bytes) {
  auto* hdr = new (base) GroupHeader();
  hdr->nranks = nranks;
  hdr->slice_bytes = slice_bytes;
  hdr->abort.store(0);
  hdr->reason_ready.store(0);
  auto* areas = reinterpret_cast<RankArea*>(static_cast<char*>(base) + sizeof(GroupHeader));
  for (int r = 0; r < nranks; ++r) new (&areas[r]) RankArea();
  std::atomic_thread_fence(std::memory_order_seq_cst);
  hdr->magic = kMagic;
}

Protocol::Protocol(void* base, size_t bytes, const Options& opt) : opt_(opt) {
  hdr_ = static_cast<GroupHeader*>(base);
  if (opt.nranks < 1 || opt.rank < 0 || opt.rank >= opt.nranks)
    throw std::invalid_argument("ringreduce: rank " + std::to_string(opt.rank) + " out of range for " +
                                std::to_string(opt.nranks) + " ranks");
  if (hdr_->magic != kMagic || hdr_->nranks != static_cast<uint32_t>(opt.nranks))
    throw RingError("ringreduce: shared segment is not an initialised ring of " +
                    std::to_string(opt.nranks) + " ranks");
  slice_bytes_ = hdr_->slice_bytes;
  slot_stride_ = slot_stride(slice_bytes_);
  if (bytes < segment_bytes(opt.nranks, slice_bytes_))
    throw RingError("ringreduce: shared segment too small for its ring");
  areas_ = reinterpret_cast<RankArea*>(reinterpret_cast<char*>(base) + sizeof(GroupHeader));
  slots_ = reinterpret_cast<char*>(areas_ + opt.nranks);
  up_ = ring::mod(opt.rank - 1, opt.nranks);
  down_ = ring::mod(opt.rank + 1, opt.nranks);
  areas_[opt.rank].probe.store(reinterpret_cast<uint64_t>(&kProbeWord));
  areas_[opt.rank].pid.store(static_cast<int32_t>(getpid()));
  // Where Yama restricts ptrace to descendants, let the peers read this process (cma only).
  if (uses_cma(opt)) prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
}

std::string Protocol::cma_probe() const {
  for (int q = 0; q < opt_.nranks; ++q) {
    if (q == opt_.rank) continue;
    uint64_t word = 0;
    iovec l{&word, sizeof word}, rem{reinterpret_cast<void*>(areas_[q].probe.load()), sizeof word};
    const ssize_t got = process_vm_readv(areas_[q].pid.load(), &l, 1, &rem, 1, 0);
    if (got != static_cast<ssize_t>(sizeof word) || word != kProbeWord)
      return "rank " + std::to_string(opt_.rank) + " cannot read rank " + std::to_string(q) +
             "'s memory by cross-memory attach (process_vm_readv: " +
             (got < 0 ? std::strerror(errno) : "short or wrong read") + ")";
  }
  return "";
}

// On this VM an ordinary store to a line another core has cached is sometimes ~20x slower than
// usual for seconds at a time (the peers harness saw it on the AMD machine); non-temporal stores do not slow down
// then, but cost 2-3x the fast state's time (the reader fetches the data from memory). So copy
// with ordinary stores, time each copy, and stream for a while after a run of slow ones.
void Protocol::put(void* dst, const void* src, size_t bytes) {
  using Opt = Options::Stream;
  if (bytes < kStreamMinBytes || opt_.stream == Opt::Never) return (void)std::memcpy(dst, src, bytes);
  if (opt_.stream == Opt::Always) return cpu::copy_stream(dst, src, bytes);
  const auto ns = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
  };
  const int64_t t0 = ns();
  if (t0 < stream_until_ns_) return cpu::copy_stream(dst, src, bytes);
  std::memcpy(dst, src, bytes);
  const int64_t t1 = ns();
  // One slow copy is an interrupt or a preemption; the slow state makes every copy slow.
  slow_copies_ = static_cast<uint64_t>(t1 - t0) * kSlowBytesPerNs > bytes ? slow_copies_ + 1 : 0;
  if (slow_copies_ >= kSlowCopiesToStream) {
    slow_copies_ = 0;
    stream_until_ns_ = t1 + kStreamHoldNs;
    stream_switches_.fetch_add(1, std::memory_order_relaxed);
  }
}

char* Protocol::slot(int r, uint32_t m) const {
  return slots_ + (static_cast<size_t>(r) * kSlots + m % kSlots) * slot_stride_;
}

bool Protocol::broken() const { return broken_ || hdr_->abort.load() != 0; }

std::string Protocol::abort_reason() const {
  if (hdr_->abort.load() == 0) return "";
  // The aborting rank writes the reason right after claiming the flag; give it a moment.
  auto until = Clock::now() + std::chrono::milliseconds(200);
  while (!hdr_->reason_ready.load(std::memory_order_acquire) && Clock::now() < until) _mm_pause();
  if (!hdr_->reason_ready.load(std::memory_order_acquire)) return "(no reason recorded)";
  return std::string(hdr_->reason, strnlen(hdr_->reason, sizeof(hdr_->reason)));
}

void Protocol::abort(const std::string& why) {
  uint32_t expected = 0;
  if (hdr_->abort.compare_exchange_strong(expected, 1 + opt_.rank)) {
    std::snprintf(hdr_->reason, sizeof(hdr_->reason), "%s", why.c_str());
    hdr_->reason_ready.store(1, std::memory_order_release);
  }
  for (int r = 0; r < opt_.nranks; ++r) {
    futex_wake(&areas_[r].posted.value);
    futex_wake(&areas_[r].consumed.value);
  }
}

void Protocol::fail(const std::string& msg) {
  broken_ = true;
  if (!failed_seq_) failed_seq_ = op_seq_;
  abort(msg);
  throw RingError(msg);
}

void Protocol::raise_aborted(const Ctx& ctx) {
  broken_ = true;
  if (!failed_seq_) failed_seq_ = op_seq_;
  const uint32_t who = hdr_->abort.load();
  throw RingError("ringreduce: rank " + std::to_string(opt_.rank) + ": " + coll_name(ctx.call.coll) +
                  " #" + std::to_string(op_seq_) + " stopped in " + ctx.phase + " step " +
                  std::to_string(ctx.step) + " because rank " + std::to_string(who - 1) +
                  " aborted the group: " + abort_reason());
}

std::string Protocol::waiting() const {
  const int peer = wait_peer_.load(std::memory_order_acquire);
  if (peer < 0) return "";
  const long long us = std::chrono::duration_cast<std::chrono::microseconds>(
                           Clock::now().time_since_epoch() -
                           std::chrono::nanoseconds(wait_since_ns_.load()))
                           .count();
  // Integers only: printf's %f follows the C locale, and JSON wants a "." (what/phase are ours).
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "{\"seq\": %llu, \"peer\": %d, \"for\": \"%s\", \"phase\": \"%s\", "
                "\"step\": %d, \"slice\": %lld, \"waited_s\": %lld.%06lld}",
                static_cast<unsigned long long>(wait_seq_.load()), peer, wait_what_.load(),
                wait_phase_.load(), wait_step_.load(), static_cast<long long>(wait_slice_.load()),
                us / 1000000, us % 1000000);
  return buf;
}

bool Protocol::peer_dead(int peer) const { return runtime::process_dead(areas_[peer].pid.load()); }

void Protocol::wait_ge(Counter& c, uint32_t target, int peer, const Ctx& ctx, const char* what) {
  if (reached(c.value.load(std::memory_order_acquire), target)) return;
  const auto t0 = Clock::now();
  const auto spin_until = t0 + std::chrono::nanoseconds(opt_.spin_ns);
  do {
    for (int i = 0; i < 64; ++i) {
      if (reached(c.value.load(std::memory_order_acquire), target)) return;
      _mm_pause();
    }
    if (hdr_->abort.load(std::memory_order_relaxed)) raise_aborted(ctx);
  } while (Clock::now() < spin_until);
  if (opt_.yield_ns > 0) {
    const auto yield_until = Clock::now() + std::chrono::nanoseconds(opt_.yield_ns);
    do {
      sched_yield();
      if (reached(c.value.load(std::memory_order_acquire), target)) return;
      if (hdr_->abort.load(std::memory_order_relaxed)) raise_aborted(ctx);
    } while (Clock::now() < yield_until);
  }

  const auto deadline = t0 + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(opt_.timeout_s));
  auto next_peer_check = t0 + kPeerCheck;
  // Published for the flight recorder: only waits that outlast their spin pay for it.
  wait_what_.store(what, std::memory_order_relaxed);
  wait_phase_.store(ctx.phase, std::memory_order_relaxed);
  wait_step_.store(ctx.step, std::memory_order_relaxed);
  wait_slice_.store(ctx.slice, std::memory_order_relaxed);
  wait_seq_.store(op_seq_, std::memory_order_relaxed);
  wait_since_ns_.store(std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count(),
                       std::memory_order_relaxed);
  wait_peer_.store(peer, std::memory_order_release);
  for (;;) {
    c.waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t v = c.value.load(std::memory_order_seq_cst);
    if (!reached(v, target) && !hdr_->abort.load()) futex_wait(&c.value, v);
    c.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(c.value.load(std::memory_order_acquire), target)) {
      wait_peer_.store(-1, std::memory_order_relaxed);
      return;
    }
    if (hdr_->abort.load()) raise_aborted(ctx);
    const auto now = Clock::now();
    const std::string where = std::string(coll_name(ctx.call.coll)) + " #" + std::to_string(op_seq_) +
                              " (" + ctx.phase + " step " + std::to_string(ctx.step) + ", slice " +
                              std::to_string(ctx.slice) + ")";
    if (now >= deadline) {
      char t[32];
      std::snprintf(t, sizeof t, "%g", opt_.timeout_s);
      fail("ringreduce: rank " + std::to_string(opt_.rank) + ": " + where + " timed out after " + t +
           " s waiting for " + what + " rank " + std::to_string(peer) +
           " (RINGREDUCE_TIMEOUT; did every rank make the same call?)");
    }
    if (now >= next_peer_check) {
      next_peer_check = now + kPeerCheck;
      if (interrupted_ && (*interrupted_)())
        fail("ringreduce: rank " + std::to_string(opt_.rank) + ": " + where + " interrupted by a signal");
      if (peer_dead(peer))
        fail("ringreduce: rank " + std::to_string(opt_.rank) + ": " + where + ": peer rank " +
             std::to_string(peer) + " (pid " + std::to_string(areas_[peer].pid.load()) + ") died");
    }
  }
}

char* Protocol::acquire_send(const Ctx& ctx) {
  // The message this slot held was read by the downstream rank only, or by every rank (one-shot).
  if (static_cast<int32_t>(wide_until_ - (sent_ - kSlots)) > 0)
    wait_all_consumed(sent_ + 1 - kSlots, ctx);
  else
    wait_ge(areas_[down_].consumed, sent_ + 1 - kSlots, down_, ctx, "a free slot, consumed by");
  return slot(opt_.rank, sent_) + sizeof(MsgHeader);
}

void Protocol::wait_all_consumed(uint32_t target, const Ctx& ctx) {
  for (int k = 0; k < opt_.nranks; ++k)
    if (k != opt_.rank) wait_ge(areas_[k].consumed, target, k, ctx, "a free slot, consumed by");
}

void Protocol::post_send(const Ctx& ctx, uint64_t nbytes) {
  auto* h = reinterpret_cast<MsgHeader*>(slot(opt_.rank, sent_));
  h->op_seq = op_seq_;
  h->numel = ctx.call.numel;
  h->nbytes = nbytes;
  h->index = msg_in_call_++;
  h->coll = static_cast<uint8_t>(ctx.call.coll);
  h->dtype = static_cast<uint8_t>(ctx.call.dtype);
  h->op = static_cast<uint8_t>(ctx.call.op);
  h->algo = static_cast<uint8_t>(algo_);
  h->wire = static_cast<uint8_t>(ctx.call.wire);
  h->flags = wire_flags_;
  post(areas_[opt_.rank].posted, ++sent_);
}

const char* Protocol::recv(const Ctx& ctx, uint64_t expect_bytes) {
  wait_ge(areas_[up_].posted, received_ + 1, up_, ctx, "a message from");
  const char* s = slot(up_, received_);
  check_header(ctx, up_, reinterpret_cast<const MsgHeader*>(s), expect_bytes);
  return s + sizeof(MsgHeader);
}

void Protocol::check_header(const Ctx& ctx, int from, const MsgHeader* h, uint64_t expect_bytes) {
  const Call& c = ctx.call;
  const auto coll = static_cast<uint8_t>(c.coll), dt = static_cast<uint8_t>(c.dtype),
             op = static_cast<uint8_t>(c.op), wire = static_cast<uint8_t>(c.wire);
  if (h->op_seq != op_seq_ || h->coll != coll || h->dtype != dt || h->op != op ||
      h->numel != c.numel || h->wire != wire)
    fail("ringreduce: mismatched collective calls: rank " + std::to_string(from) + " called " +
         describe(h->coll, h->dtype, h->op, h->numel, h->wire) + " as its call #" +
         std::to_string(h->op_seq) + " on this communicator, while rank " +
         std::to_string(opt_.rank) + " called " + describe(coll, dt, op, c.numel, wire) +
         " as its call #" + std::to_string(op_seq_));
  wire_flags_ |= h->flags;
  if (h->algo != static_cast<uint8_t>(algo_))
    fail("ringreduce: rank " + std::to_string(from) + " ran " + describe(coll, dt, op, c.numel) +
         " with the " + algo_name(Algo(h->algo)) + " algorithm and rank " + std::to_string(opt_.rank) +
         " with " + algo_name(algo_) +
         " (set RINGREDUCE_ALGO and RINGREDUCE_DETERMINISTIC the same on every rank, and pass a "
         "ringreduce.shared_empty tensor on every rank or on none)");
  if (h->nbytes != expect_bytes)
    fail("ringreduce: rank " + std::to_string(opt_.rank) + ": message of " + std::to_string(h->nbytes) +
         " bytes from rank " + std::to_string(from) + " where " + std::to_string(expect_bytes) +
         " were expected (inconsistent schedules)");
}

Algo Protocol::choose(const Call& c, const Pool* pool) const {
  if (c.wire != Wire::None && c.coll != Coll::AllGather) return Algo::Wire;
  if (opt_.nranks == 1 || c.coll == Coll::AllGather) return Algo::Ring;  // nothing to reduce
  const bool ar = c.coll == Coll::AllReduce;
  // A pool tensor's all-reduce reads the peers' copies in place (rank order, so deterministic
  // too), unless an algorithm is forced.
  if (pool && ar && c.in == c.out && opt_.algo == Algo::Auto) return Algo::Pool;
  const uint64_t bytes = static_cast<uint64_t>(c.numel) * dtype_size(c.dtype);
  const bool small = ar && bytes <= opt_.oneshot_max_bytes;
  Algo big = Algo::Ring;  // Auto above the one-shot threshold
  if (ar)
    for (const Step& s : opt_.steps)
      if (bytes >= s.from_bytes) big = s.algo;
  if (opt_.algo == Algo::Cma) return Algo::Cma;  // rank order as well
  if (c.deterministic) {  // rank order whatever RINGREDUCE_ALGO says
    if (opt_.algo == Algo::OneShot && ar) return Algo::OneShot;
    if (opt_.algo == Algo::TwoShot) return Algo::TwoShot;
    if (small) return Algo::OneShot;
    return opt_.algo == Algo::Auto && big == Algo::Cma ? Algo::Cma : Algo::TwoShot;
  }
  switch (opt_.algo) {
    case Algo::OneShot: return ar ? Algo::OneShot : Algo::Ring;  // one-shot: all-reduce only
    case Algo::Auto: return small ? Algo::OneShot : big;
    default: return opt_.algo;
  }
}

const char* Protocol::recv_wide(const Ctx& ctx, int from, uint32_t m, uint64_t expect_bytes) {
  wait_ge(areas_[from].posted, m + 1, from, ctx, "a message from");
  const char* s = slot(from, m);
  check_header(ctx, from, reinterpret_cast<const MsgHeader*>(s), expect_bytes);
  return s + sizeof(MsgHeader);
}

void Protocol::release_wide(uint32_t m) {
  received_ = m + 1;
  post(areas_[opt_.rank].consumed, received_);
}

void Protocol::release_recv() { post(areas_[opt_.rank].consumed, ++received_); }

// The ring's primitives (ring/loop.h) on the slots: a send is posted when it is made.
struct Protocol::Prims {
  Protocol& p;
  const Call& c;
  Ctx& ctx;
  const size_t es;

  void at(const char* phase, int step, int64_t slice) {
    ctx.phase = phase;
    ctx.step = step;
    ctx.slice = slice;
  }
  void send(const char* src, int64_t n) {
    char* d = p.acquire_send(ctx);
    p.put(d, src, n * es);
    p.post_send(ctx, n * es);
  }
  void recv_reduce_send(const char* own, int64_t n) {
    const char* src = p.recv(ctx, n * es);
    char* d = p.acquire_send(ctx);
    cpu::reduce(c.dtype, c.op, d, src, own, n);
    p.post_send(ctx, n * es);
    p.release_recv();
  }
  void recv_reduce_copy(const char* own, char* dst, int64_t n, int divisor, bool and_send) {
    const char* src = p.recv(ctx, n * es);
    cpu::reduce(c.dtype, c.op, dst, src, own, n, divisor);
    if (and_send) send(dst, n);
    p.release_recv();
  }
  void recv_copy(char* dst, int64_t n, bool and_send) {
    const char* src = p.recv(ctx, n * es);
    std::memcpy(dst, src, n * es);
    if (and_send) send(src, n);
    p.release_recv();
  }
  void copy(char* dst, const char* src, int64_t n) { std::memmove(dst, src, n * es); }
};

void Protocol::run(const Call& c, Algo algo, const std::function<bool()>* interrupted, const Pool* pool) {
  interrupted_ = interrupted;
  if (broken()) {
    broken_ = true;
    if (!failed_seq_) failed_seq_ = op_seq_ + 1;  // broken between calls: this one fails first
  }
  const int n = opt_.nranks, r = opt_.rank;
  runtime::check_call(c, n, broken() ? abort_reason() : std::string());
  ++op_seq_;
  msg_in_call_ = 0;
  algo_ = algo;
  if (algo_ == Algo::Wire) {
    Ctx ctx{c, "wire", 0, 0};
    wire_flags_ = 0;
    if (run_wire(c, ctx))
      throw std::overflow_error(
          std::string("ringreduce: ") + coll_name(c.coll) + "(wire_dtype=float16): a finite value "
          "beyond float16's range (65504) on the wire (an input, or a sum) of some rank; the result "
          "holds inf there. Divide first (op=AVG), or use wire_dtype=torch.bfloat16 (float32's range)");
    return;
  }
  const CallView v(c, n, r);
  if (n == 1) {
    if (c.op == RedOp::Avg || v.in != v.out) cpu::divide(c.dtype, v.out, v.in, c.numel, 1);
    return;
  }
  Ctx ctx{c, "reduce-scatter", 0, 0};
  if (algo_ == Algo::OneShot) return run_oneshot(c, ctx);
  if (algo_ == Algo::TwoShot) return run_twoshot(c, ctx);
  if (algo_ == Algo::Cma) return run_cma(c, ctx);
  if (algo_ == Algo::Pool) return run_pool(c, ctx, *pool);
  Prims prims{*this, c, ctx, v.es};
  ring::run_ring(c, n, r, std::max<int64_t>(1, static_cast<int64_t>(slice_bytes_ / v.es)), prims);
}

}  // namespace shm
}  // namespace ringreduce
