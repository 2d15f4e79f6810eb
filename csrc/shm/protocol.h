// The ring protocol over memory every rank can read: each rank owns a FIFO of message slots and two
// counters; a step is "wait for the upstream neighbour's message, reduce or copy it, post my own".
// It runs on any shared mapping (processes over POSIX shared memory, or threads in the native tests).
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/reduce.h"
#include "ring/call.h"
#include "ring/schedule.h"

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
  std::atomic<uint64_t> probe{0};  // where in this process a peer's cma probe reads kProbeWord
};

struct alignas(64) GroupHeader {
  uint32_t magic;
  uint32_t nranks;
  uint64_t slice_bytes;
  alignas(64) std::atomic<uint32_t> abort;         // 0, or 1 + the rank that aborted first
  std::atomic<uint32_t> reason_ready;
  char reason[1024];
};

// How a call moves data. The ring (2(N-1) dependent steps, each rank moves 2(N-1)/N of the
// tensor) wins on bandwidth; one-shot (every rank publishes its input, every rank reads and reduces
// all N in rank order: one step, N x the reads) wins on latency for small tensors; two-shot (every
// rank publishes its input, rank k reduces chunk k from all N in rank order and publishes it, every
// rank copies the N chunks out: two steps, the ring's bytes) reduces in rank order at any size.
// One-shot and two-shot give every element the bits of ((x0 op x1) op x2) ... (deterministic mode).
// Cma (RINGREDUCE_ALGO=cma, opt-in): two-shot's schedule with the data read straight from the
// peers' buffers by cross-memory attach (process_vm_readv), no slot copies; rank order too.
// Pool: a tensor in a buffer every rank maps (ringreduce.shared_empty): rank r folds chunk r of
// every rank's tensor in rank order and writes it into all of them, one pass, no slots.
// Wire: a call with a wire dtype (Call::wire): two-shot's schedule in whole blocks of
// kWireBlock elements, each part rounded onto the wire as it is published (shm/wire_run.cpp).

using ringreduce::Algo;  // the shared names (ring/call.h); this transport runs Auto to Wire
using ringreduce::algo_name;

// Every message carries the call it belongs to, so a reader checks it before touching data.
struct alignas(64) MsgHeader {
  uint64_t op_seq;
  int64_t numel;
  uint64_t nbytes;
  uint32_t index;  // message index within the call
  uint8_t coll, dtype, op, algo;
  uint8_t wire;   // Wire
  uint8_t flags;  // kFlagOverflow: the sender has seen a finite value overflow the wire (sticky)
};
constexpr uint8_t kFlagOverflow = 1;

size_t segment_bytes(int nranks, size_t slice_bytes);
// Called once by the creating rank on a zeroed mapping of segment_bytes().
void init_segment(void* base, int nranks, size_t slice_bytes);

// A call's tensor in a pool buffer: every rank's copy of the buffer mapped in this process (rank
// order; all the same size), and the tensor's byte offset in this rank's copy.
struct Pool {
  const std::vector<char*>* bases = nullptr;
  uint64_t bytes = 0;
  uint64_t off = 0;
};

// What every algorithm reads off its call alike: element size, buffers, AVG's divisor, and the
// chunks (all_reduce: ring::chunk of the whole tensor; reduce_scatter and all_gather: m each).
struct CallView {
  CallView(const Call& c, int n, int r)
      : es(dtype_size(c.dtype)), in(static_cast<const char*>(c.in)), out(static_cast<char*>(c.out)),
        divisor(c.op == RedOp::Avg ? n : 1), ar(c.coll == Coll::AllReduce), m(c.numel / n),
        out_shift(c.coll == Coll::ReduceScatter ? r * m : 0), numel(c.numel), n(n) {}
  ring::Span chunk(int k) const { return ar ? ring::chunk(numel, n, k) : ring::Span{k * m, m}; }
  int64_t largest_chunk() const { return ar ? (numel + n - 1) / n : m; }

  const size_t es;
  const char* const in;
  char* const out;
  const int divisor;
  const bool ar;
  const int64_t m;          // numel / n
  const int64_t out_shift;  // reduce_scatter's output holds chunk r only: where it starts
  const int64_t numel;
  const int n;
};

// Auto above one-shot's threshold: an all-reduce of at least from_bytes runs algo (ring, twoshot or
// cma), the last step it reaches; below the first step, the ring. Measured per machine (the table
// ringreduce/cpu_tuning.json); none: the ring at every size. Every rank must have the same steps.
struct Step {
  uint64_t from_bytes;
  Algo algo;
};

// The algorithms RINGREDUCE_ALGO may force, and those an auto step may name (Python reads both
// as _C.SHM_ALGOS and _C.SHM_STEP_ALGOS; the binding parses names against them).
constexpr Algo kForcedAlgos[] = {Algo::Auto, Algo::Ring, Algo::OneShot, Algo::TwoShot, Algo::Cma};
constexpr Algo kStepAlgos[] = {Algo::Ring, Algo::TwoShot, Algo::Cma};

struct Options {
  int rank = 0;
  int nranks = 1;
  double timeout_s = 300.0;  // RINGREDUCE_TIMEOUT: per wait
  int64_t spin_ns = 20000;   // busy-poll this long before sleeping on the futex
  int64_t yield_ns = 0;      // then poll with sched_yield this long (ranks > cores: hands the core
                             // to the rank being waited for at once), then sleep on the futex
  Algo algo = Algo::Auto;    // RINGREDUCE_ALGO
  size_t oneshot_max_bytes = 0;  // Auto picks one-shot for all-reduces up to this size
  std::vector<Step> steps;       // and these above it
  // RINGREDUCE_STREAM: how data other ranks read is written (slots, pool tensors), from
  // kStreamMinBytes up: Auto copies with ordinary stores and switches to non-temporal ones for a
  // while when copies run slower than kSlowBytesPerNs (a VM's slow state: Protocol::put);
  // Never/Always force one way.
  enum class Stream : uint8_t { Auto = 0, Never = 1, Always = 2 } stream = Stream::Auto;
};

constexpr size_t kStreamMinBytes = 32 << 10;  // smaller: ordinary stores (the reader's cache wins)
constexpr size_t kSlowBytesPerNs = 4;  // below 4 GB/s: the slow state (2-3.5 GB/s; a copy from
                                       // memory with both cores copying: 7-20 GB/s)
constexpr int kSlowCopiesToStream = 8;         // that many slow copies in a row:
constexpr int64_t kStreamHoldNs = 20'000'000;  // non-temporal stores for 20 ms, then re-check

class Protocol {
 public:
  Protocol(void* base, size_t bytes, const Options& opt);
  // Runs one collective. Throws RingError on timeout, dead peer, mismatch or abort; after that the
  // ring is broken and every later call throws at once. interrupted (optional) is polled while
  // waiting, every 50 ms: true aborts the group (the binding uses it for Ctrl-C).
  // algo: choose(c, pool), planned once by the caller (who records it). pool: the call's tensor
  // lies in a pool buffer (all-reduce in place).
  void run(const Call& c, Algo algo, const std::function<bool()>* interrupted = nullptr,
           const Pool* pool = nullptr);
  // The same, planning c itself (the native tests').
  void run(const Call& c, const std::function<bool()>* interrupted = nullptr, const Pool* pool = nullptr) {
    run(c, choose(c, pool), interrupted, pool);
  }
  // Marks the whole group broken (all ranks raise); safe from any thread.
  void abort(const std::string& why);
  bool broken() const;
  std::string abort_reason() const;
  uint64_t op_seq() const { return op_seq_; }
  // The first call that failed (it and every later one did), or 0.
  uint64_t failed_seq() const { return failed_seq_; }
  int nranks() const { return opt_.nranks; }
  // The algorithm run() uses for c (Auto resolved; rank order when c.deterministic).
  Algo choose(const Call& c, const Pool* pool = nullptr) const;
  // Replaces Options::steps; before the first call, the same on every rank.
  void set_steps(std::vector<Step> steps) { opt_.steps = std::move(steps); }
  // Whether this rank can read every peer's memory by cross-memory attach: "" if so, else why not
  // (a ptrace policy, a seccomp filter). Every rank must have constructed its Protocol first.
  std::string cma_probe() const;
  size_t slice_bytes() const { return slice_bytes_; }
  // What this rank waits for now, as a JSON object (the flight recorder's "waiting"), or "" when
  // no wait has outlasted its spin. Kept after a failed wait. Safe from any thread.
  std::string waiting() const;
  int pid_of(int rank) const { return areas_[rank].pid.load(); }
  // How often Stream::Auto found a slow copy and switched to non-temporal stores.
  uint64_t stream_switches() const { return stream_switches_.load(std::memory_order_relaxed); }

 private:
  struct Ctx {
    const Call& call;
    const char* phase;
    int step;
    int64_t slice;
  };
  struct Prims;  // the ring's primitives (ring/loop.h) on the slots
  char* slot(int r, uint32_t m) const;
  void wait_ge(Counter& c, uint32_t target, int peer, const Ctx& ctx, const char* what);
  char* acquire_send(const Ctx& ctx);
  void post_send(const Ctx& ctx, uint64_t nbytes);
  const char* recv(const Ctx& ctx, uint64_t expect_bytes);
  void release_recv();
  void check_header(const Ctx& ctx, int from, const MsgHeader* h, uint64_t expect_bytes);
  void wait_all_consumed(uint32_t target, const Ctx& ctx);
  void run_oneshot(const Call& c, Ctx& ctx);
  void run_twoshot(const Call& c, Ctx& ctx);
  void run_cma(const Call& c, Ctx& ctx);
  void run_pool(const Call& c, Ctx& ctx, const Pool& pool);
  // Returns how many finite values overflowed the wire on any rank (fp16), as far as this rank
  // learned it: every rank, for an all-reduce.
  int64_t run_wire(const Call& c, Ctx& ctx);
  uint32_t say_wide(const Ctx& ctx, const void* payload, uint64_t bytes);  // returns its index
  // Copies bytes at addr in rank q's memory to local (process_vm_readv); fails the ring on error.
  void read_peer(int q, void* local, uint64_t addr, size_t bytes, const Ctx& ctx);
  // Waits for message m of every other rank (a wide message) and checks its header.
  const char* recv_wide(const Ctx& ctx, int from, uint32_t m, uint64_t expect_bytes);
  void release_wide(uint32_t m);  // every rank's message m read
  void put(void* dst, const void* src, size_t bytes);  // data other ranks read next
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
  uint64_t failed_seq_ = 0;
  uint32_t msg_in_call_ = 0;
  uint32_t wide_until_ = 0;  // messages before this index may be read by every rank (one-shot)
  Algo algo_ = Algo::Ring;   // of the current call
  int64_t stream_until_ns_ = 0;  // Stream::Auto: non-temporal copies until then (steady clock)
  int slow_copies_ = 0;          // slow ordinary copies in a row
  std::atomic<uint64_t> stream_switches_{0};  // read from other threads
  bool broken_ = false;
  const std::function<bool()>* interrupted_ = nullptr;
  std::vector<const void*> srcs_;  // one-shot/two-shot: the N sources of a slice, in rank order
  std::vector<uint64_t> peer_in_, peer_out_;  // cma: the peers' buffers in the current call
  std::vector<char> scratch_;                 // cma: a block of every peer's chunk
  std::vector<char*> pool_at_;                // pool: every rank's tensor, mapped here
  std::vector<char> wire_own_, wire_res_;     // wire: this rank's part and its result, encoded
  std::vector<char> wire_tmp_;                // wire: a part on its way into a slot
  uint8_t wire_flags_ = 0;                    // wire: sent in every header of the call
  // The slow wait in progress (wait_peer_ -1: none); written by the ring's thread only.
  std::atomic<int> wait_peer_{-1};
  std::atomic<const char*> wait_what_{""}, wait_phase_{""};
  std::atomic<int> wait_step_{0};
  std::atomic<int64_t> wait_slice_{0}, wait_since_ns_{0};
  std::atomic<uint64_t> wait_seq_{0};
};

}  // namespace shm
}  // namespace ringreduce
