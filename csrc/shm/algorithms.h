// How a call moves data, each algorithm written once against the parts: the Mailbox's messages,
// the Writer's stores, the Waits' failures. The ring (2(N-1) dependent steps, each rank moves
// 2(N-1)/N of the tensor) wins on bandwidth; one-shot (every rank publishes its input, every rank
// reads and reduces all N in rank order: one step, N x the reads) wins on latency for small
// tensors; two-shot (every rank publishes its input, rank k reduces chunk k from all N in rank
// order and publishes it, every rank copies the N chunks out: two steps, the ring's bytes) reduces
// in rank order at any size. One-shot and two-shot give every element the bits of
// ((x0 op x1) op x2) ... (deterministic mode). Cma (RINGREDUCE_ALGO=cma, opt-in): two-shot's
// schedule with the data read straight from the peers' buffers by cross-memory attach
// (process_vm_readv) a block at a time (Options::cma_block_bytes), no slot copies; rank order too. Pool: a tensor in a buffer every rank maps
// (ringreduce.shared_empty): rank r folds chunk r of every rank's tensor in rank order and writes
// it into all of them, one pass, no slots. Wire: a call with a wire dtype (Call::wire): two-shot's
// schedule in whole blocks of kWireBlock elements, each part rounded onto the wire as it is
// published (wire_run.cpp). The ring is in protocol.cpp, the direct ones in direct.cpp.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ring/call.h"
#include "ring/schedule.h"
#include "shm/mailbox.h"
#include "shm/waits.h"

namespace ringreduce {
namespace shm {

// A call's tensor in a pool buffer: every rank's copy of the buffer mapped in this process (rank
// order; all the same size), and the tensor's byte offset in this rank's copy.
struct Pool {
  const std::vector<char*>* bases = nullptr;
  uint64_t bytes = 0;
  uint64_t off = 0;
};

// What every algorithm reads off its call alike: element size, buffers, AVG's divisor, and the
// chunks (all_reduce: ring::chunk of the whole tensor; reduce_scatter and all_gather: m each).
struct CallView {
  CallView(const Call& c, int n, int r)
      : es(dtype_size(c.dtype)), in(static_cast<const char*>(c.in)), out(static_cast<char*>(c.out)),
        divisor(c.op == RedOp::Avg ? n : 1), ar(c.coll == Coll::AllReduce), m(c.numel / n),
        out_shift(c.coll == Coll::ReduceScatter ? r * m : 0), numel(c.numel), n(n) {}
  ring::Span chunk(int k) const { return ar ? ring::chunk(numel, n, k) : ring::Span{k * m, m}; }
  int64_t largest_chunk() const { return ar ? (numel + n - 1) / n : m; }

  const size_t es;
  const char* const in;
  char* const out;
  const int divisor;
  const bool ar;
  const int64_t m;          // numel / n
  const int64_t out_shift;  // reduce_scatter's output holds chunk r only: where it starts
  const int64_t numel;
  const int n;
};

// Buffers kept between calls (no allocation per call once warm).
struct Scratch {
  std::vector<const void*> srcs;          // the N sources of a fold, in rank order
  std::vector<uint64_t> peer_in, peer_out;  // cma: the peers' buffers in the current call
  std::vector<char> blocks;                 // cma: a block of every peer's chunk (whole: the chunk)
  std::vector<char*> pool_at;               // pool: every rank's tensor, mapped here
  std::vector<char> wire_own, wire_res;     // wire: this rank's part and its result, encoded
  std::vector<char> wire_tmp;               // wire: a part on its way into a slot
};

// What an algorithm runs on: one rank's parts.
struct Parts {
  Waits& waits;
  Mailbox& mail;
  Writer& writer;
  Scratch& s;
  const int rank, n;
  size_t slice_bytes() const { return mail.slice_bytes(); }
};

void run_ring(Parts& p, const Call& c, Ctx& ctx);
void run_oneshot(Parts& p, const Call& c, Ctx& ctx);
void run_twoshot(Parts& p, const Call& c, Ctx& ctx);
void run_cma(Parts& p, const Call& c, Ctx& ctx, uint64_t block_bytes);  // 0: whole chunks
void run_pool(Parts& p, const Call& c, Ctx& ctx, const Pool& pool);
// Returns how many finite values overflowed the wire on any rank (fp16), as far as this rank
// learned it: every rank, for an all-reduce.
int64_t run_wire(Parts& p, const Call& c, Ctx& ctx);

// Cross-memory attach, this rank's side: where a peer's probe reads (published in its RankArea
// by the Protocol), and whether this rank can read every peer: "" if so, else why not.
extern const uint64_t kProbeWord;
std::string cma_probe(const RankArea* areas, int rank, int n);

}  // namespace shm
}  // namespace ringreduce
