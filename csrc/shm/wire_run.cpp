// The wire algorithm (Algo::Wire): two-shot's schedule with every part rounded onto a narrow wire
// as it is published, folded in fp32 in rank order by the chunk's owner, and (all-reduce) rounded
// once more for the gather. Chunks and slices are whole blocks of kWireBlock elements, so a block's
// fp8 scale, and so every bit of the result, is the same whatever the world size or slice.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "ring/schedule.h"
#include "cpu/wire.h"
#include "shm/algorithms.h"

namespace ringreduce {
namespace shm {

// All-reduces up to this size (of the tensor, not of the wire) run one-shot: one meeting where
// two-shot has two, N x the fold's reads. Measured with python -m ringreduce.bench --wire.
constexpr size_t kWireOneShotMaxBytes = 32 << 10;

int64_t run_wire(Parts& p, const Call& c, Ctx& ctx) {
  const int n = p.n, r = p.rank;
  Mailbox& mail = p.mail;
  Scratch& s = p.s;
  const CallView v(c, n, r);
  const Wire w = c.wire;
  const int64_t B = kWireBlock;
  const size_t bb = wire_block_bytes(w);
  int64_t over = 0;

  if (n == 1) {  // the same two roundings as at any world size, a piece at a time
    const int64_t piece = 512 * B;
    s.wire_own.resize(piece / B * bb);
    s.wire_res.resize(piece / B * bb);
    for (int64_t i = 0; i < c.numel; i += piece) {
      const int64_t k = std::min(piece, c.numel - i);
      over += cpu::wire_encode(w, c.dtype, v.in + i * v.es, k, s.wire_own.data());
      const void* src = s.wire_own.data();
      over += cpu::wire_reduce(w, &src, 1, k, 1, v.ar ? s.wire_res.data() : nullptr, c.dtype,
                               v.out + i * v.es);
    }
    return over;
  }

  if (v.ar && static_cast<size_t>(c.numel) * v.es <= kWireOneShotMaxBytes &&
      wire_span_bytes(w, c.numel) <= p.slice_bytes()) {
    // One-shot: every rank publishes its whole tensor on the wire and folds all N (the same
    // blocks, so the same bits as the two-shot schedule): one meeting instead of two.
    ctx.phase = "wire one-shot";
    const uint64_t bytes = wire_span_bytes(w, c.numel);
    s.wire_own.resize(bytes);
    s.wire_res.resize(bytes);
    char* d = mail.begin_wide(ctx);
    over += cpu::wire_encode(w, c.dtype, v.in, c.numel, s.wire_own.data());
    if (over) mail.raise_flags(kFlagOverflow);
    p.writer.put(d, s.wire_own.data(), bytes);
    const uint32_t ma = mail.post_wide(ctx, bytes);
    s.srcs.resize(n);
    for (int q = 0; q < n; ++q) {
      ctx.step = q;
      s.srcs[q] = q == r ? s.wire_own.data() : mail.recv_wide(ctx, q, ma, bytes);
    }
    over += cpu::wire_reduce(w, s.srcs.data(), n, c.numel, v.divisor, s.wire_res.data(), c.dtype, v.out);
    mail.release_wide(ma);
    // Every rank folded every input, so each knows every overflow.
    return over + ((mail.flags() & kFlagOverflow) && !over ? 1 : 0);
  }
  const int64_t P = static_cast<int64_t>(p.slice_bytes() / (n - 1) / bb);  // blocks per part
  if (P < 1)
    throw std::invalid_argument(
        "ringreduce: wire_dtype=" + std::string(wire_name(w)) + " needs slices of at least " +
        std::to_string((n - 1) * bb) + " bytes at world size " + std::to_string(n) +
        " (a block of " + std::to_string(B) + " elements per peer); RINGREDUCE_SLICE_BYTES is " +
        std::to_string(p.slice_bytes()));
  const int64_t nbk = wire_blocks(v.ar ? c.numel : v.m);
  const int64_t ns = ring::num_slices(v.ar ? (nbk + n - 1) / n : nbk, P);
  // Elements of slice j of chunk k: [begin, begin + count) of the full tensor.
  auto part = [&](int k, int64_t j) {
    const ring::Span sb = ring::slice(v.ar ? ring::chunk(nbk, n, k) : ring::Span{0, nbk}, j, P);
    const int64_t base = v.ar ? 0 : k * v.m, len = v.ar ? c.numel : v.m;
    const int64_t b = std::min(len, sb.begin * B), e = std::min(len, (sb.begin + sb.count) * B);
    return ring::Span{base + b, e - b};
  };
  // Where part k sits in rank q's message (q's own part is not in it): a full part's room each.
  auto at = [&](int q, int k) { return static_cast<size_t>(k < q ? k : k - 1) * P * bb; };
  auto parts_bytes = [&](int64_t j) {  // the header's size: slice j of every chunk
    uint64_t b = 0;
    for (int k = 0; k < n; ++k) b += wire_span_bytes(w, part(k, j).count);
    return b;
  };
  s.wire_own.resize(P * bb);
  s.wire_res.resize(P * bb);
  s.wire_tmp.resize(P * bb);

  // This rank's slice j of every chunk onto the wire: the others' parts into one message, its own
  // into s.wire_own (so its flag covers all of its input once the last slice is published).
  auto publish = [&](int64_t j) {
    ctx.slice = j;
    ctx.phase = "wire reduce";
    ctx.step = 0;
    char* parts = mail.begin_wide(ctx);
    for (int k = 0; k < n; ++k) {
      const ring::Span sp = part(k, j);
      if (k == r) {
        over += cpu::wire_encode(w, c.dtype, v.in + sp.begin * v.es, sp.count, s.wire_own.data());
        continue;
      }
      // Encoded here (L2), then put(): the slot gets the same stores as every other message
      // (non-temporal in the machine's slow state: Writer::put).
      over += cpu::wire_encode(w, c.dtype, v.in + sp.begin * v.es, sp.count, s.wire_tmp.data());
      p.writer.put(parts + at(r, k), s.wire_tmp.data(), wire_span_bytes(w, sp.count));
    }
    if (over) mail.raise_flags(kFlagOverflow);
    mail.post_wide(ctx, parts_bytes(j));
  };
  s.srcs.resize(n);
  publish(0);
  for (int64_t j = 0; j < ns; ++j) {
    const uint32_t ma = mail.last_sent();  // slice j's parts
    ctx.slice = j;
    ctx.phase = "wire reduce";
    const ring::Span mine = part(r, j);
    for (int q = 0; q < n; ++q) {
      ctx.step = q;
      s.srcs[q] = q == r ? s.wire_own.data() : mail.recv_wide(ctx, q, ma, parts_bytes(j)) + at(q, r);
    }
    over += cpu::wire_reduce(w, s.srcs.data(), n, mine.count, v.divisor,
                             v.ar ? s.wire_res.data() : nullptr, c.dtype,
                             v.out + (mine.begin - v.out_shift) * v.es);
    if (over) mail.raise_flags(kFlagOverflow);
    mail.release_wide(ma);
    if (!v.ar) {
      if (j + 1 < ns) publish(j + 1);
      continue;
    }
    ctx.phase = "wire gather";
    ctx.step = 0;
    const size_t rb = wire_span_bytes(w, mine.count);
    p.writer.put(mail.begin_wide(ctx), s.wire_res.data(), rb);
    const uint32_t mb = mail.post_wide(ctx, rb);
    // As in two-shot: slice j+1's input is unread by the copy-out below (it writes slice j only).
    if (j + 1 < ns) publish(j + 1);
    ctx.slice = j;
    ctx.phase = "wire gather";
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      ctx.step = q;
      const ring::Span sp = part(q, j);
      const char* src = mail.recv_wide(ctx, q, mb, wire_span_bytes(w, sp.count));
      cpu::wire_decode(w, src, sp.count, c.dtype, v.out + sp.begin * v.es);
    }
    mail.release_wide(mb);  // B(j) read; A(j+1) from the others is not (released next round)
  }
  // Every rank's last message carries what it learned from every rank's last parts.
  return over + ((mail.flags() & kFlagOverflow) && !over ? 1 : 0);
}

}  // namespace shm
}  // namespace ringreduce
