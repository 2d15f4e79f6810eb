// The shared-memory transport's direct algorithms (protocol.h): one-shot, two-shot, cma (cross-
// memory attach) and the pool's one pass; the protocol's ring, its waits and its primitives are in
// protocol.cpp.
#include <sys/uio.h>

#include <algorithm>
#include <cstring>

#include "ring/schedule.h"
#include "shm/protocol.h"

namespace ringreduce {
namespace shm {

// Per slice: publish this rank's part in its own next slot; read every rank's slot of the same index
// and reduce them in rank order (so every rank computes the same bits); then mark the index consumed.
// A slot is rewritten only once every rank has consumed it (wide_until_).
void Protocol::run_oneshot(const Call& c, Ctx& ctx) {
  const int n = opt_.nranks, r = opt_.rank;
  const CallView v(c, n, r);
  const int64_t S = std::max<int64_t>(1, static_cast<int64_t>(slice_bytes_ / v.es));
  const int64_t ns = ring::num_slices(c.numel, S);
  srcs_.resize(n);
  ctx.phase = "one-shot";
  for (int64_t j = 0; j < ns; ++j) {
    ctx.slice = j;
    ctx.step = 0;
    const ring::Span sp = ring::slice({0, c.numel}, j, S);
    const uint64_t bytes = sp.count * v.es;
    const uint32_t m = sent_;
    wait_all_consumed(m + 1 - kSlots, ctx);
    put(slot(r, m) + sizeof(MsgHeader), v.in + sp.begin * v.es, bytes);
    wide_until_ = m + 1;  // before post: from here this slot is read by every rank
    post_send(ctx, bytes);
    for (int k = 0; k < n; ++k) {
      ctx.step = k;
      srcs_[k] = k == r ? v.in + sp.begin * v.es : recv_wide(ctx, k, m, bytes);
    }
    cpu::reduce_rows(c.dtype, c.op, v.out + sp.begin * v.es, srcs_.data(), n, sp.count, v.divisor);
    release_wide(m);
  }
}

// Per slice j: every rank publishes part j of every chunk but its own in one message (N-1 parts of
// P elements, a full slot); rank k reduces part j of chunk k from every rank's message (its own from
// its input) in rank order into its output, and (all-reduce) publishes it in a second message that
// every rank copies out. Both messages are wide: a slot is rewritten once every rank consumed it.
// Slice j+1 is published before slice j's results are copied out, so ranks overlap instead of
// meeting at every message. Reads and writes per rank: the ring's, plus the copy of the input.
void Protocol::run_twoshot(const Call& c, Ctx& ctx) {
  const int n = opt_.nranks, r = opt_.rank;
  const CallView v(c, n, r);
  const int64_t P = std::max<int64_t>(1, static_cast<int64_t>(slice_bytes_ / v.es / (n - 1)));
  const int64_t ns = ring::num_slices(v.largest_chunk(), P);
  // Where part k sits in rank q's message (q's own part is not in it).
  auto at = [&](int q, int k) { return static_cast<int64_t>(k < q ? k : k - 1) * P * v.es; };
  auto parts_bytes = [&](int64_t j) {  // the header's size: slice j of every chunk (every rank's)
    uint64_t b = 0;
    for (int k = 0; k < n; ++k) b += ring::slice(v.chunk(k), j, P).count * v.es;
    return b;
  };
  auto publish = [&](int64_t j) {
    ctx.slice = j;
    ctx.phase = "two-shot reduce";
    ctx.step = 0;
    const uint32_t ma = sent_;
    wait_all_consumed(ma + 1 - kSlots, ctx);
    char* parts = slot(r, ma) + sizeof(MsgHeader);
    for (int k = 0; k < n; ++k) {
      if (k == r) continue;
      const ring::Span sp = ring::slice(v.chunk(k), j, P);
      put(parts + at(r, k), v.in + sp.begin * v.es, sp.count * v.es);
    }
    wide_until_ = ma + 1;
    post_send(ctx, parts_bytes(j));
  };
  srcs_.resize(n);
  publish(0);
  for (int64_t j = 0; j < ns; ++j) {
    const uint32_t ma = sent_ - 1;  // slice j's parts
    ctx.slice = j;
    ctx.phase = "two-shot reduce";
    const ring::Span mine = ring::slice(v.chunk(r), j, P);
    for (int q = 0; q < n; ++q) {
      ctx.step = q;
      srcs_[q] = q == r ? v.in + mine.begin * v.es : recv_wide(ctx, q, ma, parts_bytes(j)) + at(q, r);
    }
    char* dst = v.out + (mine.begin - v.out_shift) * v.es;
    cpu::reduce_rows(c.dtype, c.op, dst, srcs_.data(), n, mine.count, v.divisor);
    release_wide(ma);
    if (!v.ar) {
      if (j + 1 < ns) publish(j + 1);
      continue;
    }
    ctx.phase = "two-shot gather";
    ctx.step = 0;
    const uint32_t mb = sent_;
    wait_all_consumed(mb + 1 - kSlots, ctx);
    put(slot(r, mb) + sizeof(MsgHeader), dst, mine.count * v.es);
    wide_until_ = mb + 1;
    post_send(ctx, mine.count * v.es);
    // In place, slice j+1's parts are still unread input: publishing them before the copy-out
    // below is safe (the copy-out writes slice j only).
    if (j + 1 < ns) publish(j + 1);
    ctx.slice = j;
    ctx.phase = "two-shot gather";
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      ctx.step = q;
      const ring::Span sp = ring::slice(v.chunk(q), j, P);
      std::memcpy(v.out + sp.begin * v.es, recv_wide(ctx, q, mb, sp.count * v.es), sp.count * v.es);
    }
    received_ = mb;  // B(j) read (the release counts it); A(j+1) from the others is not (release_wide(ma) next round)
    release_recv();
  }
}

void Protocol::read_peer(int q, void* local, uint64_t addr, size_t bytes, const Ctx& ctx) {
  const pid_t pid = areas_[q].pid.load();
  char* dst = static_cast<char*>(local);
  while (bytes > 0) {
    iovec l{dst, bytes}, rem{reinterpret_cast<void*>(addr), bytes};
    const ssize_t got = process_vm_readv(pid, &l, 1, &rem, 1, 0);
    if (got <= 0) {
      const int e = got < 0 ? errno : EIO;
      if (e == EINTR) continue;
      const std::string where = std::string(coll_name(ctx.call.coll)) + " #" + std::to_string(op_seq_) +
                                " (" + ctx.phase + ")";
      if (e == ESRCH || peer_dead(q))
        fail("ringreduce: rank " + std::to_string(opt_.rank) + ": " + where + ": peer rank " +
             std::to_string(q) + " (pid " + std::to_string(pid) + ") died");
      // A peer that failed (another rank died, say) aborts the group before its call returns and
      // frees the buffer being read (EFAULT here): report the abort, its cause, not the read.
      if (broken()) raise_aborted(ctx);
      fail("ringreduce: rank " + std::to_string(opt_.rank) + ": " + where + ": reading rank " +
           std::to_string(q) + "'s memory (pid " + std::to_string(pid) + ") failed: " +
           std::strerror(e) +
           (e == EPERM ? " (cross-memory attach needs ptrace permission between the ranks: "
                         "CAP_SYS_PTRACE or Yama's ptrace_scope <= 1; use another RINGREDUCE_ALGO)"
                       : ""));
    }
    dst += got;
    addr += static_cast<uint64_t>(got);
    bytes -= static_cast<size_t>(got);
  }
}

// Cross-memory attach: three (reduce_scatter two) wide messages per call, the data read straight
// from the peers' memory. 1: every rank publishes its buffers' addresses. 2: rank r reads chunk r
// of every peer's input a block at a time (the block stays in cache) and folds the N blocks in rank
// order into its output, then says its chunk is final, which also says it has read the peers'
// inputs. 3 (all_reduce): it reads each peer's final chunk from the peer's output into its own,
// then says so; a rank returns only once every peer has read its buffers. In place is safe: a
// rank overwrites chunk q of its buffer only after rank q, the only reader of it, said final.
void Protocol::run_cma(const Call& c, Ctx& ctx) {
  const int n = opt_.nranks, r = opt_.rank;
  const CallView v(c, n, r);
  auto say = [&](const void* payload, uint64_t bytes) { return say_wide(ctx, payload, bytes); };
  ctx.phase = "cma addresses";
  ctx.step = 0;
  ctx.slice = 0;
  uint64_t addrs[2] = {reinterpret_cast<uint64_t>(v.in), reinterpret_cast<uint64_t>(v.out)};
  const uint32_t m0 = say(addrs, sizeof addrs);
  peer_in_.assign(n, 0);
  peer_out_.assign(n, 0);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    ctx.step = q;
    std::memcpy(addrs, recv_wide(ctx, q, m0, sizeof addrs), sizeof addrs);
    peer_in_[q] = addrs[0];
    peer_out_[q] = addrs[1];
  }
  release_wide(m0);

  ctx.phase = "cma reduce";
  const ring::Span mine = v.chunk(r);
  const int64_t B = std::max<int64_t>(1, static_cast<int64_t>(slice_bytes_ / v.es));
  scratch_.resize(static_cast<size_t>(n - 1) * B * v.es);
  srcs_.resize(n);
  for (int64_t b = 0, j = 0; b < mine.count; b += B, ++j) {
    ctx.slice = j;
    const int64_t cnt = std::min(B, mine.count - b);
    const int64_t at = mine.begin + b;
    for (int q = 0; q < n; ++q) {
      if (q == r) {
        srcs_[q] = v.in + at * v.es;
        continue;
      }
      ctx.step = q;
      char* blk = scratch_.data() + static_cast<size_t>(q < r ? q : q - 1) * B * v.es;
      read_peer(q, blk, peer_in_[q] + at * v.es, cnt * v.es, ctx);
      srcs_[q] = blk;
    }
    cpu::reduce_rows(c.dtype, c.op, v.out + (at - v.out_shift) * v.es, srcs_.data(), n, cnt, v.divisor);
  }
  ctx.phase = "cma gather";
  ctx.slice = 0;
  const uint32_t m1 = say(nullptr, 0);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    ctx.step = q;
    recv_wide(ctx, q, m1, 0);
    if (v.ar) {
      const ring::Span sp = v.chunk(q);
      read_peer(q, v.out + sp.begin * v.es, peer_out_[q] + sp.begin * v.es, sp.count * v.es, ctx);
    }
  }
  release_wide(m1);
  if (!v.ar) return;
  ctx.phase = "cma done";
  const uint32_t m2 = say(nullptr, 0);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    ctx.step = q;
    recv_wide(ctx, q, m2, 0);
  }
  release_wide(m2);
}

// A wide message (read by every rank) with a small payload; returns its index.
uint32_t Protocol::say_wide(const Ctx& ctx, const void* payload, uint64_t bytes) {
  const uint32_t mi = sent_;
  wait_all_consumed(mi + 1 - kSlots, ctx);
  if (bytes) std::memcpy(slot(opt_.rank, mi) + sizeof(MsgHeader), payload, bytes);
  wide_until_ = mi + 1;
  post_send(ctx, bytes);
  return mi;
}

// Pool: the peers' copies of the buffer are mapped here, so one pass does it. 1: every rank says
// where its tensor lies in its buffer (which also says its data is ready). 2: rank r folds chunk r
// of the N tensors in rank order, a block at a time, and writes each finished block into every
// rank's tensor; then it says so. It returns once every rank has: then no one reads or writes its
// tensor any more. Each rank reads and writes 1/N of every tensor: the bytes of the
// memory-bandwidth floor. Safe in place: chunk r of any tensor is read and written only by rank r,
// each block's sources read before its results are written.
void Protocol::run_pool(const Call& c, Ctx& ctx, const Pool& pool) {
  const int n = opt_.nranks, r = opt_.rank;
  const size_t es = dtype_size(c.dtype);
  const uint64_t bytes = static_cast<uint64_t>(c.numel) * es;
  const std::vector<char*>& bases = *pool.bases;
  ctx.phase = "pool offsets";
  ctx.step = 0;
  ctx.slice = 0;
  const uint32_t m0 = say_wide(ctx, &pool.off, sizeof pool.off);
  std::vector<char*>& at = pool_at_;
  at.assign(n, nullptr);
  for (int q = 0; q < n; ++q) {
    uint64_t off = pool.off;
    if (q != r) {
      ctx.step = q;
      std::memcpy(&off, recv_wide(ctx, q, m0, sizeof off), sizeof off);
    }
    if (off > pool.bytes || bytes > pool.bytes - off)
      fail("ringreduce: rank " + std::to_string(r) + ": all_reduce #" + std::to_string(op_seq_) +
           ": rank " + std::to_string(q) + "'s tensor (" + std::to_string(bytes) + " bytes at " +
           std::to_string(off) + ") lies outside its shared buffer of " + std::to_string(pool.bytes) +
           " bytes (ringreduce.shared_empty buffers of other sizes?)");
    at[q] = bases[q] + off;
  }
  release_wide(m0);

  ctx.phase = "pool reduce";
  const ring::Span mine = ring::chunk(c.numel, n, r);
  const int64_t B = std::max<int64_t>(1, static_cast<int64_t>((64 << 10) / es));  // stays in L2
  srcs_.resize(n);
  for (int64_t b = 0; b < mine.count; b += B) {
    const int64_t cnt = std::min(B, mine.count - b);
    const size_t from = static_cast<size_t>(mine.begin + b) * es;
    for (int q = 0; q < n; ++q) srcs_[q] = at[q] + from;
    char* own = at[r] + from;
    cpu::reduce_rows(c.dtype, c.op, own, srcs_.data(), n, cnt, c.op == RedOp::Avg ? n : 1);
    for (int q = 0; q < n; ++q)
      if (q != r) put(at[q] + from, own, cnt * es);
  }
  ctx.phase = "pool done";
  const uint32_t m1 = say_wide(ctx, nullptr, 0);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    ctx.step = q;
    recv_wide(ctx, q, m1, 0);
  }
  release_wide(m1);
}

}  // namespace shm
}  // namespace ringreduce
