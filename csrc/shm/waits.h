// Every wait of a rank, bounded by the group's abort word, the timeout, an interrupt and the death
// of the rank waited for; and how a rank fails: it records its first failed call, aborts the group
// (the abort word and its reason in the group header) and throws. Also what the flight recorder
// reads of a slow wait (waiting(), from any thread). Used by one thread, the ring's, except
// abort(), broken(), abort_reason() and waiting().
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "shm/options.h"
#include "shm/segment.h"

namespace ringreduce {
namespace shm {

class Waits {
 public:
  Waits(GroupHeader* hdr, RankArea* areas, const Options& opt);
  // Call seq starts; interrupted (optional) is polled while waiting, every 50 ms: true fails it. A
  // group broken between calls counts seq as the first failed call.
  void begin(uint64_t seq, const std::function<bool()>* interrupted);
  // Waits until c reaches target (wrap-around safe), posted by peer; ctx and what say where.
  void wait_ge(Counter& c, uint32_t target, int peer, const Ctx& ctx, const char* what);
  [[noreturn]] void fail(const Ctx& ctx, const std::string& msg);  // aborts the group, throws msg
  [[noreturn]] void raise_aborted(const Ctx& ctx);  // another rank aborted: says who and why
  void abort(const std::string& why);  // marks the group broken (every rank raises); any thread
  bool broken() const;
  std::string abort_reason() const;
  std::string waiting() const;  // the slow wait in progress as JSON, or ""
  uint64_t failed_seq() const { return failed_seq_; }
  bool peer_dead(int peer) const;
  int32_t pid_of(int rank) const { return areas_[rank].pid.load(); }
  // "all_reduce #7 (phase)": where a call failed, for messages.
  static std::string where(const Ctx& ctx);

 private:
  GroupHeader* const hdr_;
  RankArea* const areas_;
  const int rank_, nranks_;
  const double timeout_s_;
  const int64_t spin_ns_, yield_ns_;
  bool broken_ = false;
  uint64_t failed_seq_ = 0;
  const std::function<bool()>* interrupted_ = nullptr;
  // The slow wait in progress (wait_peer_ -1: none); written by the ring's thread only.
  std::atomic<int> wait_peer_{-1};
  std::atomic<const char*> wait_what_{""}, wait_phase_{""};
  std::atomic<int> wait_step_{0};
  std::atomic<int64_t> wait_slice_{0}, wait_since_ns_{0};
  std::atomic<uint64_t> wait_seq_{0};
};

// Posts v on c and wakes its sleepers.
void post(Counter& c, uint32_t v);

}  // namespace shm
}  // namespace ringreduce
