// One transport interface under the binding: what the shared-memory (shm::Endpoint), CUDA IPC
// (cuda::p2p::Endpoint) and NCCL (cuda::nccl::Endpoint) transports each are to the communicator
// that drives them. The binding's communicators are written against it, with no branch on which
// transport it is: what differs is said by capabilities, not by type. Torch-free, CUDA-free.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ring/call.h"
#include "runtime/peers.h"

namespace ringreduce::runtime {

// What a transport can do; the communicator's policy follows these, never the transport's type.
struct Caps {
  // A device transport: run() enqueues on a CUDA stream and returns; a host one runs the call
  // on the calling thread and returns when it is done.
  bool device = false;
  // A synchronous call may run straight on the caller's stream (no event pair, no stream of ours).
  bool on_caller_stream = false;
  // run() may be captured into a CUDA graph (its replays continue where the group stands).
  bool capture_safe = false;
  // Runs calls with a narrow wire (Call::wire): all_reduce, and reduce_scatter unless
  // wire_reduce_scatter is false; float16's wire unless wire_f16 is false. Read by the one wire
  // check (wire_refusal below; the binding calls it).
  bool wire = false;
  bool wire_reduce_scatter = true;
  bool wire_f16 = true;
  // Closes in two phases (unmap_peers, a barrier, close(true)): peers map this rank's memory.
  bool two_phase_close = false;
  // poll() looks for failures that arrive apart from the calls (NCCL's asynchronous errors).
  bool polls = false;
  // run() may wait on the host until its work is enqueued (NCCL's non-blocking group settling):
  // the caller lets other threads run meanwhile (the binding releases the GIL).
  bool run_waits = false;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;  // "shm", "p2p", "nccl": for messages
  virtual Caps caps() const = 0;
  virtual int nranks() const = 0;
  // How c will run (the same on every rank for the same call): the caller plans each call once
  // (its recorder names the algorithm; an in-place plan makes it hold the tensors) and passes the
  // plan to run(). May throw where the call cannot run (a deterministic call the group cannot run).
  virtual Plan plan(const Call& c) = 0;
  // Runs call c by plan p (plan(c)'s): enqueued on `stream` (a cudaStream_t) by a device
  // transport, run on this thread by a host one (stream ignored). Throws RingError when the
  // transport is broken or closed, or the call cannot run; a failure a device meets later is seen
  // by failure().
  virtual void run(const Call& c, const Plan& p, void* stream) = 0;
  // Plans and runs c (transports that call one another, tests).
  void run(const Call& c, void* stream) { run(c, plan(c), stream); }
  // The transport that serves this host's ranks: itself, or (two-level) the one inside the host;
  // what the binding reaches for a transport's own methods.
  virtual Transport& local() { return *this; }
  // The first failure, or "" while there is none.
  virtual std::string failure() = 0;
  // The op_seq of the first call that failed, or 0: it and every later call failed.
  virtual uint64_t failed_seq() = 0;
  virtual void poll() {}
  // Stops this rank's running and future calls and tells the peers (every rank then raises).
  virtual void abort(const std::string& why) = 0;
  // Watches these peers' processes: a dead one fails the group within a fraction of a second.
  virtual void watch_peers(std::vector<Peer> peers) = 0;
  // Stops the transport's own threads, nothing else: for one left to the process's exit.
  virtual void stop_threads() {}
  // The first half of a two-phase close (Caps::two_phase_close); false: the peers' mappings stay.
  virtual bool unmap_peers() { return true; }
  // Frees what the transport holds; idempotent; no call may be running. peers_done: every rank
  // has stopped using this rank's memory (else what they may still touch is kept until exit).
  virtual void close(bool peers_done) = 0;
  virtual bool closed() const = 0;
  // Whether a new call may start (a two-phase close's first half refuses them).
  virtual bool open() const { return !closed(); }
  virtual uint64_t op_seq() const = 0;
  // A device transport's view of where call seq stands (the flight recorder's device probe): 0
  // unknown, 1 pending, 2 done (*done_ns: when, steady clock). log_calls(on) starts recording.
  virtual int call_state(uint64_t /*seq*/, int64_t* /*done_ns*/) { return 0; }
  virtual void log_calls(bool /*on*/) {}
  // Something the caller should be told once (p2p: why a tensor could not be imported), or "".
  virtual std::string take_note() { return {}; }
  // A capture-safe transport's hold on the memory that a CUDA graph's captured launches use,
  // taken at capture and released by release(arg) (no CUDA call) when CUDA destroys the graph.
  struct Pin {
    void* arg = nullptr;
    void (*release)(void*) = nullptr;
  };
  virtual Pin capture_pin() { return {}; }
};

// Why a transport with caps k (named transport) cannot run coll on wire w, or "" when it can (or w
// is Wire::None). The one wire check: what a wire takes (dtype, op) is ring/types.h's wire_takes,
// checked by the binding (binding/torch_types.h: to_wire); what a transport's wire runs, here.
inline std::string wire_refusal(const Caps& k, const char* transport, Coll coll, Wire w) {
  if (w == Wire::None) return "";
  if (k.wire && (coll != Coll::ReduceScatter || k.wire_reduce_scatter) && (w != Wire::F16 || k.wire_f16))
    return "";
  const std::string head = std::string("wire_dtype=") + wire_name(w) + " in " + coll_name(coll) +
                           " does not run on the " + transport + " transport";
  if (!k.wire)
    return head + " (a narrow wire runs on shared memory, on the p2p transport where every GPU maps "
                  "its peers' memory, and across hosts: RINGREDUCE_TRANSPORT=p2p or hier)";
  return head + ": its wire runs " + (k.wire_reduce_scatter ? "all_reduce and reduce_scatter" : "all_reduce") +
         (k.wire_f16 ? "" : " on a bfloat16 or float8 wire (float16's overflow check is not built there)");
}
// The same, thrown (std::invalid_argument): for a transport's run(), whose caller may not have
// asked (the binding asks first and raises NotImplementedError).
inline void check_wire(const Caps& k, const char* transport, const Call& c) {
  const std::string why = wire_refusal(k, transport, c.coll, c.wire);
  if (!why.empty()) throw std::invalid_argument("ringreduce: " + why);
}

// Why a transport (named) that is not capture-safe (Caps::capture_safe) refuses a call captured
// into a CUDA graph: the one message (the binding refuses before the capture sees our stream).
inline std::string capture_refusal(const char* transport) {
  return std::string("ringreduce: the ") + transport + " transport cannot run inside a CUDA graph "
         "capture; use RINGREDUCE_TRANSPORT=p2p (capture-safe) or call the collective outside the capture";
}

// The check every transport makes before a call, written once: a broken transport refuses
// (failure: its failure(), "" when none). What the binding checks (the tensors: dtype, sizes, a
// multiple of the world) is not checked again here; nranks is unused.
inline std::string broken_message(const std::string& failure) {
  return "ringreduce: communicator is broken by an earlier failure: " + failure;
}
inline void check_call(const Call& /*c*/, int /*nranks*/, const std::string& failure) {
  if (!failure.empty()) throw RingError(broken_message(failure));
}

}  // namespace ringreduce::runtime
