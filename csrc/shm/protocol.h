// The ring protocol over memory every rank can read: each rank owns a FIFO of message slots and two
// counters; a step is "wait for the upstream neighbour's message, reduce or copy it, post my own".
// It runs on any shared mapping (processes over POSIX shared memory, or threads in the native tests).
// The Protocol is the front over its parts, each owning its state: Waits (every wait, the abort and
// the first failure: waits.h), Mailbox (the messages on the slots: mailbox.h), Writer (how data
// other ranks read is stored), and the algorithms written against them (algorithms.h). The
// segment's layout is segment.h; the options options.h.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ring/call.h"
#include "shm/algorithms.h"
#include "shm/mailbox.h"
#include "shm/options.h"
#include "shm/segment.h"
#include "shm/waits.h"

namespace ringreduce {
namespace shm {

class Protocol {
 public:
  Protocol(void* base, size_t bytes, const Options& opt);
  // Runs one collective. Throws RingError on timeout, dead peer, mismatch or abort; after that the
  // ring is broken and every later call throws at once. interrupted (optional) is polled while
  // waiting, every 50 ms: true aborts the group (the binding uses it for Ctrl-C).
  // algo: choose(c, pool), planned once by the caller (who records it). pool: the call's tensor
  // lies in a pool buffer (all-reduce in place).
  void run(const Call& c, Algo algo, const std::function<bool()>* interrupted = nullptr,
           const Pool* pool = nullptr);
  // The same, planning c itself (the native tests').
  void run(const Call& c, const std::function<bool()>* interrupted = nullptr, const Pool* pool = nullptr) {
    run(c, choose(c, pool), interrupted, pool);
  }
  // Marks the whole group broken (all ranks raise); safe from any thread.
  void abort(const std::string& why) { waits_.abort(why); }
  bool broken() const { return waits_.broken(); }
  std::string abort_reason() const { return waits_.abort_reason(); }
  uint64_t op_seq() const { return op_seq_; }
  // The first call that failed (it and every later one did), or 0.
  uint64_t failed_seq() const { return waits_.failed_seq(); }
  int nranks() const { return opt_.nranks; }
  // The algorithm run() uses for c (Auto resolved; rank order when c.deterministic).
  Algo choose(const Call& c, const Pool* pool = nullptr) const;
  // The block cma reads c in (0: whole chunks): a cmawhole step's, else Options::cma_block_bytes.
  uint64_t cma_block(const Call& c) const;
  // Replaces Options::steps; before the first call, the same on every rank.
  void set_steps(std::vector<Step> steps) { opt_.steps = std::move(steps); }
  // Whether this rank can read every peer's memory by cross-memory attach: "" if so, else why not
  // (a ptrace policy, a seccomp filter). Every rank must have constructed its Protocol first.
  std::string cma_probe() const { return shm::cma_probe(areas_, opt_.rank, opt_.nranks); }
  size_t slice_bytes() const { return mail_.slice_bytes(); }
  // Frees cma's scratch (whole chunks: (N-1)/N of the largest tensor read so); between calls only.
  void drop_cma_scratch() { std::vector<char>().swap(scratch_.blocks); }
  // What this rank waits for now, as a JSON object (the flight recorder's "waiting"), or "" when
  // no wait has outlasted its spin. Kept after a failed wait. Safe from any thread.
  std::string waiting() const { return waits_.waiting(); }
  int pid_of(int rank) const { return waits_.pid_of(rank); }
  // How often Stream::Auto found a slow copy and switched to non-temporal stores.
  uint64_t stream_switches() const { return writer_.switches(); }

 private:
  static GroupHeader* checked(void* base, size_t bytes, const Options& opt);
  const Step* step_of(const Call& c) const;  // the last auto step an all-reduce reaches, or null

  Options opt_;
  GroupHeader* const hdr_;
  RankArea* const areas_;
  Waits waits_;
  Writer writer_;
  Mailbox mail_;
  Scratch scratch_;
  uint64_t op_seq_ = 0;
};

}  // namespace shm
}  // namespace ringreduce
