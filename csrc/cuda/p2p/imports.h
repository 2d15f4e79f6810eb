// Imported memory of the p2p transport (Algo::Imported; layout.h): this rank's exports and the holds
// that keep them allocated, the peers' allocations mapped here, the predictions of the peers'
// memory, and the reaper thread that releases all of it. One part of the endpoint: it owns this
// state and its lock, and calls nothing of the endpoint's. Torch-free.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda/p2p/layout.h"
#include "ring/call.h"
#include "runtime/peers.h"

namespace ringreduce::cuda::p2p {

// What keeps an allocation this rank exports from being freed while a peer may map it: freeing
// memory before every importer closed its mapping is undefined (CUDA Runtime API,
// cudaIpcOpenMemHandle). The binding's hold is a reference to the tensor's storage, so torch's
// caching allocator frees neither its block nor the segment (the allocation) around it.
// in_use(): someone else still refers to it (a tensor); key(): the same for every hold on one
// owner. The reaper drops a hold only after every peer closed its mapping, outside the lock.
struct Hold {
  virtual ~Hold() = default;
  virtual bool in_use() const = 0;
  virtual const void* key() const = 0;
};
// A hold on call c's input (c.owner says whose memory it is), or null and why it cannot be
// shared. Called outside the lock; set before the first call (without one, nothing is imported).
using Holder = std::function<std::unique_ptr<Hold>(const Call& c, std::string* why)>;

// One call's imported memory, for its kernel's arguments: its tag, the hash of the tags it predicts
// (0: no prediction, the call goes through the workspace), and every rank's tensor (this rank's
// own; a peer's as mapped here).
struct ImportedCall {
  uint64_t tag = 0, hash = 0;
  char* at[kMaxPeers] = {};
};

class Imports {
 public:
  // pins: the endpoint's CUDA graph pins (while any, nothing mapped here is closed: the graphs'
  // captured launches may read it).
  Imports(int rank, int nranks, int device, std::shared_ptr<std::atomic<int>> pins)
      : rank_(rank), nranks_(nranks), device_(device), pins_(std::move(pins)) {}
  ~Imports() { stop(); }
  Imports(const Imports&) = delete;
  Imports& operator=(const Imports&) = delete;

  // The group's board: rank 0 creates the POSIX shared memory `name`, the others map it after;
  // before the first call. Starts the reaper (every 2 ms: withdraws this rank's allocations no
  // tensor uses any more, closes what a peer withdrew, drops holds every peer is done with).
  void attach(const std::string& name, bool create);
  bool attached() const { return attached_.load(std::memory_order_acquire); }
  void set_holder(Holder h);
  // Call c's tag and the peers' memory it predicts (mapped now if new; nothing new inside a
  // capture: those IPC calls would invalidate it). ctl: the device's reports of earlier calls
  // (HostCtl::seen); op_seq: the endpoint's count of calls before this one.
  ImportedCall prepare(const Call& c, bool capturing, const HostCtl* ctl, uint64_t op_seq);
  // What the device reported of finished calls, now (tests: the counts below).
  void learn(const HostCtl* ctl, uint64_t op_seq);
  uint64_t seen() const;      // Imported calls the device has reported so far
  uint64_t in_place() const;  // of those, the ones that ran in place
  size_t mapped() const;      // the peers' allocations mapped here
  size_t holds() const;       // holds kept (live exports' and withdrawn ones')
  std::string note() const;   // why the last import could not share or map memory ("" if none)
  std::string take_note();    // the first such note, once
  // Stops the reaper (no CUDA call after). Idempotent.
  void stop();
  // Every peer allocation mapped here closed, and this rank reported done with all (unmap_peers,
  // close). After stop().
  void close_mappings();
  // At close, after stop(): the holds dropped (peers_done: every peer closed its mappings; torch
  // may free now) or kept until exit, the exports withdrawn, the board unmapped.
  void release(bool peers_done);

 private:
  struct Export {
    uint64_t id;
    size_t bytes;
    std::map<const void*, std::unique_ptr<Hold>> holds;  // by key; never empty
  };
  struct Retiring {  // an export withdrawn, kept until every peer reaped `kills`
    uint64_t kills;
    std::vector<std::unique_ptr<Hold>> holds;
  };
  struct Mapping {
    char* p;
    size_t bytes;
  };
  uint64_t export_of(const Call& c, std::unique_ptr<Hold> hold);
  uint64_t tag_locked(uintptr_t p, uint64_t bytes, std::unique_ptr<Hold>* hold);
  void close_all(const std::vector<char*>& to_close);
  void learn_locked(const HostCtl* ctl, uint64_t op_seq);
  char* map_locked(int q, uint64_t id, uint64_t end);
  void reap();
  void say_locked(const std::string& why) { note_ = why; }

  const int rank_, nranks_, device_;
  std::shared_ptr<std::atomic<int>> pins_;
  Holder holder_;
  std::atomic<bool> attached_{false};
  std::unique_ptr<runtime::Ticker> reaper_;
  mutable std::mutex mu_;  // everything below; no CUDA call or drop of a hold under it
  RegBoard* board_ = nullptr;
  std::map<uintptr_t, Export> exports_;  // this rank's, by base
  std::deque<Retiring> retiring_;
  std::map<std::pair<int, uint64_t>, Mapping> mappings_;  // the peers' allocations, by (rank, id)
  std::set<std::pair<int, uint64_t>> unmappable_;  // the peers' allocations whose open failed here
  std::unordered_map<uint64_t, std::vector<uint64_t>> predict_;  // own tag -> the tags it met last
  std::deque<uint64_t> to_learn_;  // calls whose tags are to learn
  uint64_t next_export_ = 1;
  uint64_t seen_ = 0, in_place_ = 0;
  uint64_t kills_seen_[kMaxPeers] = {};
  std::string note_;
  bool note_taken_ = false;
};

}  // namespace ringreduce::cuda::p2p
