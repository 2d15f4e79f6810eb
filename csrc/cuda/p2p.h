// The ring protocol of csrc/shm/protocol.h on GPU memory shared by CUDA IPC: each rank owns, per
// channel, a FIFO of kSlots message slots and two counters (posted, consumed) in its own cudaMalloc'ed
// area; its downstream neighbour reads the slots and the posted counter through an IPC mapping, its
// upstream neighbour reads the consumed counter. Every message carries the call's header, checked
// before the data is touched. Waits poll a host-mapped abort flag, the neighbours' abort words and a
// deadline (%globaltimer): nothing spins forever. Torch-free.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "host/peers.h"

#include "ring/schedule.h"
#include "ring/call.h"

namespace ringreduce::cuda::p2p {

// Same FIFO depth, and the same reason for it, as the shared-memory ring.
constexpr int kSlots = ring::kSlots;
// Channels (one thread block each, over disjoint parts of every chunk). 16 is a guess from NCCL's
// ring channel counts on NVLink machines (16-32 on A100/H100); not measured here (no GPU).
constexpr int kDefaultChannels = 16;
constexpr int kMaxChannels = 32;
// Slice (message) size: the shared-memory ring's default; each block moves it with 512 x 16 B
// vectors in 16 rounds. Not measured on a GPU yet.
constexpr size_t kDefaultSliceBytes = 128 << 10;
// Slot data starts at the slice's byte offset mod 16 in the tensor, so that a 16-byte aligned tensor
// and the slot have the same alignment and the vector path applies; a slot is this much larger.
constexpr size_t kVecBytes = 16;
// Flags sit on their own 128-byte line (the L2 line size of NVIDIA GPUs).
constexpr size_t kLine = 128;

struct alignas(kLine) Counter {
  uint64_t value;
};
struct ChannelFlags {
  Counter posted;    // messages this rank has written into its own slots
  Counter consumed;  // messages this rank has consumed from its upstream neighbour's slots
};
struct MsgHeader {
  uint64_t op_seq;
  int64_t numel;
  uint64_t nbytes;
  uint32_t index;  // message index within the call
  uint8_t coll, dtype, op, pad;
};

// The start of every rank's area; slot data follows at data_offset().
struct alignas(kLine) Area {
  uint32_t abort;  // 0, or abort_word(cause, rank): why and where the group stopped (sticky)
  alignas(kLine) ChannelFlags ch[kMaxChannels];
  MsgHeader hdr[kMaxChannels][kSlots];
};

// Why a wait ended without its message; packed with the rank that saw it first into abort words.
enum Cause : uint32_t { kOk = 0, kTimeout = 1, kMismatch = 2, kBadSize = 3, kHostAbort = 4 };
RR_HOST_DEVICE inline uint32_t abort_word(uint32_t cause, int rank) {
  return (cause << 24) | (static_cast<uint32_t>(rank + 1) & 0xffffffu);
}
RR_HOST_DEVICE inline uint32_t abort_cause(uint32_t w) { return w >> 24; }
RR_HOST_DEVICE inline int abort_rank(uint32_t w) { return static_cast<int>(w & 0xffffffu) - 1; }

// Written by the first block of a channel that stops, into host-mapped memory; `word` last.
struct ErrorRecord {
  uint32_t word;   // abort_word of the cause (its rank may be another one: propagated)
  uint32_t local;  // 1: this block saw the cause itself (timeout/mismatch/host abort here)
  int32_t peer;    // the neighbour waited on
  int32_t phase;   // 0 reduce-scatter, 1 all-gather, -1 not started (stopped before the call)
  int32_t step;
  int32_t waiting_for_slot;  // 1: a free slot at downstream, 0: a message from upstream
  int64_t slice;
  MsgHeader mine;  // this rank's call
  MsgHeader got;   // the upstream header (mismatch, bad size)
};
struct HostCtl {
  uint32_t abort;  // set by the host: stop every wait of this rank's kernels
  alignas(kLine) ErrorRecord err[kMaxChannels];
};

struct RingArgs {
  Area* self;
  const Area* up;
  const Area* down;
  char* self_data;
  const char* up_data;
  HostCtl* ctl;
  const void* in;
  void* out;
  int64_t numel;
  int64_t slice_elems;
  int64_t num_slices;
  uint64_t op_seq;
  uint64_t timeout_ns;
  uint64_t slot_stride;
  int rank, nranks, nch, divisor;
  uint8_t coll, dtype, op;
};

// The transport choice: PCI bus id of the current device ("0000:17:00.0"), and whether the current
// device can map memory of the device with that bus id through CUDA IPC (the same device, or a peer
// in cudaDeviceCanAccessPeer's sense); why: the reason when it cannot.
std::string device_bus_id();
bool can_map(const std::string& bus_id, std::string* why);

// One block per channel; torch-free launcher (csrc/cuda/p2p_kernel.cu).
void launch_ring(const RingArgs& a, cudaStream_t stream);

inline size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
inline size_t slot_stride(size_t slice_bytes) { return round_up(slice_bytes + kVecBytes, kLine); }
inline size_t data_offset() { return round_up(sizeof(Area), 256); }
inline size_t area_bytes(int nch, size_t slice_bytes) {
  return data_offset() + static_cast<size_t>(nch) * kSlots * slot_stride(slice_bytes);
}
// Slices per channel: every channel uses the count of the largest channel part of any chunk.
inline int64_t slices_per_channel(Coll c, int64_t numel, int n, int nch, int64_t slice_elems) {
  const int64_t max_chunk = c == Coll::AllReduce ? (numel + n - 1) / n : numel / n;
  return ring::num_slices((max_chunk + nch - 1) / nch, slice_elems);
}

struct Options {
  int rank = 0;
  int nranks = 1;
  int channels = kDefaultChannels;
  size_t slice_bytes = kDefaultSliceBytes;
  double timeout_s = 300.0;  // RINGREDUCE_TIMEOUT: per wait
};

// One rank's side of the ring, on the device current at construction.
class Ring {
 public:
  explicit Ring(const Options& opt);
  ~Ring();
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;

  // This rank's area as cudaIpcMemHandle_t bytes, for the other ranks.
  std::string handle() const;
  // Maps the neighbours' areas (handles from handle() on ranks rank-1 and rank+1).
  void connect(const std::string& up_handle, const std::string& down_handle);
  // Native tests only: ranks as streams of one process, neighbours' areas used directly.
  void connect_local(const Ring& up, const Ring& down);
  // Enqueues one collective on stream (ordered after what is already there). Throws RingError when
  // the ring is broken; a failure inside the kernel is seen later by failure(). Capture-safe (CUDA
  // graphs): no host synchronisation, and the kernel takes where each channel's FIFO stands from
  // the ring's own counters in device memory, so a replayed launch continues where the ring is.
  void run(const Call& c, cudaStream_t stream);
  // The kernel arguments of call c as run() launches them (after run() counted the call): a CUDA
  // graph replays exactly these; the native tests launch them again to play a replay.
  RingArgs args(const Call& c) const;
  // The first failure the device recorded, formatted, or "" while there is none.
  std::string failure();
  bool broken() { return !failure().empty(); }
  // The op_seq of the first call that failed, or 0: that call and every later one failed, every
  // earlier one completed. Final for a call once its kernel has finished.
  uint64_t failed_seq();
  // Stops this rank's running and future kernels; neighbours stop when they next wait on it.
  void abort(const std::string& why);
  // Watches the processes of these peers (every 50 ms): a dead one aborts the ring with
  // "peer rank R (pid P) died", so no rank waits out its timeout for a killed one.
  void watch_peers(std::vector<host::Peer> peers);
  // Unmaps the neighbours and frees. Idempotent; no kernel of this ring may be running.
  // peers_done=false: a neighbour may still read this rank's area (the close barrier failed, or the
  // ring broke): the area is marked aborted, so their waits stop, and kept until the process exits,
  // since freeing it could hand memory they still read to another allocation.
  void close(bool peers_done = true);
  // Areas kept by close(false) in this process (bytes), for tests and logs.
  static size_t kept_bytes();
  bool closed() const { return area_ == nullptr; }
  uint64_t op_seq() const { return op_seq_; }
  int device() const { return device_; }

 private:
  std::string describe(const ErrorRecord& e, int channel) const;
  void abort_locked(const std::string& why);

  Options opt_;
  int device_ = 0;
  int up_ = 0, down_ = 0;
  char* area_ = nullptr;  // own area (cudaMalloc)
  char* up_area_ = nullptr;
  char* down_area_ = nullptr;
  bool ipc_ = false;  // the neighbours' areas are IPC mappings (closed on close())
  HostCtl* ctl_ = nullptr;  // host-mapped (cudaHostAlloc)
  HostCtl* ctl_dev_ = nullptr;  // the same memory as the device sees it
  uint32_t* abort_src_ = nullptr;  // pinned source of the abort word copied into the own area
  cudaStream_t side_ = nullptr;  // for that copy, beside a kernel that may be spinning
  std::atomic<uint64_t> op_seq_{0};
  uint64_t abort_seq_ = 0;  // op_seq_ + 1 at a host abort: the first call it can affect
  // reason_ and failure_: abort() and failure() are called from other threads (Work.wait(),
  // Communicator.abort() hold the GIL) while run() calls failure() with the GIL released.
  std::mutex mu_;
  std::string reason_;  // why this rank aborted (host side)
  std::string failure_;
  std::unique_ptr<host::Ticker> watcher_;  // declared last: stopped first
};

}  // namespace ringreduce::cuda::p2p
