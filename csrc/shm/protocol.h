// The ring protocol over memory every rank can read: each rank owns a FIFO of message slots and two
// counters; a step is "wait for the upstream neighbour's message, reduce or copy it, post my own".
// It runs on any shared mapping (processes over POSIX shared memory, or threads in the native tests).
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>

#include "cpu/reduce.h"
#include "ring/call.h"

namespace ringreduce {
namespace shm {

constexpr int kSlots = ring::kSlots;
// Slice size: 128 KiB keeps one rank's 8 slots (1 MiB) cache-resident on this machine's L2/L3;
// measured in benchmarks/shm_allreduce.py (64 KiB .. 512 KiB within 10% at 64 MiB).
constexpr size_t kDefaultSliceBytes = 128 << 10;

struct alignas(64) Counter {
  std::atomic<uint32_t> value{0};    // futex word (wrap-around safe comparisons)
  std::atomic<uint32_t> waiters{0};  // a poster calls futex_wake only when someone sleeps
};

struct alignas(64) RankArea {
  Counter posted;    // messages this rank has written into its own slots
  Counter consumed;  // messages this rank has consumed from its upstream neighbour's slots
  alignas(64) std::atomic<int32_t> pid{0};
};

struct alignas(64) GroupHeader {
  uint32_t magic;
  uint32_t nranks;
  uint64_t slice_bytes;
  alignas(64) std::atomic<uint32_t> abort;         // 0, or 1 + the rank that aborted first
  std::atomic<uint32_t> reason_ready;
  char reason[1024];
};

// Every message carries the call it belongs to, so a neighbour checks it before touching data.
struct alignas(64) MsgHeader {
  uint64_t op_seq;
  int64_t numel;
  uint64_t nbytes;
  uint32_t index;  // message index within the call
  uint8_t coll, dtype, op;
};

size_t segment_bytes(int nranks, size_t slice_bytes);
// Called once by the creating rank on a zeroed mapping of segment_bytes().
void init_segment(void* base, int nranks, size_t slice_bytes);

struct Options {
  int rank = 0;
  int nranks = 1;
  double timeout_s = 300.0;  // RINGREDUCE_TIMEOUT: per wait
  int64_t spin_ns = 20000;   // busy-poll this long before sleeping on the futex
};

class Ring {
 public:
  Ring(void* base, size_t bytes, const Options& opt);
  // Runs one collective. Throws RingError on timeout, dead peer, mismatch or abort; after that the
  // ring is broken and every later call throws at once. interrupted (optional) is polled while
  // waiting, every 50 ms: true aborts the group (the binding uses it for Ctrl-C).
  void run(const Call& c, const std::function<bool()>* interrupted = nullptr);
  // Marks the whole group broken (all ranks raise); safe from any thread.
  void abort(const std::string& why);
  bool broken() const;
  std::string abort_reason() const;
  uint64_t op_seq() const { return op_seq_; }
  size_t slice_bytes() const { return slice_bytes_; }

 private:
  struct Ctx;
  char* slot(int r, uint32_t m) const;
  void wait_ge(Counter& c, uint32_t target, int peer, const Ctx& ctx, const char* what);
  char* acquire_send(const Ctx& ctx);
  void post_send(const Ctx& ctx, uint64_t nbytes);
  const char* recv(const Ctx& ctx, uint64_t expect_bytes);
  void release_recv();
  [[noreturn]] void fail(const std::string& msg);
  [[noreturn]] void raise_aborted(const Ctx& ctx);
  bool peer_dead(int peer) const;

  GroupHeader* hdr_;
  RankArea* areas_;
  char* slots_;
  size_t slice_bytes_, slot_stride_;
  Options opt_;
  int up_, down_;
  uint32_t sent_ = 0, received_ = 0;  // messages over the communicator's lifetime
  uint64_t op_seq_ = 0;
  uint32_t msg_in_call_ = 0;
  bool broken_ = false;
  const std::function<bool()>* interrupted_ = nullptr;
};

}  // namespace shm
}  // namespace ringreduce
