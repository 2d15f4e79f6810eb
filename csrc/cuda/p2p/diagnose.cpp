// What a failed p2p call says: the device's error records (host-mapped memory) read back and put
// into words, naming the call, the phase, the peer and why.
#include <cstdio>
#include <cstring>
#include <string>

#include "cuda/p2p/failures.h"

namespace ringreduce::cuda::p2p {
namespace {

const char* cause_text(uint32_t cause) {
  switch (cause) {
    case kTimeout: return "timed out";
    case kMismatch: return "saw mismatched collective calls";
    case kBadSize: return "saw a message of the wrong size";
    case kHostAbort: return "was aborted";
    default: return "stopped";
  }
}

}  // namespace

std::string call_text(const MsgHeader& h) {
  char buf[240];
  const Wire w = Wire(h.op >> 4);
  std::snprintf(buf, sizeof buf, "%s(numel=%lld, dtype=%s, op=%s%s%s; %s)", coll_name(Coll(h.coll)),
                static_cast<long long>(h.numel), dtype_name(DType(h.dtype)), op_name(RedOp(h.op & 15)),
                w == Wire::None ? "" : ", wire_dtype=", w == Wire::None ? "" : wire_name(w),
                algo_name(Algo(h.algo)));
  return buf;
}

std::string Failures::describe(const ErrorRecord& e, int channel) const {
  const uint32_t cause = abort_cause(e.word);
  const int who = abort_rank(e.word);
  char where[200];
  if (e.phase < 0)
    std::snprintf(where, sizeof where, "%s #%llu (not started, channel %d)",
                  coll_name(Coll(e.mine.coll)), static_cast<unsigned long long>(e.mine.op_seq), channel);
  else if (e.phase < 2)
    std::snprintf(where, sizeof where, "%s #%llu (ring %s step %d, slice %lld, channel %d)",
                  coll_name(Coll(e.mine.coll)), static_cast<unsigned long long>(e.mine.op_seq),
                  e.phase ? "all-gather" : "reduce-scatter", e.step, static_cast<long long>(e.slice),
                  channel);
  else if (Algo(e.mine.algo) == Algo::Copy)
    std::snprintf(where, sizeof where, "%s #%llu (copy algorithm, piece %lld, block %d)",
                  coll_name(Coll(e.mine.coll)), static_cast<unsigned long long>(e.mine.op_seq),
                  static_cast<long long>(e.slice), channel);
  else
    std::snprintf(where, sizeof where, "%s #%llu (%s, %s barrier of piece %lld, block %d)",
                  coll_name(Coll(e.mine.coll)), static_cast<unsigned long long>(e.mine.op_seq),
                  algo_name(Algo(e.mine.algo)), e.phase == 2 ? "start" : e.phase == 3 ? "middle" : "end",
                  static_cast<long long>(e.slice), channel);
  const std::string me = "ringreduce: rank " + std::to_string(rank_) + ": ";
  if (!e.local)
    return me + where + " stopped because rank " + std::to_string(who) + " " + cause_text(cause) +
           " (see the error on that rank)";
  switch (cause) {
    case kTimeout: {
      char t[32];
      std::snprintf(t, sizeof t, "%g", timeout_s_);
      const bool ring = e.phase >= 0 && e.phase < 2;
      return me + where + " timed out after " + t + " s waiting for " +
             (!ring ? "rank " : e.waiting_for_slot ? "a free slot, consumed by rank " : "a message from rank ") +
             std::to_string(e.peer) + (!ring ? " at the barrier" : "") +
             " (RINGREDUCE_TIMEOUT; did every rank make the same call?)";
    }
    case kMismatch:
      return "ringreduce: mismatched collective calls: rank " + std::to_string(e.peer) + " called " +
             call_text(e.got) + " as its call #" + std::to_string(e.got.op_seq) +
             " on this communicator, while rank " + std::to_string(rank_) + " called " +
             call_text(e.mine) + " as its call #" + std::to_string(e.mine.op_seq) +
             ((Algo(e.got.algo) == Algo::Registered) != (Algo(e.mine.algo) == Algo::Registered)
                  ? " (a tensor in a ringreduce.shared_empty buffer on one rank only: use one on "
                    "every rank or on none)"
                  : "");
    case kBadSize:
      if (Algo(e.mine.algo) == Algo::Registered) {
        auto at = [](uint64_t tag) {
          return "byte offset " + std::to_string(tag & ((uint64_t{1} << kRegTagShift) - 1)) +
                 " of its shared buffer #" + std::to_string((tag >> kRegTagShift) - 1);
        };
        return me + where + ": rank " + std::to_string(e.peer) + "'s tensor starts at " +
               at(e.got.nbytes) + " and this rank's at " + at(e.mine.nbytes) +
               " (an all_reduce of a ringreduce.shared_empty tensor needs the same buffer and "
               "offset on every rank)";
      }
      if (e.got.nbytes == e.mine.nbytes && e.phase >= 2 && (e.got.index >> 24) != (e.mine.index >> 24))
        return me + where + ": rank " + std::to_string(e.peer) + " cut the call between " +
               std::to_string(e.got.index >> 24) + " blocks, this rank between " +
               std::to_string(e.mine.index >> 24) +
               " (inconsistent schedules: RINGREDUCE_CUDA_MAX_BLOCKS or the devices differ)";
      if (e.got.nbytes == e.mine.nbytes)  // the right size, but another piece
        return me + where + ": message #" + std::to_string(e.got.index) + " from rank " +
               std::to_string(e.peer) + " where #" + std::to_string(e.mine.index) +
               " was expected (inconsistent schedules)";
      return me + where + ": message of " + std::to_string(e.got.nbytes) + " bytes from rank " +
             std::to_string(e.peer) + " where " + std::to_string(e.mine.nbytes) +
             " were expected (inconsistent schedules)";
    case kHostAbort:
      return me + where + " stopped: aborted on this rank: " +
             (reason_.empty() ? std::string("(no reason given)") : reason_);
    default:
      return me + where + " stopped (cause " + std::to_string(cause) + ")";
  }
}

}  // namespace ringreduce::cuda::p2p
