// The ring protocol's messages on the slots. Each rank writes its own FIFO and posts a count; a
// message is read by the downstream neighbour only (the ring's) or by every rank (wide: one-shot,
// two-shot, cma, pool, wire), and its slot is rewritten only once every rank that reads it has
// consumed it. Every header names its call, so a reader checks it before the data: a mismatch
// fails the group (Waits). The Writer is how data other ranks read is stored.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>

#include "shm/options.h"
#include "shm/segment.h"
#include "shm/waits.h"

namespace ringreduce {
namespace shm {

constexpr size_t kStreamMinBytes = 32 << 10;  // smaller: ordinary stores (the reader's cache wins)
constexpr size_t kSlowBytesPerNs = 4;  // below 4 GB/s: the slow state (2-3.5 GB/s; a copy from
                                       // memory with both cores copying: 7-20 GB/s)
constexpr int kSlowCopiesToStream = 8;         // that many slow copies in a row:
constexpr int64_t kStreamHoldNs = 20'000'000;  // non-temporal stores for 20 ms, then re-check

// Copies data that other ranks read next (slots, pool tensors), as Options::stream says.
class Writer {
 public:
  explicit Writer(Options::Stream mode) : mode_(mode) {}
  void put(void* dst, const void* src, size_t bytes);
  // How often Stream::Auto found a slow copy and switched to non-temporal stores (any thread).
  uint64_t switches() const { return switches_.load(std::memory_order_relaxed); }

 private:
  const Options::Stream mode_;
  int64_t stream_until_ns_ = 0;  // Stream::Auto: non-temporal copies until then (steady clock)
  int slow_copies_ = 0;          // slow ordinary copies in a row
  std::atomic<uint64_t> switches_{0};
};

class Mailbox {
 public:
  Mailbox(void* base, const Options& opt, Waits& waits, Writer& writer);
  size_t slice_bytes() const { return slice_bytes_; }
  // A new call run with algo (every header says it; a peer's other algorithm fails the call):
  // its messages count from 0, its flags from none.
  void begin(Algo algo) {
    msg_in_call_ = 0;
    algo_ = algo;
    flags_ = 0;
  }

  // The ring's messages: to the downstream neighbour, from the upstream one.
  char* acquire_send(const Ctx& ctx);  // waits for a free slot; returns its data
  void post_send(const Ctx& ctx, uint64_t nbytes);
  const char* recv(const Ctx& ctx, uint64_t expect_bytes);  // the next message's data, checked
  void release_recv();

  // Wide messages. begin_wide waits until this rank's next slot is free on every rank and returns
  // its data; post_wide posts it and returns its index; say_wide is both, for a small payload.
  char* begin_wide(const Ctx& ctx);
  uint32_t post_wide(const Ctx& ctx, uint64_t nbytes);
  uint32_t say_wide(const Ctx& ctx, const void* payload, uint64_t bytes);
  const char* recv_wide(const Ctx& ctx, int from, uint32_t m, uint64_t expect_bytes);
  void release_wide(uint32_t m);  // every rank's message m, and all before it, read
  uint32_t last_sent() const { return sent_ - 1; }  // this rank's latest message

  // The wire's flags (kFlagOverflow): sent in every header of the call, or-ed with every read one.
  void raise_flags(uint8_t f) { flags_ |= f; }
  uint8_t flags() const { return flags_; }

 private:
  char* slot(int r, uint32_t m) const {
    return slots_ + (static_cast<size_t>(r) * kSlots + m % kSlots) * slot_stride_;
  }
  void check_header(const Ctx& ctx, int from, const MsgHeader* h, uint64_t expect_bytes);
  void wait_all_consumed(uint32_t target, const Ctx& ctx);

  Waits& waits_;
  Writer& writer_;
  RankArea* const areas_;
  char* const slots_;
  const size_t slice_bytes_, slot_stride_;
  const int rank_, nranks_, up_, down_;
  uint32_t sent_ = 0, received_ = 0;  // messages over the communicator's lifetime
  uint32_t msg_in_call_ = 0;
  uint32_t wide_until_ = 0;  // messages before this index may be read by every rank
  Algo algo_ = Algo::Ring;   // of the current call
  uint8_t flags_ = 0;
};

}  // namespace shm
}  // namespace ringreduce
