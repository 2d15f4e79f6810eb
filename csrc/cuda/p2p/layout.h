// The p2p transport's device layout: what every rank's area holds (flags, headers, the FIFO, the
// workspace, the copy inbox), the host-mapped control block, the abort words and the kernels'
// arguments. Shared by the host endpoint (endpoint.h) and the kernels (device.cuh); no CUDA API, no host
// class, torch-free.
#pragma once
#include <cstddef>
#include <cstdint>

#include "ring/call.h"
#include "ring/schedule.h"  // RR_HOST_DEVICE

namespace ringreduce::cuda::p2p {

// Same FIFO depth, and the same reason for it, as the shared-memory ring.
constexpr int kSlots = ring::kSlots;
// Endpoint channels (one thread block each, over disjoint parts of every chunk): at most this many, and
// by default at most 16 (NCCL's ring channel counts on NVLink machines are 16-32 on A100/H100; not
// measured for ours). The count used per call comes from plan().
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
// The LL one-shot (ll_kernel.cu): a block per this many bytes of the tensor (16 per thread).
constexpr size_t kLLBytesPerBlock = 8 << 10;
// An LL slot: the call's header (a MsgHeader, 8 data words), then the data, each 4-byte data word
// stored whole with the call's flag beside it (one 8-byte word: single-copy atomic on the GPU),
// so that the word itself says it arrived. Two slots per source, by the parity of the LL call's
// count k (SymFlags::ll: LL calls only, so other algorithms' epochs between two LL calls do not
// age the words).
constexpr int kLLHeaderWords = 8;
RR_HOST_DEVICE inline uint64_t ll_word(uint32_t data, uint32_t flag) {
  return static_cast<uint64_t>(data) | static_cast<uint64_t>(flag) << 32;
}
// The flag of LL call k (k >= 1): odd, so never the 0 of a word not yet written, and different
// for any two calls of one slot fewer than 2^32 calls apart. An older word cannot be in a slot:
// ll_wipes. (A flag that is the epoch cut to 32 bits matches a word written 2^32 calls earlier,
// and a zero word at every multiple of 2^32: a stale fold, silently wrong. NCCL's LL cleans its
// buffers before its flags wrap for the same reason.)
RR_HOST_DEVICE inline uint32_t ll_flag(uint64_t k) { return static_cast<uint32_t>(k) | 1u; }
// Whether LL call k first zeroes the other slot of every source (parity (k & 1) ^ 1). That slot
// is idle then: this rank's call k - 1 has read it, and no peer writes it for call k + 1 before
// it has this call's header, posted after the wipe. Each slot is wiped once every 2^30 LL calls
// (at k = 0 or 1 modulo 2^30), far within 2^32; the cost is one pass over the slots then.
constexpr uint64_t kLLWipeMask = (uint64_t{1} << 30) - 1;
RR_HOST_DEVICE inline bool ll_wipes(uint64_t k) { return (k & kLLWipeMask) < 2; }
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

// The algorithms this transport runs (Algo, ring/call.h): Endpoint, OneShot, TwoShot (the
// symmetric workspace), and
// Registered: an all_reduce of a tensor in a registered buffer (Endpoint::reg_alloc), read and written
// in every rank's copy directly; chosen by plan_of(), never forced.
// Copy: no kernel waits for another rank (ranks sharing a GPU without MPS take turns in time
// slices, so spinning kernels wait a slice per handshake): each piece of the data goes by
// cudaMemcpyAsync into every peer's inbox, ordered by stream memory operations on counters in
// host memory the group shares (cuStreamWriteValue64 / cuStreamWaitValue64, waited by the GPU's
// front end; CopyCtl),
// then a kernel that never waits folds the pieces in rank order (cuda/p2p/copy.cpp).
// Imported: an all_reduce in place of an ordinary tensor (the caller's allocation, shared with the
// peers by its IPC handle once: csrc/cuda/p2p/imports.cpp). Each rank names its memory by a tag
// (its export id and the offset) and passes the peers' memory it predicts from the call before;
// the start barrier compares: every rank's prediction right, the registered kernel runs on that
// memory, else (on every rank alike) two-shot through the workspace after it.

using ringreduce::Algo;
using ringreduce::algo_name;

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
// One block's barrier words of the symmetric workspace algorithms (csrc/cuda/p2p/sym_kernel.cu).
struct SymFlags {
  Counter epoch;  // own: pieces run by this rank's blocks so far (every entry equal between calls)
  Counter ll;     // own: LL calls run so far (every entry equal between calls; ll_flag)
  alignas(kLine) uint64_t arrived[kMaxPeers];  // [q]: written by rank q's block, the barrier it reached
};
// The copy algorithm's counters (Algo::Copy) and the group's abort word for it: one block in host
// memory every rank maps (POSIX shared memory registered with CUDA; Endpoint::copy_attach). The ranks'
// streams write the counters (cuStreamWriteValue64) and wait on them (cuStreamWaitValue64). Such a
// wait never times out, and a release written by a stream could queue behind the very wait it is
// to end (streams share the GPU's hardware queues), so the host's watchdog (Endpoint::copy_tick) and an
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
  // A captured launch's copy of the host's HostCtl::abort, made by a copy captured just before the
  // kernel (Endpoint::copy_host_abort): one transfer per replay, read by every block in device
  // memory, where each block once read the host's word across PCIe.
  uint32_t host_abort;
  alignas(kLine) RingFlags ring[kMaxChannels];
  SymFlags sym[kMaxSymBlocks];
  MsgHeader ring_hdr[kMaxChannels][kSlots];                  // written with each message
  // [epoch parity][block][source]: the call of a piece, written by the source with its start barrier
  MsgHeader sym_hdr[2][kMaxSymBlocks][kMaxPeers];
  MsgHeader copy_hdr[kCopyDepth][kMaxPeers];  // [slot][source]: the piece each source copied there
  // [epoch parity][block][source]: Imported's tag and prediction hash, written with the header
  alignas(16) uint64_t sym_tag[2][kMaxSymBlocks][kMaxPeers][2];
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
constexpr uint64_t kSeenSlots = 64;
struct HostCtl {
  uint32_t abort;  // set by the host: stop every wait of this rank's kernels (kCtlAbort, kCtlClosed)
  // Copy algorithm: where this rank's stream is, written by it (cuStreamWriteValue64) for the
  // watchdog: the call (op_seq) and piece (+1) it reached, and the pieces it finished.
  alignas(kLine) uint64_t copy_call;
  uint64_t copy_reached;
  uint64_t copy_done;
  // The narrow wire with fp16: [op_seq % kWireOverflowSlots] = op_seq of a call of which some rank
  // rounded a finite value beyond fp16's range (written by this rank's kernel, which learns every
  // rank's flags from the workspace: sym_wire.cu). Read by Endpoint::wire_overflowed, for as many calls
  // back as there are slots (async fp16 calls in flight beyond that could miss theirs).
  uint64_t wire_overflow[kWireOverflowSlots];
  alignas(kLine) ErrorRecord err[kMaxBlocks];  // by block index
  // Imported calls: [op_seq % kSeenSlots] what the start barrier saw, every rank's tag (written by
  // block 0, `seq` last), from which the host predicts the peers' memory of the next call on the
  // same memory (Endpoint::learn).
  struct Seen {
    uint64_t seq;
    uint64_t in_place;  // 1: the call ran in place
    uint64_t tags[kMaxPeers];
  } seen[kSeenSlots];
};
// An Imported tag: the export id (1, 2, ... per rank) << kTagShift | the byte offset in the export.
constexpr int kTagShift = 40;
// Every rank's tags, in rank order, as one word: two ranks' predictions (each its own tag and the
// peers' it predicts) agree when these do. Never 0 (0: no prediction).
RR_HOST_DEVICE inline uint64_t tags_hash(const uint64_t* tags, int n) {
  uint64_t h = 0x9e3779b97f4a7c15ull;
  for (int q = 0; q < n; ++q) {
    h ^= tags[q] + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 31;
  }
  return h ? h : 1;
}

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

// The symmetric workspace kernel's arguments (csrc/cuda/p2p/sym_kernel.cu): the call's tensor goes in
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
  uint64_t wire_span;     // the narrow wire: bytes of one wire span (workspace_wire_bytes(scaled, bytes, chunk_elems / kWireBlock))
  // Imported: this rank's tag, the hash of its prediction (0: none), and the predicted memory of
  // every rank at the call's tensor (this rank's: a.in).
  uint64_t tag, tag_hash;
  char* imp[kMaxPeers];
  // LL: the byte offset of the LL slots in every rank's area, and of one slot to the next
  // (slot (parity, source) at ll_at + (parity * nranks + source) * ll_slot).
  uint64_t ll_at, ll_slot;
};
constexpr int kRegTagShift = 40;
// The narrow wire in a workspace half (sym_wire.cu): all_reduce keeps two spans per piece (every
// rank's input on the wire, and the chunk it reduced, rounded again), reduce_scatter one per chunk.
// A span of `cap` wire blocks in the workspace: per kernel block a 4-byte count of fp16 overflows,
// then (fp8) a float scale per wire block, then the elements, each part on 16 bytes. (Not
// ring/types.h's wire_span_bytes, the bytes of n elements on the wire, which a slot holds.)
constexpr uint64_t kWireCountBytes = 4 * kMaxSymBlocks;
RR_HOST_DEVICE inline uint64_t wire_data_at(bool scaled, int64_t cap) {
  return kWireCountBytes + (scaled ? (4 * static_cast<uint64_t>(cap) + 15) / 16 * 16 : 0);
}
RR_HOST_DEVICE inline uint64_t workspace_wire_bytes(bool scaled, uint64_t elem_bytes, int64_t cap) {
  return (wire_data_at(scaled, cap) + static_cast<uint64_t>(cap) * kWireBlock * elem_bytes + 15) / 16 * 16;
}

// Imported memory's handles, in host memory every rank of a direct group maps (POSIX shared
// memory; Endpoint::board_attach): each rank's exports by id % kBoardSlots, and the release
// handshake: an owner whose memory is going clears the entry, counts it in `kills`, and waits until
// every peer's reaper has closed what it mapped of it and copied that count into `reaped`.
constexpr int kBoardSlots = 256;
struct BoardEntry {
  uint64_t id;     // 0: free; written last (release), cleared first
  uint64_t bytes;  // of the allocation
  char handle[64];  // its cudaIpcMemHandle_t
};
struct RegBoard {
  BoardEntry exp[kMaxPeers][kBoardSlots];  // [owner][id % kBoardSlots]
  alignas(kLine) uint64_t kills[kMaxPeers];  // [owner]: exports withdrawn so far
  alignas(kLine) uint64_t reaped[kMaxPeers][kMaxPeers];  // [importer][owner]: kills seen and closed
};

inline size_t slot_stride(size_t slice_bytes) { return round_up(slice_bytes + kVecBytes, kLine); }
inline size_t data_offset() { return round_up(sizeof(Area), 256); }

}  // namespace ringreduce::cuda::p2p
