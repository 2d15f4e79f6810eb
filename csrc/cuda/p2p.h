// The ring protocol of csrc/shm/protocol.h on GPU memory shared by CUDA IPC: each rank owns, per
// channel, a FIFO of kSlots message slots and two counters (posted, consumed) in its own cudaMalloc'ed
// area; its downstream neighbour reads the slots and the posted counter through an IPC mapping, its
// upstream neighbour reads the consumed counter. Every message carries the call's header, checked
// before the data is touched. Waits poll a host-mapped abort flag, the neighbours' abort words and a
// deadline (%globaltimer): nothing spins forever. Torch-free.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "host/peers.h"

#include "ring/schedule.h"
#include "cuda/call_log.h"
#include "ring/call.h"

namespace ringreduce::cuda::p2p {

// Same FIFO depth, and the same reason for it, as the shared-memory ring.
constexpr int kSlots = ring::kSlots;
// Ring channels (one thread block each, over disjoint parts of every chunk): at most this many, and
// by default at most 16 (NCCL's ring channel counts on NVLink machines are 16-32 on A100/H100; not
// measured here: no GPU). The count used per call comes from plan().
constexpr int kDefaultChannels = 16;
constexpr int kMaxChannels = 32;
// The largest slice (and so the FIFO slot): 512 KiB, NCCL's slice in its simple protocol
// (NCCL_BUFFSIZE 4 MiB / 8 steps). plan() cuts smaller slices for smaller tensors.
constexpr size_t kDefaultSliceBytes = 512 << 10;
// plan(): a channel per this many bytes of a chunk (so a channel moves enough to hide its per-hop
// latency), and slices of a channel's part in at least this many pieces (a pipeline 4 deep), no
// smaller than kMinSliceBytes.
constexpr size_t kChannelBytes = 128 << 10;
constexpr int kSlicesInFlight = 4;
constexpr size_t kMinSliceBytes = 4 << 10;
// The symmetric workspace algorithms (one-shot, two-shot, registered) read every peer's memory:
// up to this many ranks.
constexpr int kMaxPeers = 16;
// Their thread blocks: at most kMaxSymBlocks, by default at most kDefaultSymBlocks (torch's
// SymmetricMemory launches ~24, vLLM's custom all-reduce 36; Options::sym_blocks sets another,
// from RINGREDUCE_CUDA_SYM_BLOCKS or the device's measured entry in gpu_tuning.json), one per
// kSymBytesPerBlock of a piece below that (a 4 KiB call runs one). 64 lets a measurement try
// half of an H100/H200's SMs per rank at world 2 (24 blocks left the H200's HBM half idle).
// Every block spins on its peers' blocks, so all must be resident: Options::max_blocks caps them.
constexpr int kMaxSymBlocks = 64;
constexpr int kDefaultSymBlocks = 24;
constexpr size_t kSymBytesPerBlock = 32 << 10;
// The most blocks of any kernel (one error record each).
constexpr int kMaxBlocks = kMaxChannels > kMaxSymBlocks ? kMaxChannels : kMaxSymBlocks;
// The workspace: two halves of this many bytes per rank (plus alignment slack), pieces of a call
// alternating between them, so that a rank copies piece k + 1 into one half while its peers may
// still read piece k from the other. One barrier (two-shot: two) per piece: a 256 MiB all_reduce
// runs 16 pieces. 32 MiB per rank in all, the budget being 64 MiB at world 2.
constexpr size_t kDefaultChunkBytes = 16 << 20;
// Slot data starts at the slice's byte offset mod 16 in the tensor, so that a 16-byte aligned tensor
// and the slot have the same alignment and the vector path applies; a slot is this much larger.
constexpr size_t kVecBytes = 16;
// Flags sit on their own 128-byte line (the L2 line size of NVIDIA GPUs).
constexpr size_t kLine = 128;

// Which algorithm a call runs. Values are part of the message headers.
// Registered: an all_reduce of a tensor in a registered buffer (Ring::reg_alloc), read and written
// in every rank's copy directly; chosen by plan_of(), never forced.
// Copy: no kernel waits for another rank (ranks sharing a GPU without MPS take turns in time
// slices, so spinning kernels wait a slice per handshake): each piece of the data goes by
// cudaMemcpyAsync into every peer's inbox, ordered by stream memory operations on counters in
// host memory the group shares (cuStreamWriteValue64 / cuStreamWaitValue64, waited by the GPU's
// front end; CopyCtl),
// then a kernel that never waits folds the pieces in rank order (csrc/cuda/p2p_copy.cpp).
enum class Algo : uint8_t { Auto = 0, Ring = 1, OneShot = 2, TwoShot = 3, Registered = 4, Copy = 5 };
const char* algo_name(Algo a);
struct MsgHeader;
// "all_reduce(numel=..., dtype=..., op=...; algorithm)" for error messages.
std::string call_text(const MsgHeader& h);

struct alignas(kLine) Counter {
  uint64_t value;
};
// Every flag a rank polls lives in its own memory, written by the peer that moves data to it
// (push): a wait never reads another GPU's memory.
struct RingFlags {
  Counter posted;    // written by upstream: messages it has written into this rank's FIFO
  Counter credits;   // written by downstream: messages of this rank's it has consumed
  Counter sent;      // this rank's own counts, read at each launch (CUDA graph replays go on
  Counter received;  // from where the FIFO stands)
};
// One block's barrier words of the symmetric workspace algorithms (csrc/cuda/sym_kernel.cu).
struct SymFlags {
  Counter epoch;  // own: pieces run by this rank's blocks so far (every entry equal between calls)
  alignas(kLine) uint64_t arrived[kMaxPeers];  // [q]: written by rank q's block, the barrier it reached
};
// The copy algorithm's counters (Algo::Copy) and the group's abort word for it: one block in host
// memory every rank maps (POSIX shared memory registered with CUDA; Ring::copy_attach). The ranks'
// streams write the counters (cuStreamWriteValue64) and wait on them (cuStreamWaitValue64). Such a
// wait never times out, and a release written by a stream could queue behind the very wait it is
// to end (streams share the GPU's hardware queues), so the host's watchdog (Ring::copy_tick) and an
// abort release every wait with CPU stores of kReleased, after the abort word that says why; a
// stopping kernel does the same from the device. The driver compares cyclically
// ((int64_t)(*addr - value) >= 0 for GEQ), so kReleased is 2^62, which passes any count in use
// (all ones would pass none).
constexpr uint64_t kReleased = uint64_t{1} << 62;
struct CopyCtl {
  uint32_t abort;  // abort_word of the first stop seen by any rank's copy path (sticky)
  alignas(kLine) Counter arrived[kMaxPeers][kMaxPeers];  // [receiver][sender]: pieces sent
};
// Inbox slots per source. Two are enough, with no "slot free" count: a rank enqueues piece p + 1
// (its copies into the peers) after its fold of piece p, so when sender q copies piece p + 2 into
// slot p % 2 of receiver r, q's stream has waited for r's piece p + 1, which r sent after folding
// piece p: r has read that slot for the last time. One slot would not do (q waits for r's piece p,
// sent before r folds it).
constexpr int kCopyDepth = 2;
// The largest piece (one inbox slot): each piece costs a handshake, i.e. time slices without MPS.
constexpr size_t kDefaultCopySlotBytes = 8 << 20;

struct MsgHeader {
  uint64_t op_seq;
  int64_t numel;
  uint64_t nbytes;
  uint32_t index;  // message (ring) or round (direct) index within the call
  uint8_t coll, dtype;
  uint8_t op;  // RedOp in the low 4 bits, the call's Wire in the high 4 (a wire mismatch is a mismatch)
  uint8_t algo;
};

// The start of every rank's area; the ring's FIFO, the workspace and the copy inbox follow at
// data_offset().
struct alignas(kLine) Area {
  uint32_t abort;  // 0, or abort_word(cause, rank): why and where the group stopped (sticky)
  alignas(kLine) RingFlags ring[kMaxChannels];
  SymFlags sym[kMaxSymBlocks];
  MsgHeader ring_hdr[kMaxChannels][kSlots];                  // written with each message
  // [epoch parity][block][source]: the call of a piece, written by the source with its start barrier
  MsgHeader sym_hdr[2][kMaxSymBlocks][kMaxPeers];
  MsgHeader copy_hdr[kCopyDepth][kMaxPeers];  // [slot][source]: the piece each source copied there
};

// Why a wait ended without its message; packed with the rank that saw it first into abort words.
enum Cause : uint32_t { kOk = 0, kTimeout = 1, kMismatch = 2, kBadSize = 3, kHostAbort = 4 };
RR_HOST_DEVICE inline uint32_t abort_word(uint32_t cause, int rank) {
  return (cause << 24) | (static_cast<uint32_t>(rank + 1) & 0xffffffu);
}
RR_HOST_DEVICE inline uint32_t abort_cause(uint32_t w) { return w >> 24; }
RR_HOST_DEVICE inline int abort_rank(uint32_t w) { return static_cast<int>(w & 0xffffffu) - 1; }

// Written by the first block that stops, into host-mapped memory; `word` last.
struct ErrorRecord {
  uint32_t word;   // abort_word of the cause (its rank may be another one: propagated)
  uint32_t local;  // 1: this block saw the cause itself (timeout/mismatch/host abort here)
  int32_t peer;    // the rank waited on
  int32_t phase;   // 0 reduce-scatter, 1 all-gather (ring); 2 + barrier (symmetric workspace:
                   // 0 start, 1 middle, 2 end; copy: 2); -1 not started (stopped before the call)
  int32_t step;
  int32_t waiting_for_slot;  // 1: a free slot at downstream, 0: a message from a peer
  int64_t slice;
  MsgHeader mine;  // this rank's call
  MsgHeader got;   // the peer's header (mismatch, bad size)
};
// HostCtl::abort values: a host abort (stop, and tell every peer), or closed while a CUDA graph
// may replay our kernels (stop at once, write nothing into any peer: they may have freed their
// memory).
constexpr uint32_t kCtlAbort = 1;
constexpr uint32_t kCtlClosed = 2;
constexpr uint64_t kWireOverflowSlots = 1024;
struct HostCtl {
  uint32_t abort;  // set by the host: stop every wait of this rank's kernels (kCtlAbort, kCtlClosed)
  // Copy algorithm: where this rank's stream is, written by it (cuStreamWriteValue64) for the
  // watchdog: the call (op_seq) and piece (+1) it reached, and the pieces it finished.
  alignas(kLine) uint64_t copy_call;
  uint64_t copy_reached;
  uint64_t copy_done;
  // The narrow wire with fp16: [op_seq % kWireOverflowSlots] = op_seq of a call of which some rank
  // rounded a finite value beyond fp16's range (written by this rank's kernel, which learns every
  // rank's flags from the workspace: sym_wire.cu). Read by Ring::wire_overflowed, for as many calls
  // back as there are slots (async fp16 calls in flight beyond that could miss theirs).
  uint64_t wire_overflow[kWireOverflowSlots];
  alignas(kLine) ErrorRecord err[kMaxBlocks];  // by block index
};

// What every kernel of the transport reads: the group's areas and stop words, and the call.
struct KernelBase {
  Area* self;
  Area* peer[kMaxPeers];  // every rank's area by rank (null where not mapped)
  Area* up;               // ring neighbours' areas
  Area* down;
  HostCtl* ctl;
  CopyCtl* cctl;  // the group's copy counters as the device sees them (null: none)
  const void* in;
  void* out;
  int64_t numel;
  uint64_t op_seq;
  uint64_t timeout_ns;
  int rank, nranks, blocks, divisor;
  uint8_t coll, dtype, op, algo;
  uint8_t wire;  // Wire: the narrow wire's kernel (sym_wire.cu), else Wire::None
  // Launched into a CUDA graph capture: a replay may come after close(), so its start also reads
  // the host's abort word (across PCIe); a launch outside a capture reads the device word only.
  uint8_t graph;
};

// The ring's and the copy algorithm's kernel arguments.
struct Args : KernelBase {
  char* self_data;  // this rank's FIFO (ring) or inbox (copy)
  char* down_data;  // downstream's FIFO
  int64_t slice_elems;  // ring: slice
  int64_t steps;        // ring: slices per channel
  uint64_t slot_stride;
  // Copy: this piece's elements (from piece_begin of the span it cuts: the tensor for all_reduce,
  // a chunk for the others), its index in the call, and its inbox slot (slot_stride: bytes per slot).
  int64_t piece_begin, piece_count;
  uint32_t piece_index;
  int copy_slot;
};

// The symmetric workspace kernel's arguments (csrc/cuda/sym_kernel.cu): the call's tensor goes in
// pieces of at most chunk_elems elements (sym_piece()), each through one half of every rank's
// workspace; registered: the tensor lies in a buffer every rank maps (data[q]: rank q's copy at the
// tensor's offset), nothing is copied, one piece.
struct SymArgs : KernelBase {
  char* data[kMaxPeers];  // every rank's workspace (or registered copy), by rank
  uint64_t half_bytes;    // bytes between the workspace's two halves
  int64_t chunk_elems;    // elements per piece (all_reduce, all_gather: of the tensor / input;
                          // reduce_scatter: of each chunk, chunk_elems / n rounded down, >= 1)
  int64_t pieces;
  // Registered: (buffer index + 1) << 40 | the tensor's byte offset in it, carried in the headers'
  // nbytes, so that ranks whose tensors sit in other buffers or at other offsets stop with kBadSize.
  uint64_t reg_tag;
  uint64_t wire_span;     // the narrow wire: bytes of one wire span (wire_span_bytes(wire, chunk_elems / kWireBlock))
};
constexpr int kRegTagShift = 40;
// The narrow wire in a workspace half (sym_wire.cu): all_reduce keeps two spans per piece (every
// rank's input on the wire, and the chunk it reduced, rounded again), reduce_scatter one per chunk.
// A span of `cap` wire blocks: per kernel block a 4-byte count of fp16 overflows, then (fp8) a
// float scale per wire block, then the elements, each part on 16 bytes.
constexpr uint64_t kWireCountBytes = 4 * kMaxSymBlocks;
RR_HOST_DEVICE inline uint64_t wire_data_at(bool scaled, int64_t cap) {
  return kWireCountBytes + (scaled ? (4 * static_cast<uint64_t>(cap) + 15) / 16 * 16 : 0);
}
RR_HOST_DEVICE inline uint64_t wire_span_bytes(bool scaled, uint64_t elem_bytes, int64_t cap) {
  return (wire_data_at(scaled, cap) + static_cast<uint64_t>(cap) * kWireBlock * elem_bytes + 15) / 16 * 16;
}

// The transport choice: PCI bus id of the current device ("0000:17:00.0"), and whether the current
// device can map memory of the device with that bus id through CUDA IPC (the same device, or a peer
// in cudaDeviceCanAccessPeer's sense); why: the reason when it cannot.
std::string device_bus_id();
bool can_map(const std::string& bus_id, std::string* why);

// Launches the ring kernel with a.blocks blocks; torch-free (csrc/cuda/p2p_kernel.cu).
void launch(const Args& a, cudaStream_t stream);
// Launches the symmetric workspace kernel of a.algo (OneShot, TwoShot, Registered); torch-free
// (csrc/cuda/sym_kernel.cu).
void launch_sym(const SymArgs& a, cudaStream_t stream);
// The narrow wire (a.wire set): the symmetric workspace kernel that rounds every rank's input
// onto the wire and folds in fp32 (csrc/cuda/sym_wire.cu); launch_sym calls it. At world 1 no
// workspace: launch_wire_local rounds the tensor as a group of one would (all_reduce twice,
// reduce_scatter once) into c.out; an fp16 overflow writes op_seq into *overflow_seq (memory the
// device writes and the host reads: HostCtl::wire_overflow).
void launch_sym_wire(const SymArgs& a, cudaStream_t stream);
void launch_wire_local(const Call& c, uint64_t* overflow_seq, uint64_t op_seq, cudaStream_t stream);
// The copy algorithm's kernel for one piece (checks the headers, then folds or copies), with
// `blocks` blocks that never wait.
void launch_copy(const Args& a, int blocks, cudaStream_t stream);
// Blocks of that kernel for a piece of this many bytes.
int copy_blocks(int64_t piece_bytes);

inline size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
inline size_t slot_stride(size_t slice_bytes) { return round_up(slice_bytes + kVecBytes, kLine); }
inline size_t data_offset() { return round_up(sizeof(Area), 256); }

struct Options {
  int rank = 0;
  int nranks = 1;
  // Whether every rank will map every other (Ring::connect gets every handle) and the group has at
  // most kMaxPeers ranks: the symmetric workspace algorithms, and the workspace; else the ring
  // only. The same on every rank.
  bool direct = true;
  int channels = kDefaultChannels;  // the most ring channels a call uses
  size_t slice_bytes = kDefaultSliceBytes;  // the largest ring slice (a FIFO slot)
  // The largest piece of a symmetric workspace call (bytes per rank and half of the workspace).
  // Test knob: a tiny value makes many pieces (barriers, halves reused) per call.
  size_t chunk_bytes = kDefaultChunkBytes;
  // The most blocks one call's kernel may use: every block of every rank's kernel spins until its
  // peers' blocks run, so all must be resident at once. One block of these kernels fills an SM
  // (512 threads of up to 128 registers), so: the SM count over the ranks sharing a device, the
  // least over the group (the same on every rank: plans must agree). 0: unknown; Ring takes this
  // device's SM count (one rank per device).
  int max_blocks = 0;
  // The most blocks a workspace call uses below that cap (RINGREDUCE_CUDA_SYM_BLOCKS), 1 to
  // kMaxSymBlocks: what blocks buy at large sizes is the GPU's to say (BENCHMARKS.md section 17).
  int sym_blocks = kDefaultSymBlocks;
  // Test knob: every ring call uses exactly `channels` and `slice_bytes`, and every symmetric
  // workspace call min(channels, kMaxSymBlocks) blocks (no plan by size), so that tiny slices force
  // many pipeline steps at every size.
  bool exact = false;
  Algo algo = Algo::Auto;  // RINGREDUCE_CUDA_ALGO
  // Auto's threshold (bytes of the full tensor): one-shot up to oneshot_max (all_reduce), two-shot
  // above; used when `tuned` (0 then means never), else the model's (oneshot_max_bytes()). Set
  // from a table measured on a GPU (benchmarks/gpu_tune.py, ringreduce/gpu_tuning.json).
  bool tuned = false;
  size_t oneshot_max = 0;
  double timeout_s = 300.0;  // RINGREDUCE_TIMEOUT: per wait
  size_t copy_slot_bytes = kDefaultCopySlotBytes;  // RINGREDUCE_CUDA_COPY_BYTES: the largest piece
};

// How one call runs: the algorithm, its blocks, and its slice/piece size in elements.
struct Plan {
  Algo algo;
  int blocks;
  int64_t slice_elems;  // ring: slice; symmetric workspace: piece (SymArgs::chunk_elems); copy: piece
  int64_t steps;        // ring: slices per channel; symmetric workspace and copy: pieces
  int reg = -1;          // Registered: the buffer's index
  uint64_t reg_offset = 0;  // and the tensor's byte offset in it
};
// The same inputs give the same plan on every rank. direct: the symmetric workspace algorithms are
// possible (every rank maps every other, nranks <= kMaxPeers); where they are not, every call runs
// the ring. Auto: one-shot up to the threshold (all_reduce), else two-shot; the ring only when
// forced. Deterministic mode (ringreduce::deterministic()): an all_reduce or reduce_scatter never
// runs the ring (a forced ring runs as Auto); where the others are impossible (!direct) plan throws
// RingError saying why and what to use instead.
Plan plan(const Call& c, const Options& o, bool direct);
// Auto's one-shot threshold (bytes of the full tensor) from the alpha-beta model of
// benchmarks/gpu_cost.py (not from GPU timings): one-shot while its extra remote bytes, (n-1) x
// size against two-shot's 2(n-1)/n x size, cost less than the barrier it saves.
size_t oneshot_max_bytes(int nranks);

// One rank's side of the group, on the device current at construction.
class Ring {
 public:
  explicit Ring(const Options& opt);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // This rank's area as cudaIpcMemHandle_t bytes, for the other ranks ("" at world 1: no area).
  std::string handle() const;
  // Maps the other ranks' areas: handles[q] from handle() on rank q (this rank's own is ignored).
  // The neighbours' are required; with Options::direct every rank's (an empty string: not
  // mappable, an error then).
  void connect(const std::vector<std::string>& handles);
  // Native tests only: ranks as streams of one process, the others' areas used directly.
  void connect_local(const std::vector<const Ring*>& rings);
  // Enqueues one collective on stream (ordered after what is already there). Throws RingError when
  // the ring is broken, or when deterministic mode needs the symmetric workspace and the group
  // cannot run it (see plan()); a failure inside the kernel is seen later by failure().
  // Capture-safe (CUDA graphs): no host synchronisation, and the kernels take where each FIFO and
  // epoch counter stands from device memory, so a replayed launch continues where the group is.
  // plan: plan_of(c) if the caller has it already (the binding's flight recorder), else computed.
  void run(const Call& c, cudaStream_t stream, const Plan* plan = nullptr);
  // Native tests: launches call c's kernel again with the arguments run() gave it (after run()
  // counted the call), as a CUDA graph replays a captured launch. Ring and symmetric workspace.
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
  void reg_connect_local(int id, const std::vector<const Ring*>& rings);
  std::shared_ptr<char> reg_memory(int id) const;
  // This rank's tensor of buffer id is gone (no call of this rank uses it any more: a call holds
  // its tensor until it ends): unmaps the peers' copies and lets go of this one, which goes with
  // its last owner. Kept instead (until exit) while a CUDA graph may replay a launch on it, and
  // this rank's copy also once the ring broke (a peer's stopped call may still write into it).
  void reg_release(int id);
  int reg_count() const {
    std::lock_guard<std::mutex> lk(reg_mu_);
    return static_cast<int>(regs_.size());
  }
  // Auto's one-shot threshold (see Options); the same on every rank, before the first call.
  void set_threshold(size_t oneshot_max) {
    opt_.tuned = true;
    opt_.oneshot_max = oneshot_max;
  }
  // A workspace call's most blocks (Options::sym_blocks), measured for this device (the binding
  // reads ringreduce/gpu_tuning.json); the same on every rank, before the first call.
  void set_sym_blocks(int blocks);
  bool direct() const { return direct_; }
  // The first failure the device recorded, formatted, or "" while there is none.
  std::string failure();
  bool broken() { return !failure().empty(); }
  // The op_seq of the first call that failed, or 0: that call and every later one failed, every
  // earlier one completed. Final for a call once its kernel has finished.
  uint64_t failed_seq();
  uint64_t failed_seq_locked() const;  // under mu_
  // Stops this rank's running and future kernels and tells every mapped peer.
  void abort(const std::string& why);
  // Watches the processes of these peers (every 50 ms): a dead one aborts the ring with
  // "peer rank R (pid P) died", so no rank waits out its timeout for a killed one.
  void watch_peers(std::vector<host::Peer> peers);
  // Stops the peer watcher thread, nothing else (no CUDA call): for a ring left to the process's
  // exit while the interpreter finalizes.
  void stop_threads() {
    if (watcher_) watcher_->stop();
    if (copy_watch_) copy_watch_->stop();
  }
  // Whether this ring has the copy algorithm's inbox (RINGREDUCE_CUDA_ALGO=copy: opt-in, for ranks
  // sharing a GPU without MPS; auto does not pick it, no GPU has shown it faster yet).
  bool copies() const { return copy_bytes() > 0; }
  // The copy algorithm's counters (CopyCtl), shared by the group: rank 0 creates the POSIX shared
  // memory segment `name`, the others map it (after rank 0 made it); every rank registers it with
  // CUDA. The creator unlinks the name once all have mapped it. Before the first call.
  void copy_attach(const std::string& name, bool create);
  // Unmaps the peers and frees. Idempotent; no kernel of this ring may be running.
  // peers_done=false: a peer may still read or write this rank's area (the close barrier failed,
  // or the ring broke): the area is marked aborted, so their waits stop, and kept until the
  // process exits, since freeing it could hand memory they still use to another allocation.
  void close(bool peers_done = true);
  // The first half of a two-phase close: stops the watchers and unmaps the peers' areas and
  // shared buffers (no call may run after it). Freeing memory another process still maps is
  // undefined in CUDA, so every rank does this, then a barrier, then close(true) frees. False when
  // the mappings stay (a CUDA graph pins the ring, or pinned it at close: its launches were
  // captured with the peers' addresses): then no rank of the group may free its memory.
  bool unmap_peers();
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
  bool closed() const { return closed_; }
  bool unmapped() const { return unmapped_; }  // the first half of a close ran
  uint64_t op_seq() const { return op_seq_; }
  // Whether call `seq` (a narrow wire with fp16) rounded a finite value beyond fp16's range on
  // some rank: every rank learns it. Final once the call's kernel has finished; for the last
  // kWireOverflowSlots calls.
  bool wire_overflowed(uint64_t seq) const {
    return ctl_ && reinterpret_cast<volatile const uint64_t*>(ctl_->wire_overflow)[seq % kWireOverflowSlots] == seq;
  }
  // Which calls have finished on the device (the flight recorder reads it without blocking).
  CallLog& calls() { return calls_; }
  int device() const { return device_; }
  // Device memory this rank's communicator holds (its area: flags, the ring's FIFO where the ring
  // can run, the workspace where the symmetric algorithms can, the copy inbox where asked for);
  // 0 at world 1. Registered buffers are the user's and not counted.
  size_t area_bytes() const;

 private:
  std::string describe(const ErrorRecord& e, int block) const;
  // cause: what the abort word written into every area says (the peers' errors name it).
  void abort_locked(const std::string& why, uint32_t cause = kHostAbort);
  bool ring_fifo() const;     // whether the ring can run (its FIFO is allocated)
  size_t fifo_bytes() const;  // 0 where the ring cannot run (Options::direct, no forced ring)
  size_t ws_half_bytes() const;  // one half of the workspace; 0 without one
  size_t ws_offset() const { return data_offset() + fifo_bytes(); }
  size_t copy_bytes() const;  // the inbox: kCopyDepth x nranks slots; 0 without the copy algorithm
  size_t copy_offset() const { return ws_offset() + 2 * ws_half_bytes(); }

  // The copy algorithm (csrc/cuda/p2p_copy.cpp): enqueues call c's pieces on stream; and the
  // watchdog's look (every 50 ms) at where the stream stands: a piece waited on for longer than
  // the timeout fails the group (stream waits never time out), and a broken group's waits are
  // released while calls remain.
  void copy_check(cudaStream_t stream);  // throws where the copy algorithm cannot run
  void run_copy(const Call& c, const Plan& p, cudaStream_t stream);
  void copy_tick();
  // Every copy wait of the group released by CPU stores, after `word` (if not 0) became the
  // group's abort word.
  void release_copy_waits_locked(uint32_t word);

  Options opt_;
  int device_ = 0;
  int up_ = 0, down_ = 0;
  char* area_ = nullptr;  // own area (cudaMalloc)
  std::vector<char*> peers_;  // every rank's area by rank (own included; null: not mapped)
  bool ipc_ = false;  // peers_ are IPC mappings (closed on close())
  bool direct_ = false;
  bool closed_ = false;
  bool unmapped_ = false;  // unmap_peers() ran: the ring runs nothing more
  bool maps_kept_ = false;  // closed under a graph pin: the peers stay mapped until exit
  HostCtl* ctl_ = nullptr;  // host-mapped (cudaHostAlloc)
  HostCtl* ctl_dev_ = nullptr;  // the same memory as the device sees it
  uint32_t* abort_src_ = nullptr;  // pinned source of the abort word copied into the areas
  CopyCtl* cctl_ = nullptr;      // the group's copy counters (shared memory, registered)
  CopyCtl* cctl_dev_ = nullptr;  // the same as the device sees them
  cudaStream_t side_ = nullptr;  // for that copy, beside a kernel that may be spinning
  std::atomic<uint64_t> op_seq_{0};
  CallLog calls_;
  uint64_t abort_seq_ = 0;  // op_seq_ + 1 at a host abort: the first call it can affect
  uint64_t closed_failed_seq_ = 0;  // the device's first failed call, read at close (ctl_ is gone)
  // reason_ and failure_: abort() and failure() are called from other threads (Work.wait(),
  // Communicator.abort() hold the GIL) while run() calls failure() with the GIL released.
  std::mutex mu_;
  std::string reason_;  // why this rank aborted (host side)
  std::string failure_;
  std::shared_ptr<std::atomic<int>> pins_ = std::make_shared<std::atomic<int>>(0);  // graphs
  struct Reg {
    size_t bytes = 0;
    std::shared_ptr<char> own;  // cudaFree when the last owner (this ring, a tensor) lets go
    std::vector<char*> at;      // every rank's copy by rank (own included); null: not mapped yet
    bool mapped = false;        // every at[] is set: calls may use it
    bool ipc = false;           // at[] are IPC mappings (closed on close())
    bool kept = false;          // own is kept until exit (counted once in g_kept_bytes)
  };
  std::vector<Reg> regs_;
  mutable std::mutex reg_mu_;  // regs_: a buffer may be registered while another thread calls
  uint64_t pieces_ = 0;  // copy algorithm: pieces enqueued (the same count on every rank)
  struct CopyCall {
    MsgHeader call;
    uint64_t first_piece;
  };
  CopyCall copy_calls_[64] = {};  // the last calls run_copy enqueued, by op_seq % 64 (under mu_)
  struct Watch {  // copy_tick's state
    uint64_t reached = 0, done = 0;
    std::chrono::steady_clock::time_point since{};
  } watch_;
  std::unique_ptr<host::Ticker> copy_watch_;
  std::unique_ptr<host::Ticker> watcher_;  // declared last: stopped first
};

}  // namespace ringreduce::cuda::p2p
