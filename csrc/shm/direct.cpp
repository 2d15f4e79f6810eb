// The shared-memory transport's direct algorithms (algorithms.h): one-shot, two-shot, cma (cross-
// memory attach) and the pool's one pass.
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "cpu/reduce.h"
#include "ring/schedule.h"
#include "shm/algorithms.h"

namespace ringreduce {
namespace shm {

// Per slice: publish this rank's part in its own next slot; read every rank's slot of the same index
// and reduce them in rank order (so every rank computes the same bits); then mark the index consumed.
void run_oneshot(Parts& p, const Call& c, Ctx& ctx) {
  const int n = p.n, r = p.rank;
  const CallView v(c, n, r);
  const int64_t S = std::max<int64_t>(1, static_cast<int64_t>(p.slice_bytes() / v.es));
  const int64_t ns = ring::num_slices(c.numel, S);
  std::vector<const void*>& srcs = p.s.srcs;
  srcs.resize(n);
  ctx.phase = "one-shot";
  for (int64_t j = 0; j < ns; ++j) {
    ctx.slice = j;
    ctx.step = 0;
    const ring::Span sp = ring::slice({0, c.numel}, j, S);
    const uint64_t bytes = sp.count * v.es;
    p.writer.put(p.mail.begin_wide(ctx), v.in + sp.begin * v.es, bytes);
    const uint32_t m = p.mail.post_wide(ctx, bytes);
    for (int k = 0; k < n; ++k) {
      ctx.step = k;
      srcs[k] = k == r ? v.in + sp.begin * v.es : p.mail.recv_wide(ctx, k, m, bytes);
    }
    cpu::reduce_rows(c.dtype, c.op, v.out + sp.begin * v.es, srcs.data(), n, sp.count, v.divisor);
    p.mail.release_wide(m);
  }
}

// Per slice j: every rank publishes part j of every chunk but its own in one message (N-1 parts of
// P elements, a full slot); rank k reduces part j of chunk k from every rank's message (its own from
// its input) in rank order into its output, and (all-reduce) publishes it in a second message that
// every rank copies out. Both messages are wide: a slot is rewritten once every rank consumed it.
// Slice j+1 is published before slice j's results are copied out, so ranks overlap instead of
// meeting at every message. Reads and writes per rank: the ring's, plus the copy of the input.
void run_twoshot(Parts& p, const Call& c, Ctx& ctx) {
  const int n = p.n, r = p.rank;
  const CallView v(c, n, r);
  Mailbox& mail = p.mail;
  const int64_t P = std::max<int64_t>(1, static_cast<int64_t>(p.slice_bytes() / v.es / (n - 1)));
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
    char* parts = mail.begin_wide(ctx);
    for (int k = 0; k < n; ++k) {
      if (k == r) continue;
      const ring::Span sp = ring::slice(v.chunk(k), j, P);
      p.writer.put(parts + at(r, k), v.in + sp.begin * v.es, sp.count * v.es);
    }
    mail.post_wide(ctx, parts_bytes(j));
  };
  std::vector<const void*>& srcs = p.s.srcs;
  srcs.resize(n);
  publish(0);
  for (int64_t j = 0; j < ns; ++j) {
    const uint32_t ma = mail.last_sent();  // slice j's parts
    ctx.slice = j;
    ctx.phase = "two-shot reduce";
    const ring::Span mine = ring::slice(v.chunk(r), j, P);
    for (int q = 0; q < n; ++q) {
      ctx.step = q;
      srcs[q] = q == r ? v.in + mine.begin * v.es : mail.recv_wide(ctx, q, ma, parts_bytes(j)) + at(q, r);
    }
    char* dst = v.out + (mine.begin - v.out_shift) * v.es;
    cpu::reduce_rows(c.dtype, c.op, dst, srcs.data(), n, mine.count, v.divisor);
    mail.release_wide(ma);
    if (!v.ar) {
      if (j + 1 < ns) publish(j + 1);
      continue;
    }
    ctx.phase = "two-shot gather";
    ctx.step = 0;
    p.writer.put(mail.begin_wide(ctx), dst, mine.count * v.es);
    const uint32_t mb = mail.post_wide(ctx, mine.count * v.es);
    // In place, slice j+1's parts are still unread input: publishing them before the copy-out
    // below is safe (the copy-out writes slice j only).
    if (j + 1 < ns) publish(j + 1);
    ctx.slice = j;
    ctx.phase = "two-shot gather";
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      ctx.step = q;
      const ring::Span sp = ring::slice(v.chunk(q), j, P);
      std::memcpy(v.out + sp.begin * v.es, mail.recv_wide(ctx, q, mb, sp.count * v.es), sp.count * v.es);
    }
    mail.release_wide(mb);  // B(j) read; A(j+1) from the others is not (released next round)
  }
}

namespace {

// Copies bytes at addr in rank q's memory to local (process_vm_readv); fails the group on error.
void read_peer(Parts& p, int q, void* local, uint64_t addr, size_t bytes, const Ctx& ctx) {
  const pid_t pid = p.waits.pid_of(q);
  char* dst = static_cast<char*>(local);
  while (bytes > 0) {
    iovec l{dst, bytes}, rem{reinterpret_cast<void*>(addr), bytes};
    const ssize_t got = process_vm_readv(pid, &l, 1, &rem, 1, 0);
    if (got <= 0) {
      const int e = got < 0 ? errno : EIO;
      if (e == EINTR) continue;
      const std::string head = "ringreduce: rank " + std::to_string(p.rank) + ": " + Waits::where(ctx);
      if (e == ESRCH || p.waits.peer_dead(q))
        p.waits.fail(ctx, head + ": peer rank " + std::to_string(q) + " (pid " + std::to_string(pid) + ") died");
      // A peer that failed (another rank died, say) aborts the group before its call returns and
      // frees the buffer being read (EFAULT here): report the abort, its cause, not the read.
      if (p.waits.broken()) p.waits.raise_aborted(ctx);
      p.waits.fail(ctx, head + ": reading rank " + std::to_string(q) + "'s memory (pid " + std::to_string(pid) +
                            ") failed: " + std::strerror(e) +
                            (e == EPERM ? " (cross-memory attach needs ptrace permission between the ranks: "
                                          "CAP_SYS_PTRACE or Yama's ptrace_scope <= 1; use another RINGREDUCE_ALGO)"
                                        : ""));
    }
    dst += got;
    addr += static_cast<uint64_t>(got);
    bytes -= static_cast<size_t>(got);
  }
}

}  // namespace

const uint64_t kProbeWord = 0x636d612d70726f62ull;  // "cma-prob"

std::string cma_probe(const RankArea* areas, int rank, int n) {
  for (int q = 0; q < n; ++q) {
    if (q == rank) continue;
    uint64_t word = 0;
    iovec l{&word, sizeof word}, rem{reinterpret_cast<void*>(areas[q].probe.load()), sizeof word};
    const ssize_t got = process_vm_readv(areas[q].pid.load(), &l, 1, &rem, 1, 0);
    if (got != static_cast<ssize_t>(sizeof word) || word != kProbeWord)
      return "rank " + std::to_string(rank) + " cannot read rank " + std::to_string(q) +
             "'s memory by cross-memory attach (process_vm_readv: " +
             (got < 0 ? std::strerror(errno) : "short or wrong read") + ")";
  }
  return "";
}

// Cross-memory attach: three (reduce_scatter two) wide messages per call, the data read straight
// from the peers' memory. 1: every rank publishes its buffers' addresses. 2: rank r reads chunk r
// of every peer's input a block at a time (block_bytes, Options::cma_block_bytes; 0: the whole
// chunk) and folds the N blocks in rank order into its output, then says its chunk is final, which also says it has read the peers'
// inputs. 3 (all_reduce): it reads each peer's final chunk from the peer's output into its own,
// then says so; a rank returns only once every peer has read its buffers. In place is safe: a
// rank overwrites chunk q of its buffer only after rank q, the only reader of it, said final.
void run_cma(Parts& p, const Call& c, Ctx& ctx, uint64_t block_bytes) {
  const int n = p.n, r = p.rank;
  const CallView v(c, n, r);
  Mailbox& mail = p.mail;
  Scratch& s = p.s;
  ctx.phase = "cma addresses";
  ctx.step = 0;
  ctx.slice = 0;
  uint64_t addrs[2] = {reinterpret_cast<uint64_t>(v.in), reinterpret_cast<uint64_t>(v.out)};
  const uint32_t m0 = mail.say_wide(ctx, addrs, sizeof addrs);
  s.peer_in.assign(n, 0);
  s.peer_out.assign(n, 0);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    ctx.step = q;
    std::memcpy(addrs, mail.recv_wide(ctx, q, m0, sizeof addrs), sizeof addrs);
    s.peer_in[q] = addrs[0];
    s.peer_out[q] = addrs[1];
  }
  mail.release_wide(m0);

  ctx.phase = "cma reduce";
  const ring::Span mine = v.chunk(r);
  const uint64_t whole = static_cast<uint64_t>(mine.count);
  const int64_t B = static_cast<int64_t>(
      std::max<uint64_t>(1, block_bytes == 0 ? whole : std::min(whole, block_bytes / v.es)));
  s.blocks.resize(static_cast<size_t>(n - 1) * B * v.es);
  s.srcs.resize(n);
  for (int64_t b = 0, j = 0; b < mine.count; b += B, ++j) {
    ctx.slice = j;
    const int64_t cnt = std::min(B, mine.count - b);
    const int64_t at = mine.begin + b;
    for (int q = 0; q < n; ++q) {
      if (q == r) {
        s.srcs[q] = v.in + at * v.es;
        continue;
      }
      ctx.step = q;
      char* blk = s.blocks.data() + static_cast<size_t>(q < r ? q : q - 1) * B * v.es;
      read_peer(p, q, blk, s.peer_in[q] + at * v.es, cnt * v.es, ctx);
      s.srcs[q] = blk;
    }
    cpu::reduce_rows(c.dtype, c.op, v.out + (at - v.out_shift) * v.es, s.srcs.data(), n, cnt, v.divisor);
  }
  ctx.phase = "cma gather";
  ctx.slice = 0;
  const uint32_t m1 = mail.say_wide(ctx, nullptr, 0);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    ctx.step = q;
    mail.recv_wide(ctx, q, m1, 0);
    if (v.ar) {
      const ring::Span sp = v.chunk(q);
      read_peer(p, q, v.out + sp.begin * v.es, s.peer_out[q] + sp.begin * v.es, sp.count * v.es, ctx);
    }
  }
  mail.release_wide(m1);
  if (!v.ar) return;
  ctx.phase = "cma done";
  const uint32_t m2 = mail.say_wide(ctx, nullptr, 0);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    ctx.step = q;
    mail.recv_wide(ctx, q, m2, 0);
  }
  mail.release_wide(m2);
}

// Pool: the peers' copies of the buffer are mapped here, so one pass does it. 1: every rank says
// where its tensor lies in its buffer (which also says its data is ready). 2: rank r folds chunk r
// of the N tensors in rank order, a block at a time, and writes each finished block into every
// rank's tensor; then it says so. It returns once every rank has: then no one reads or writes its
// tensor any more. Each rank reads and writes 1/N of every tensor: the bytes of the
// memory-bandwidth floor. Safe in place: chunk r of any tensor is read and written only by rank r,
// each block's sources read before its results are written.
void run_pool(Parts& p, const Call& c, Ctx& ctx, const Pool& pool) {
  const int n = p.n, r = p.rank;
  Mailbox& mail = p.mail;
  const size_t es = dtype_size(c.dtype);
  const uint64_t bytes = static_cast<uint64_t>(c.numel) * es;
  const std::vector<char*>& bases = *pool.bases;
  ctx.phase = "pool offsets";
  ctx.step = 0;
  ctx.slice = 0;
  const uint32_t m0 = mail.say_wide(ctx, &pool.off, sizeof pool.off);
  std::vector<char*>& at = p.s.pool_at;
  at.assign(n, nullptr);
  for (int q = 0; q < n; ++q) {
    uint64_t off = pool.off;
    if (q != r) {
      ctx.step = q;
      std::memcpy(&off, mail.recv_wide(ctx, q, m0, sizeof off), sizeof off);
    }
    if (off > pool.bytes || bytes > pool.bytes - off)
      p.waits.fail(ctx, "ringreduce: rank " + std::to_string(r) + ": all_reduce #" + std::to_string(ctx.seq) +
                            ": rank " + std::to_string(q) + "'s tensor (" + std::to_string(bytes) +
                            " bytes at " + std::to_string(off) + ") lies outside its shared buffer of " +
                            std::to_string(pool.bytes) + " bytes (ringreduce.shared_empty buffers of other sizes?)");
    at[q] = bases[q] + off;
  }
  mail.release_wide(m0);

  ctx.phase = "pool reduce";
  const ring::Span mine = ring::chunk(c.numel, n, r);
  const int64_t B = std::max<int64_t>(1, static_cast<int64_t>((64 << 10) / es));  // stays in L2
  std::vector<const void*>& srcs = p.s.srcs;
  srcs.resize(n);
  for (int64_t b = 0; b < mine.count; b += B) {
    const int64_t cnt = std::min(B, mine.count - b);
    const size_t from = static_cast<size_t>(mine.begin + b) * es;
    for (int q = 0; q < n; ++q) srcs[q] = at[q] + from;
    char* own = at[r] + from;
    cpu::reduce_rows(c.dtype, c.op, own, srcs.data(), n, cnt, c.op == RedOp::Avg ? n : 1);
    for (int q = 0; q < n; ++q)
      if (q != r) p.writer.put(at[q] + from, own, cnt * es);
  }
  ctx.phase = "pool done";
  const uint32_t m1 = mail.say_wide(ctx, nullptr, 0);
  for (int q = 0; q < n; ++q) {
    if (q == r) continue;
    ctx.step = q;
    mail.recv_wide(ctx, q, m1, 0);
  }
  mail.release_wide(m1);
}

}  // namespace shm
}  // namespace ringreduce
