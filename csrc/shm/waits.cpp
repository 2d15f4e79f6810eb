#include "shm/waits.h"

#include <immintrin.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>

#include "runtime/peers.h"

namespace ringreduce {
namespace shm {
namespace {

// How long one futex sleep lasts before the waiter re-checks abort, deadline and peer liveness.
constexpr auto kSleepSlice = std::chrono::milliseconds(10);
// How often a waiter looks in /proc for the peer it waits on.
constexpr auto kPeerCheck = std::chrono::milliseconds(50);

using Clock = std::chrono::steady_clock;

// Wrap-around safe "v has reached target" for the 32-bit futex counters.
bool reached(uint32_t v, uint32_t target) { return static_cast<int32_t>(v - target) >= 0; }

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  timespec ts{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kSleepSlice).count()};
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

}  // namespace

void post(Counter& c, uint32_t v) {
  c.value.store(v, std::memory_order_seq_cst);
  if (c.waiters.load(std::memory_order_seq_cst) != 0) futex_wake(&c.value);
}

Waits::Waits(GroupHeader* hdr, RankArea* areas, const Options& opt)
    : hdr_(hdr), areas_(areas), rank_(opt.rank), nranks_(opt.nranks), timeout_s_(opt.timeout_s),
      spin_ns_(opt.spin_ns), yield_ns_(opt.yield_ns) {}

void Waits::begin(uint64_t seq, const std::function<bool()>* interrupted) {
  interrupted_ = interrupted;
  if (!broken()) return;
  broken_ = true;
  if (!failed_seq_) failed_seq_ = seq;
}

bool Waits::broken() const { return broken_ || hdr_->abort.load() != 0; }

std::string Waits::abort_reason() const {
  if (hdr_->abort.load() == 0) return "";
  // The aborting rank writes the reason right after claiming the flag; give it a moment.
  auto until = Clock::now() + std::chrono::milliseconds(200);
  while (!hdr_->reason_ready.load(std::memory_order_acquire) && Clock::now() < until) _mm_pause();
  if (!hdr_->reason_ready.load(std::memory_order_acquire)) return "(no reason recorded)";
  return std::string(hdr_->reason, strnlen(hdr_->reason, sizeof(hdr_->reason)));
}

void Waits::abort(const std::string& why) {
  uint32_t expected = 0;
  if (hdr_->abort.compare_exchange_strong(expected, 1 + rank_)) {
    std::snprintf(hdr_->reason, sizeof(hdr_->reason), "%s", why.c_str());
    hdr_->reason_ready.store(1, std::memory_order_release);
  }
  for (int r = 0; r < nranks_; ++r) {
    futex_wake(&areas_[r].posted.value);
    futex_wake(&areas_[r].consumed.value);
  }
}

void Waits::fail(const Ctx& ctx, const std::string& msg) {
  broken_ = true;
  if (!failed_seq_) failed_seq_ = ctx.seq;
  abort(msg);
  throw RingError(msg);
}

void Waits::raise_aborted(const Ctx& ctx) {
  broken_ = true;
  if (!failed_seq_) failed_seq_ = ctx.seq;
  const uint32_t who = hdr_->abort.load();
  throw RingError("ringreduce: rank " + std::to_string(rank_) + ": " + coll_name(ctx.call.coll) +
                  " #" + std::to_string(ctx.seq) + " stopped in " + ctx.phase + " step " +
                  std::to_string(ctx.step) + " because rank " + std::to_string(who - 1) +
                  " aborted the group: " + abort_reason());
}

std::string Waits::where(const Ctx& ctx) {
  return std::string(coll_name(ctx.call.coll)) + " #" + std::to_string(ctx.seq) + " (" + ctx.phase + ")";
}

std::string Waits::waiting() const {
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

bool Waits::peer_dead(int peer) const { return runtime::process_dead(areas_[peer].pid.load()); }

void Waits::wait_ge(Counter& c, uint32_t target, int peer, const Ctx& ctx, const char* what) {
  if (reached(c.value.load(std::memory_order_acquire), target)) return;
  const auto t0 = Clock::now();
  const auto spin_until = t0 + std::chrono::nanoseconds(spin_ns_);
  do {
    for (int i = 0; i < 64; ++i) {
      if (reached(c.value.load(std::memory_order_acquire), target)) return;
      _mm_pause();
    }
    if (hdr_->abort.load(std::memory_order_relaxed)) raise_aborted(ctx);
  } while (Clock::now() < spin_until);
  if (yield_ns_ > 0) {
    const auto yield_until = Clock::now() + std::chrono::nanoseconds(yield_ns_);
    do {
      sched_yield();
      if (reached(c.value.load(std::memory_order_acquire), target)) return;
      if (hdr_->abort.load(std::memory_order_relaxed)) raise_aborted(ctx);
    } while (Clock::now() < yield_until);
  }

  const auto deadline = t0 + std::chrono::duration_cast<Clock::duration>(
                                 std::chrono::duration<double>(timeout_s_));
  auto next_peer_check = t0 + kPeerCheck;
  // Published for the flight recorder: only waits that outlast their spin pay for it.
  wait_what_.store(what, std::memory_order_relaxed);
  wait_phase_.store(ctx.phase, std::memory_order_relaxed);
  wait_step_.store(ctx.step, std::memory_order_relaxed);
  wait_slice_.store(ctx.slice, std::memory_order_relaxed);
  wait_seq_.store(ctx.seq, std::memory_order_relaxed);
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
    const std::string where = std::string(coll_name(ctx.call.coll)) + " #" + std::to_string(ctx.seq) +
                              " (" + ctx.phase + " step " + std::to_string(ctx.step) + ", slice " +
                              std::to_string(ctx.slice) + ")";
    if (now >= deadline) {
      char t[32];
      std::snprintf(t, sizeof t, "%g", timeout_s_);
      fail(ctx, "ringreduce: rank " + std::to_string(rank_) + ": " + where + " timed out after " + t +
                    " s waiting for " + what + " rank " + std::to_string(peer) +
                    " (RINGREDUCE_TIMEOUT; did every rank make the same call?)");
    }
    if (now >= next_peer_check) {
      next_peer_check = now + kPeerCheck;
      if (interrupted_ && (*interrupted_)())
        fail(ctx, "ringreduce: rank " + std::to_string(rank_) + ": " + where + " interrupted by a signal");
      if (peer_dead(peer))
        fail(ctx, "ringreduce: rank " + std::to_string(rank_) + ": " + where + ": peer rank " +
                      std::to_string(peer) + " (pid " + std::to_string(areas_[peer].pid.load()) + ") died");
    }
  }
}

}  // namespace shm
}  // namespace ringreduce
