// The shared-memory transport's endpoint: the POSIX shared-memory mapping that holds one group's
// ring, and the protocol running on it; a call runs on the calling thread. Torch-free. Not a
// runtime::Transport: its calls need what that interface does not carry (the Ctrl-C check polled
// inside every wait, the pool buffer a tensor lies in, the protocol's probe for the recorder), and
// its one driver, binding/ShmComm, plans and runs them on protocol() directly, once per call.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "shm/protocol.h"

namespace ringreduce::shm {

class Endpoint {
 public:
  // create=true: make the named segment (it must not exist), size and initialise it.
  // create=false: map the segment another rank made.
  Endpoint(const std::string& name, bool create, const Options& opt, size_t slice_bytes);
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // The protocol, for what only this transport has (pools, interrupts, cma, the recorder's probe).
  Protocol& protocol();

  // Unmaps; idempotent. The protocol must not be running. The peers' liveness is the protocol's
  // own (their pids are in the segment).
  void close();
  bool closed() const { return base_ == nullptr; }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::unique_ptr<Protocol> ring_;
};

// A pool buffer (ringreduce.shared_empty): this rank's copy, made here, and every peer's copy,
// mapped here, so that an all-reduce of a tensor in it reads the peers' data by plain loads.
// Unmapped when the last reference goes (the tensor's deleter and any call in flight hold one).
struct PoolBuffer {
  uint64_t owner = 0;           // the communicator it was made for (a process-unique id)
  int rank = 0;                 // bases[rank] is this rank's copy
  std::vector<char*> bases;     // every rank's copy, in rank order (null: not mapped)
  uint64_t bytes = 0;           // of each copy
  ~PoolBuffer();
};

// The copies are named segments (runtime/shm_map.h): made by runtime::shm_create, mapped by shm_map.
// Buffers in use, by their owner's copy. pool_find: the buffer made for owner whose copy holds
// [p, p + bytes), or null (cheap when no buffer exists).
void pool_register(const std::shared_ptr<PoolBuffer>& b);
void pool_unregister(const PoolBuffer* b);
std::shared_ptr<PoolBuffer> pool_find(uint64_t owner, const void* p, uint64_t bytes);

}  // namespace ringreduce::shm
