// The call descriptor and how ranks compare them. NCCL does not fail every rank of a mismatched
// call (over sockets, on the first H200 run, only the rank whose receive was truncated failed; the
// sender's call succeeded), so each call starts with a group of its own that sends this rank's
// descriptor to every peer and receives theirs; the host compares them as soon as they are copied
// back, before the data has moved, and a difference fails the call on every rank.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ring/call.h"

namespace ringreduce::cuda::nccl {

struct Desc {
  uint64_t op_seq;
  int64_t numel;
  uint8_t coll, dtype, op, algo;
  uint32_t magic;
  uint64_t pad;
};

// Call #seq's descriptor, marked as one.
Desc describe(const Call& c, uint64_t seq, Algo algo);
// d: nranks descriptors, this rank's at its rank, the peers' in `from` at theirs. "" when every one
// of those equals this rank's, else the first difference, worded as the p2p transport words it.
std::string mismatch(const Desc* d, int rank, const std::vector<int>& from);

// Room for the descriptors of the calls in flight, a slot per call: nranks descriptors on the
// device (what the group sends and receives) and their pinned host copy. Allocated kPerChunk
// slots at a time; freed only by free_all().
class DescSlots {
 public:
  explicit DescSlots(int nranks) : nranks_(nranks) {}
  int take();  // grows when every slot is in use
  void give(int slot) { free_.push_back(slot); }
  char* dev(int slot) const { return slots_[slot].dev; }
  Desc* host(int slot) const { return slots_[slot].host; }
  void free_all();  // the caller's device is current; nothing may be in flight

 private:
  static constexpr int kPerChunk = 16;
  struct Slot {
    char* dev;
    Desc* host;
  };
  int nranks_;
  std::vector<Slot> slots_;
  std::vector<int> free_;
  std::vector<std::pair<void*, void*>> chunks_;  // (device, pinned host) allocations
};

}  // namespace ringreduce::cuda::nccl
