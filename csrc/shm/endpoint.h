// The shared-memory transport's endpoint (a runtime::Transport): the POSIX shared-memory mapping
// that holds one group's ring, and the protocol running on it. A host transport: a call runs on
// the calling thread. Torch-free.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "runtime/transport.h"
#include "shm/protocol.h"

namespace ringreduce::shm {

class Endpoint : public runtime::Transport {
 public:
  // create=true: make the named segment (it must not exist), size and initialise it.
  // create=false: map the segment another rank made.
  Endpoint(const std::string& name, bool create, const Options& opt, size_t slice_bytes);
  ~Endpoint() override;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // The protocol, for what only this transport has (pools, interrupts, cma, the recorder's probe).
  Protocol& protocol();

  // runtime::Transport. The peers' liveness is the protocol's own (their pids are in the segment);
  // nothing of this rank's is mapped by a peer beyond the segment's name, so close is one phase.
  const char* name() const override { return "shm"; }
  runtime::Caps caps() const override;
  int nranks() const override { return nranks_; }
  Plan plan(const Call& c) override {
    Plan p;
    p.algo = protocol().choose(c);
    return p;
  }
  // The protocol plans again, as it must for a pool buffer's call (ShmComm drives it directly).
  void run(const Call& c, const Plan& /*p*/, void* /*stream*/) override { protocol().run(c); }
  using Transport::run;
  std::string failure() override;
  uint64_t failed_seq() override { return ring_ ? ring_->failed_seq() : 0; }
  void abort(const std::string& why) override;
  void watch_peers(std::vector<runtime::Peer> /*peers*/) override {}
  void close(bool /*peers_done*/) override { close(); }
  // Unmaps; idempotent. The protocol must not be running.
  void close();
  bool closed() const override { return base_ == nullptr; }
  uint64_t op_seq() const override { return ring_ ? ring_->op_seq() : 0; }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  int nranks_ = 0;
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
