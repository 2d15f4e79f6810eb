// The host side of the p2p transport, one rank's Endpoint (a runtime::Transport): the ring protocol of shm/protocol.h on GPU memory shared by CUDA IPC: each rank owns, per
// channel, a FIFO of kSlots message slots and two counters (posted, consumed) in its own cudaMalloc'ed
// area; its downstream neighbour reads the slots and the posted counter through an IPC mapping, its
// upstream neighbour reads the consumed counter. Every message carries the call's header, checked
// before the data is touched. Waits poll a host-mapped abort flag, the neighbours' abort words and a
// deadline (%globaltimer): nothing spins forever. Torch-free.
// The endpoint is the Transport front over parts that each own their state and lock: the areas
// (areas.h), stopping (failures.h), registered buffers (registered.h), imported memory (imports.h)
// and the copy algorithm (copy.h). It calls them; they do not call it, and no part calls another
// but through a callback the front gives it (an abort telling the areas and the copy algorithm),
// so the lock order is the call order: failures, then areas or copy; imports, registered alone.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cuda/call_log.h"
#include "cuda/p2p/area_layout.h"
#include "cuda/p2p/areas.h"
#include "cuda/p2p/copy.h"
#include "cuda/p2p/failures.h"
#include "cuda/p2p/imports.h"
#include "cuda/p2p/launch.h"
#include "cuda/p2p/plan.h"
#include "cuda/p2p/registered.h"
#include "runtime/peers.h"
#include "runtime/transport.h"

namespace ringreduce::cuda::p2p {

// One rank's side of the group, on the device current at construction.
class Endpoint : public runtime::Transport {
 public:
  explicit Endpoint(const Options& opt);
  ~Endpoint() override;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // This rank's area as cudaIpcMemHandle_t bytes, for the other ranks ("" at world 1: no area).
  std::string handle() const;
  // Maps the other ranks' areas: handles[q] from handle() on rank q (this rank's own is ignored).
  // The neighbours' are required; with Options::direct every rank's (an empty string: not
  // mappable, an error then).
  void connect(const std::vector<std::string>& handles);
  // Native tests only: ranks as streams of one process, the others' areas used directly.
  void connect_local(const std::vector<const Endpoint*>& rings);
  // Enqueues one collective on stream (ordered after what is already there). Throws RingError when
  // the ring is broken, or when deterministic mode needs the symmetric workspace and the group
  // cannot run it (see plan()); a failure inside the kernel is seen later by failure().
  // Capture-safe (CUDA graphs): no host synchronisation, and the kernels take where each FIFO and
  // epoch counter stands from device memory, so a replayed launch continues where the group is.
  // plan: plan(c)'s if the caller has it already (the binding plans each call once), else computed.
  void run(const Call& c, cudaStream_t stream, const Plan* plan = nullptr);

  // runtime::Transport.
  const char* name() const override { return "p2p"; }
  runtime::Caps caps() const override;
  int nranks() const override { return opt_.nranks; }
  Plan plan(const Call& c) override { return opt_.nranks < 2 ? Plan{} : plan_of(c); }
  void run(const Call& c, const Plan& p, void* stream) override { run(c, static_cast<cudaStream_t>(stream), &p); }
  bool open() const override { return !closed_ && !unmapped_; }
  int call_state(uint64_t seq, int64_t* done_ns) override {
    return static_cast<int>(calls_.state(seq, done_ns));
  }
  void log_calls(bool on) override { calls_.enable(on); }
  Pin capture_pin() override { return {graph_pin(), &Endpoint::release_graph_pin}; }
  // A captured launch's copy of the host's abort word into this rank's area (Area::host_abort),
  // enqueued before the kernel: a graph replays it, then the kernel's blocks read device memory.
  void copy_host_abort(cudaStream_t stream) const;
  // Native tests: the workspace's epoch and the LL count set on this rank as after that many calls
  // (between calls, on every rank alike), and where this rank's LL slots lie (two of slot_bytes
  // per source).
  void set_counts(uint64_t epoch, uint64_t ll_calls);
  const char* ll_slots(size_t* slot_bytes) const {
    *slot_bytes = layout_.ll_slot;
    return layout_.ll_bytes() ? areas_.own() + layout_.ll_at() : nullptr;
  }
  // Native tests: launches call c's kernel again with the arguments run() gave it (after run()
  // counted the call), as a CUDA graph replays a captured launch. Endpoint and symmetric workspace.
  void launch_again(const Call& c, cudaStream_t stream) const;
  // The kernel arguments of call c under plan p as run() launches them (after run() counted the
  // call): ring and copy; the symmetric workspace.
  Args args(const Call& c, const Plan& p) const;
  SymArgs sym_args(const Call& c, const Plan& p) const;
  // plan(), except that an all_reduce in place of a tensor in a registered buffer runs
  // Algo::Registered when the algorithm is Auto (a forced one keeps its meaning) and the tensor is
  // larger than auto's one-shot threshold.
  Plan plan_of(const Call& c) const;
  // Registered buffers (ringreduce.shared_empty on CUDA): every rank allocates the same buffers in
  // the same order. reg_alloc: a new buffer of `bytes` on this device; returns its index and
  // (handle) its IPC handle. reg_connect maps every other rank's copy (handles by rank, this
  // rank's ignored); a group where not every rank maps every other cannot have them. The memory
  // stays until close() (the peers map it) and, past that, while reg_memory()'s owner lives.
  int reg_alloc(size_t bytes, std::string* handle);
  void reg_connect(int id, const std::vector<std::string>& handles);
  // Native tests only: ranks as streams of one process, the others' buffers used directly.
  void reg_connect_local(int id, const std::vector<const Endpoint*>& rings);
  std::shared_ptr<char> reg_memory(int id) const;
  // This rank's tensor of buffer id is gone (no call of this rank uses it any more: a call holds
  // its tensor until it ends): unmaps the peers' copies and lets go of this one, which goes with
  // its last owner. Kept instead (until exit) while a CUDA graph may replay a launch on it, and
  // this rank's copy also once the ring broke (a peer's stopped call may still write into it).
  void reg_release(int id);
  int reg_count() const { return registered_.count(); }
  // Imported memory (imports.cpp): an all_reduce in place of an ordinary tensor larger than auto's
  // one-shot threshold plans Algo::Imported once the group's board is attached; see layout.h.
  // board_attach: rank 0 creates the POSIX shared memory `name`, the others map it after; before
  // the first call. Starts this rank's reaper (every 2 ms: withdraws this rank's allocations no
  // tensor uses any more, closes what a peer withdrew, drops holds every peer is done with).
  void board_attach(const std::string& name, bool create) { imported_.attach(name, create); }
  bool board() const { return imported_.attached(); }
  // The holds that keep exported memory allocated (imports.h); set before the first call.
  using Hold = p2p::Hold;
  using Holder = p2p::Holder;
  void set_holder(Holder h) { imported_.set_holder(std::move(h)); }
  // Holds this rank keeps (exported allocations' and those waiting for the peers to close).
  size_t holds() const { return imported_.holds(); }
  // Why the last import this rank tried could not share or map memory ("" if none failed).
  std::string import_note() const { return imported_.note(); }
  // The first such note, once (runtime::Transport).
  std::string take_note() override { return imported_.take_note(); }
  // Imported calls the device has reported so far, and of those, the ones that ran in place.
  uint64_t imported_seen() const { return imported_.seen(); }
  uint64_t imported_in_place() const { return imported_.in_place(); }
  size_t imports() const { return imported_.mapped(); }  // the peers' allocations mapped here
  void learn() { imported_.learn(failures_.ctl(), op_seq_); }  // what the device reported of finished calls, now
  // Auto's one-shot threshold (see Options); the same on every rank, before the first call.
  void set_threshold(size_t oneshot_max) {
    opt_.tuned = true;
    opt_.oneshot_max = oneshot_max;
  }
  // The LL one-shot's reach (Options::ll_max): at most what its buffers hold (the reach made at
  // construction); 0 turns it off. The same on every rank, before the first call.
  void set_ll_max(size_t bytes);
  // A workspace call's most blocks (Options::sym_blocks), measured for this device (the binding
  // reads ringreduce/gpu_tuning.json); the same on every rank, before the first call.
  void set_sym_blocks(int blocks);
  bool direct() const { return areas_.direct(); }
  // The first failure the device recorded, formatted, or "" while there is none.
  std::string failure() override { return failures_.failure(); }
  bool broken() { return !failure().empty(); }
  // The op_seq of the first call that failed, or 0: that call and every later one failed, every
  // earlier one completed. Final for a call once its kernel has finished.
  uint64_t failed_seq() override { return failures_.failed_seq(); }
  // Stops this rank's running and future kernels and tells every mapped peer.
  void abort(const std::string& why) override { failures_.abort(why); }
  // Watches the processes of these peers (every 50 ms): a dead one aborts the ring with
  // "peer rank R (pid P) died", so no rank waits out its timeout for a killed one.
  void watch_peers(std::vector<runtime::Peer> peers) override { failures_.watch_peers(std::move(peers)); }
  // Stops the parts' threads, nothing else (no CUDA call): for a ring left to the process's exit
  // while the interpreter finalizes.
  void stop_threads() override;
  // Whether this ring has the copy algorithm's inbox (RINGREDUCE_CUDA_ALGO=copy: opt-in, for ranks
  // sharing a GPU without MPS; auto does not pick it, no GPU has shown it faster yet).
  bool copies() const { return copy_.on(); }
  // The copy algorithm's counters (CopyCtl), shared by the group: rank 0 creates the POSIX shared
  // memory segment `name`, the others map it (after rank 0 made it); every rank registers it with
  // CUDA. The creator unlinks the name once all have mapped it. Before the first call.
  void copy_attach(const std::string& name, bool create) { copy_.attach(name, create); }
  // Unmaps the peers and frees. Idempotent; no kernel of this ring may be running.
  // peers_done=false: a peer may still read or write this rank's area (the close barrier failed,
  // or the ring broke): the area is marked aborted, so their waits stop, and kept until the
  // process exits, since freeing it could hand memory they still use to another allocation.
  void close(bool peers_done = true) override;
  // The first half of a two-phase close: stops the watchers and unmaps the peers' areas and
  // shared buffers (no call may run after it). Freeing memory another process still maps is
  // undefined in CUDA, so every rank does this, then a barrier, then close(true) frees. False when
  // the mappings stay (a CUDA graph pins the ring, or pinned it at close: its launches were
  // captured with the peers' addresses): then no rank of the group may free its memory.
  bool unmap_peers() override;
  // Areas kept by close(false) in this process (bytes), for tests and logs.
  static size_t kept_bytes();
  // A CUDA graph that captured a launch of this ring replays it with this ring's addresses. While
  // a graph holds a pin (taken at capture, released when CUDA destroys the graph), close() frees
  // and unmaps nothing a kernel touches (kept until exit) and raises only this rank's host abort
  // flag, so that a replay after close stops at its start (a captured launch reads that flag
  // there: KernelBase::graph): never a use of freed memory.
  // graph_pin() returns the argument for release_graph_pin, a cudaUserObject destructor (it makes
  // no CUDA call, as those must not).
  void* graph_pin();
  static void release_graph_pin(void* pin);
  int graph_pins() const { return pins_->load(); }
  bool closed() const override { return closed_; }
  bool unmapped() const { return unmapped_; }  // the first half of a close ran
  uint64_t op_seq() const override { return op_seq_; }
  // Whether call `seq` (a narrow wire with fp16) rounded a finite value beyond fp16's range on
  // some rank: every rank learns it. Final once the call's kernel has finished; for the last
  // kWireOverflowSlots calls.
  bool wire_overflowed(uint64_t seq) const {
    const HostCtl* ctl = failures_.ctl();
    return ctl && reinterpret_cast<volatile const uint64_t*>(ctl->wire_overflow)[seq % kWireOverflowSlots] == seq;
  }
  // Which calls have finished on the device (the flight recorder reads it without blocking).
  CallLog& calls() { return calls_; }
  int device() const { return device_; }
  // Device memory this rank's communicator holds (its area: flags, the ring's FIFO where the ring
  // can run, the workspace where the symmetric algorithms can, the copy inbox where asked for);
  // 0 at world 1. Registered buffers are the user's and not counted.
  size_t area_bytes() const { return layout_.bytes(); }

 private:
  static int current_device() {
    int d = 0;
    cudaGetDevice(&d);
    return d;
  }
  // The kernels' arguments for every rank's memory of a call: the areas, or (Registered,
  // Imported) the tensors in place.
  void fill_data(const Plan& p, SymArgs* a) const;
  // Where call c's tensor lies (plan's Memory).
  Memory memory_of(const Call& c) const;

  Options opt_;
  int device_ = current_device();  // the device current at construction (before the parts)
  AreaLayout layout_ = area_layout(opt_);
  int up_ = 0, down_ = 0;
  bool closed_ = false;
  bool unmapped_ = false;  // unmap_peers() ran: the ring runs nothing more
  bool maps_kept_ = false;  // closed under a graph pin: the peers stay mapped until exit
  std::atomic<uint64_t> op_seq_{0};
  CallLog calls_;
  std::shared_ptr<std::atomic<int>> pins_ = std::make_shared<std::atomic<int>>(0);  // graphs
  // The parts (see the top of this file); declared after what they read, closed by close().
  Areas areas_{opt_.rank, opt_.nranks, device_};
  Failures failures_{opt_.rank, opt_.nranks, opt_.timeout_s, op_seq_};
  Registered registered_{opt_.rank, opt_.nranks, device_};
  Imports imported_{opt_.rank, opt_.nranks, device_, pins_};
  ImportedCall imp_;  // the imported call run() is launching
  CopyPath copy_{opt_, layout_, device_};
};

}  // namespace ringreduce::cuda::p2p
