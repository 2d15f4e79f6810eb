// The segment every rank of a group maps: a group header (the abort word and its reason), one area
// per rank (its two counters, its pid, its cma probe's address), then each rank's FIFO of kSlots
// message slots, a MsgHeader before each slot's data. Plain data: waits.h waits on the counters and
// owns the abort; mailbox.h writes and reads the slots.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>

#include "ring/call.h"
#include "ring/schedule.h"

namespace ringreduce {
namespace shm {

constexpr int kSlots = ring::kSlots;

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

constexpr uint32_t kMagic = 0x52524431;  // "RRD1"

inline size_t slot_stride(size_t slice_bytes) { return sizeof(MsgHeader) + round_up(slice_bytes, 64); }
inline size_t segment_bytes(int nranks, size_t slice_bytes) {
  return sizeof(GroupHeader) + nranks * sizeof(RankArea) + nranks * kSlots * slot_stride(slice_bytes);
}
inline RankArea* areas_of(void* base) {
  return reinterpret_cast<RankArea*>(static_cast<char*>(base) + sizeof(GroupHeader));
}
// Called once by the creating rank on a zeroed mapping of segment_bytes().
void init_segment(void* base, int nranks, size_t slice_bytes);

// Where a rank is in a call: what its waits and failures say.
struct Ctx {
  const Call& call;
  uint64_t seq;  // the call's op_seq on this communicator
  const char* phase;
  int step;
  int64_t slice;
};

}  // namespace shm
}  // namespace ringreduce
