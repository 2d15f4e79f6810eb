// The vocabulary every transport shares: which collective a call is, the call itself, and the error
// a failed call raises. Header-only; no memory, threads or torch.
#pragma once
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "ring/types.h"

namespace ringreduce {

// Timeouts, dead peers, mismatched calls. Reaches Python as ringreduce.RingReduceError.
struct RingError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// The one "closed" error, whoever meets the closed communicator (a transport, a communicator, an
// executor): a RingError, so Python raises RingReduceError.
constexpr const char* kClosedMessage = "ringreduce: communicator is closed";
inline RingError closed_error() { return RingError(kClosedMessage); }

enum class Coll : uint8_t { AllReduce = 0, ReduceScatter, AllGather };

inline const char* coll_name(Coll c) {
  switch (c) {
    case Coll::AllReduce: return "all_reduce";
    case Coll::ReduceScatter: return "reduce_scatter";
    case Coll::AllGather: return "all_gather";
  }
  return "unknown";
}

// Which algorithm a call runs; each transport runs a subset (shm: ring, oneshot, twoshot, cma,
// pool, wire; p2p: ring, oneshot, twoshot, registered, copy, imported, ll; nccl: ring, oneshot,
// twoshot; hier: two-level). Values are part of the message headers.
enum class Algo : uint8_t {
  Auto = 0, Ring, OneShot, TwoShot, Cma, Pool, Wire, Registered, Copy, Imported, LL, TwoLevel, kCount
};

inline const char* algo_name(Algo a);
// "a, b, c": the names of algos, for messages.
template <size_t N>
std::string algo_names(const Algo (&algos)[N]) {
  std::string names;
  for (Algo a : algos) names += (names.empty() ? "" : ", ") + std::string(algo_name(a));
  return names;
}

inline const char* algo_name(Algo a) {
  static const char* const names[] = {"auto", "ring", "oneshot", "twoshot", "cma", "pool",
                                      "wire", "registered", "copy", "imported", "ll", "two-level"};
  return a < Algo::kCount ? names[static_cast<int>(a)] : "unknown";
}

// RINGREDUCE_DETERMINISTIC=1 / rr.set_deterministic(True): every all_reduce and reduce_scatter of
// every transport reduces each element in rank order, ((x0 op x1) op x2) ..., in the dtype's
// accumulation type (fp16/bf16: fp32), rounded once: the same bits whatever the size, slicing or
// algorithm. Process-wide, and a bit of every Call (Call::deterministic, the mode when the call
// was made): the planners read the call's bit, never this flag.
inline std::atomic<bool>& deterministic_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}
inline bool deterministic() { return deterministic_flag().load(std::memory_order_relaxed); }
inline void set_deterministic(bool on) { deterministic_flag().store(on, std::memory_order_relaxed); }

struct Call {
  Coll coll;
  DType dtype;
  RedOp op;
  int64_t numel;  // elements of the full tensor: all-reduce's tensor, reduce-scatter's input,
                  // all-gather's output (numel / nranks per rank for the latter two)
  const void* in;
  void* out;
  Wire wire = Wire::None;  // all-reduce / reduce-scatter of floats over a narrow wire (ring/types.h)
  // Who owns in's memory, opaque (the binding: the tensor's c10::StorageImpl), for a transport that
  // shares that memory with its peers and must keep it from being freed meanwhile (p2p's imports).
  const void* owner = nullptr;
  // Reduce in rank order (deterministic mode): the process's mode when the call is made (the
  // binding's calls and the tests' alike); a transport's own sub-calls copy their call's.
  bool deterministic = ringreduce::deterministic();
  // The call's stream is capturing a CUDA graph: asked of CUDA once, by the binding (the one that
  // refuses what a capture cannot hold); the transports read it (a transport's native callers
  // never capture).
  bool captured = false;
};

// A transport's own sub-call of c (hier's steps): c's mode bits, the rest as given.
inline Call sub_call(const Call& c, Coll coll, DType dtype, RedOp op, int64_t numel, const void* in, void* out) {
  Call s{coll, dtype, op, numel, in, out};
  s.deterministic = c.deterministic;
  s.captured = c.captured;
  return s;
}

// How one call runs, as its transport planned it (Transport::plan; the same on every rank for the
// same call), taken by Transport::run. algo names it (the flight recorder's column); in_place: it
// reads the peers' tensors where they lie, so the caller holds the tensors' memory until the call
// ends (their release unmaps what the peers' kernels read). The rest is the transport's own (p2p:
// blocks, the slice or piece in elements, slices or pieces, the registered buffer and offset).
struct Plan {
  Algo algo = Algo::Auto;
  int blocks = 1;
  int64_t slice_elems = 1;
  int64_t steps = 1;
  int reg = -1;
  uint64_t reg_offset = 0;
  bool in_place = false;
};

namespace ring {
// FIFO depth per rank of the flag protocol (shared memory and CUDA IPC). Any depth >= 3 cannot
// deadlock (a rank's sends lead its receives by at most two messages); 8 is NCCL's NCCL_STEPS and
// keeps the pipeline full when ranks are descheduled.
constexpr int kSlots = 8;
}  // namespace ring

}  // namespace ringreduce
