#include "cuda/nccl/algorithms.h"

#include <algorithm>

#include "cuda/host.h"
#include "cuda/nccl/plan.h"
#include "cuda/nccl/reduce.h"
#include "ring/loop.h"
#include "ring/schedule.h"

namespace ringreduce::cuda::nccl {
namespace {

// Chunks of call c: all_reduce cuts any numel (ring::chunk); the others numel / n each.
ring::Span coll_chunk(const Call& c, int n, int k) {
  if (c.coll == Coll::AllReduce) return ring::chunk(c.numel, n, k);
  return {k * (c.numel / n), c.numel / n};
}

// Direct reduce-scatter (one group per slice): one_shot, every rank's whole input, else chunk r of
// it, reduced in rank order into the output.
void direct_reduce(Groups& g, const Call& c, bool one_shot, cudaStream_t stream) {
  const int n = g.nranks, r = g.rank;
  const size_t es = dtype_size(c.dtype);
  const char* in = static_cast<const char*>(c.in);
  char* out = static_cast<char*>(c.out);
  // Piece of rank q's input this rank receives (one-shot: all of it; else q's part of chunk r) into
  // slot q of the region, slots kSlotAlign-aligned; this rank's own piece is read from its input.
  const size_t slot_bytes = one_shot ? round_up(c.numel * es, kSlotAlign)
                                     : 2 * g.staging_bytes / (n - 1) / kSlotAlign * kSlotAlign;
  const int64_t S = one_shot ? std::max<int64_t>(c.numel, 1) : static_cast<int64_t>(slot_bytes / es);
  // (launch_reduce_ranks reads the slots in this layout.)
  auto slot = [&](int q) { return g.staging[0] + (q < r ? q : q - 1) * slot_bytes; };
  auto part = [&](int k) { return one_shot ? ring::Span{0, c.numel} : coll_chunk(c, n, k); };
  const int64_t ns = ring::num_slices(part(0).count, S);  // chunk 0 is the largest
  const int64_t out_shift = c.coll == Coll::ReduceScatter ? r * (c.numel / n) : 0;
  const int divisor = c.op == RedOp::Avg ? n : 1;
  for (int64_t j = 0; j < ns; ++j) {
    const ring::Span mine = ring::slice(part(r), j, S);
    g.ops.clear();
    for (int k = 1; k < n; ++k) {  // peers in ring order from each side: spreads the traffic
      const int to = (r + k) % n, from = ring::mod(r - k, n);
      const ring::Span sp = ring::slice(part(to), j, S);
      g.ops.push_back({true, in + sp.begin * es, sp.count * es, to});
      g.ops.push_back({false, slot(from), mine.count * es, from});
    }
    g.post(g.ops, stream);
    // One launch folds the n pieces in rank order, ((x0 op x1) op x2) ..., in the compute type,
    // rounded once: bitwise the same on every rank and under every slicing (the contract of
    // ringreduce::deterministic(), kept in every mode: it also reads each piece once, where a
    // launch per rank re-read and re-wrote the running result n-1 times). The output may be the
    // input (in place): each element is read before it is written.
    launch_reduce_ranks(c.dtype, c.op, out + (mine.begin - out_shift) * es, in + mine.begin * es, r,
                        g.staging[0], slot_bytes, n, mine.count, divisor, stream);
  }
}

// Direct all-gather (one group) of the reduced chunks.
void direct_gather(Groups& g, const Call& c, cudaStream_t stream) {
  const int n = g.nranks, r = g.rank;
  const size_t es = dtype_size(c.dtype);
  char* out = static_cast<char*>(c.out);
  const ring::Span mine = coll_chunk(c, n, r);
  // all_reduce: the chunk direct_reduce finished in the output; all_gather: the input.
  const char* src = c.coll == Coll::AllGather ? static_cast<const char*>(c.in) : out + mine.begin * es;
  if (src != out + mine.begin * es && mine.count > 0)
    RR_CUDA_CHECK(cudaMemcpyAsync(out + mine.begin * es, src, mine.count * es,
                                  cudaMemcpyDeviceToDevice, stream));
  g.ops.clear();
  for (int k = 1; k < n; ++k) {
    const int to = (r + k) % n, from = ring::mod(r - k, n);
    const ring::Span rp = coll_chunk(c, n, from);
    g.ops.push_back({true, src, mine.count * es, to});
    g.ops.push_back({false, out + rp.begin * es, rp.count * es, from});
  }
  g.post(g.ops, stream);
}

// The ring's primitives (ring/loop.h) over NCCL: a send waits for the next receive, and the two
// go as one group (NCCL's point-to-point pair); receives to be reduced land in the two staging
// buffers in turn, so a group never receives into the buffer it sends from.
struct Prims {
  Groups& g;
  const Call& c;
  cudaStream_t stream;
  size_t es;
  const void* sbuf = nullptr;  // the send that waits for the next receive
  size_t sbytes = 0;
  unsigned turn = 0;  // the staging buffer of the next receive to reduce

  void at(const char*, int, int64_t) {}
  void send(const char* src, int64_t n) {
    sbuf = src;
    sbytes = n * es;
  }
  char* recv(void* dst, int64_t n) {  // the ring's step: to the next rank, from the previous one
    g.ops.assign({{true, sbuf, sbytes, (g.rank + 1) % g.nranks},
                  {false, dst, static_cast<size_t>(n) * es, ring::mod(g.rank - 1, g.nranks)}});
    g.post(g.ops, stream);
    sbuf = nullptr;
    sbytes = 0;
    return static_cast<char*>(dst);
  }
  void recv_reduce_send(const char* own, int64_t n) {
    char* got = recv(g.staging[turn++ & 1], n);
    launch_reduce(c.dtype, c.op, got, got, own, n, 1, stream);
    send(got, n);
  }
  void recv_reduce_copy(const char* own, char* dst, int64_t n, int divisor, bool and_send) {
    char* got = recv(g.staging[turn++ & 1], n);
    launch_reduce(c.dtype, c.op, dst, got, own, n, divisor, stream);
    if (and_send) send(dst, n);
  }
  void recv_copy(char* dst, int64_t n, bool and_send) {
    recv(dst, n);
    if (and_send) send(dst, n);
  }
  void copy(char* dst, const char* src, int64_t n) {
    if (n > 0) RR_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * es, cudaMemcpyDeviceToDevice, stream));
  }
};

}  // namespace

void run_algo(Groups& g, const Call& c, Algo algo, cudaStream_t stream) {
  if (algo == Algo::Ring) {
    const size_t es = dtype_size(c.dtype);
    Prims prims{g, c, stream, es};
    ring::run_ring(c, g.nranks, g.rank, static_cast<int64_t>(g.staging_bytes / es), prims);
    return;
  }
  if (c.coll != Coll::AllGather) direct_reduce(g, c, algo == Algo::OneShot, stream);
  if (c.coll == Coll::AllGather || (c.coll == Coll::AllReduce && algo == Algo::TwoShot))
    direct_gather(g, c, stream);
}

}  // namespace ringreduce::cuda::nccl
