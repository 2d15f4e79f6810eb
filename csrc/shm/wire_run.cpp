// The wire algorithm (Algo::Wire): two-shot's schedule with every part rounded onto a narrow wire
// as it is published, folded in fp32 in rank order by the chunk's owner, and (all-reduce) rounded
// once more for the gather. Chunks and slices are whole blocks of kWireBlock elements, so a block's
// fp8 scale, and so every bit of the result, is the same whatever the world size or slice.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "ring/schedule.h"
#include "cpu/wire.h"
#include "shm/protocol.h"

namespace ringreduce {
namespace shm {

// All-reduces up to this size (of the tensor, not of the wire) run one-shot: one meeting where
// two-shot has two, N x the fold's reads. Measured with python -m ringreduce.bench --wire.
constexpr size_t kWireOneShotMaxBytes = 32 << 10;

int64_t Protocol::run_wire(const Call& c, Ctx& ctx) {
  const int n = opt_.nranks, r = opt_.rank;
  const CallView v(c, n, r);
  const Wire w = c.wire;
  const int64_t B = kWireBlock;
  const size_t bb = wire_block_bytes(w);
  int64_t over = 0;

  if (n == 1) {  // the same two roundings as at any world size, a piece at a time
    const int64_t piece = 512 * B;
    wire_own_.resize(piece / B * bb);
    wire_res_.resize(piece / B * bb);
    for (int64_t i = 0; i < c.numel; i += piece) {
      const int64_t k = std::min(piece, c.numel - i);
      over += cpu::wire_encode(w, c.dtype, v.in + i * v.es, k, wire_own_.data());
      const void* src = wire_own_.data();
      over += cpu::wire_reduce(w, &src, 1, k, 1, v.ar ? wire_res_.data() : nullptr, c.dtype,
                               v.out + i * v.es);
    }
    return over;
  }

  if (v.ar && static_cast<size_t>(c.numel) * v.es <= kWireOneShotMaxBytes &&
      wire_span_bytes(w, c.numel) <= slice_bytes_) {
    // One-shot: every rank publishes its whole tensor on the wire and folds all N (the same
    // blocks, so the same bits as the two-shot schedule): one meeting instead of two.
    ctx.phase = "wire one-shot";
    const uint64_t bytes = wire_span_bytes(w, c.numel);
    wire_own_.resize(bytes);
    wire_res_.resize(bytes);
    const uint32_t ma = sent_;
    wait_all_consumed(ma + 1 - kSlots, ctx);
    over += cpu::wire_encode(w, c.dtype, v.in, c.numel, wire_own_.data());
    if (over) wire_flags_ |= kFlagOverflow;
    put(slot(r, ma) + sizeof(MsgHeader), wire_own_.data(), bytes);
    wide_until_ = ma + 1;
    post_send(ctx, bytes);
    srcs_.resize(n);
    for (int q = 0; q < n; ++q) {
      ctx.step = q;
      srcs_[q] = q == r ? wire_own_.data() : recv_wide(ctx, q, ma, bytes);
    }
    over += cpu::wire_reduce(w, srcs_.data(), n, c.numel, v.divisor, wire_res_.data(), c.dtype, v.out);
    release_wide(ma);
    // Every rank folded every input, so each knows every overflow.
    return over + ((wire_flags_ & kFlagOverflow) && !over ? 1 : 0);
  }
  const int64_t P = static_cast<int64_t>(slice_bytes_ / (n - 1) / bb);  // blocks per part
  if (P < 1)
    throw std::invalid_argument(
        "ringreduce: wire_dtype=" + std::string(wire_name(w)) + " needs slices of at least " +
        std::to_string((n - 1) * bb) + " bytes at world size " + std::to_string(n) +
        " (a block of " + std::to_string(B) + " elements per peer); RINGREDUCE_SLICE_BYTES is " +
        std::to_string(slice_bytes_));
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
  wire_own_.resize(P * bb);
  wire_res_.resize(P * bb);
  wire_tmp_.resize(P * bb);

  // This rank's slice j of every chunk onto the wire: the others' parts into one message, its own
  // into wire_own_ (so its flag covers all of its input once the last slice is published).
  auto publish = [&](int64_t j) {
    ctx.slice = j;
    ctx.phase = "wire reduce";
    ctx.step = 0;
    const uint32_t ma = sent_;
    wait_all_consumed(ma + 1 - kSlots, ctx);
    char* parts = slot(r, ma) + sizeof(MsgHeader);
    for (int k = 0; k < n; ++k) {
      const ring::Span sp = part(k, j);
      if (k == r) {
        over += cpu::wire_encode(w, c.dtype, v.in + sp.begin * v.es, sp.count, wire_own_.data());
        continue;
      }
      // Encoded here (L2), then put(): the slot gets the same stores as every other message
      // (non-temporal in the machine's slow state: Protocol::put).
      over += cpu::wire_encode(w, c.dtype, v.in + sp.begin * v.es, sp.count, wire_tmp_.data());
      put(parts + at(r, k), wire_tmp_.data(), wire_span_bytes(w, sp.count));
    }
    if (over) wire_flags_ |= kFlagOverflow;
    wide_until_ = ma + 1;
    post_send(ctx, parts_bytes(j));
  };
  srcs_.resize(n);
  publish(0);
  for (int64_t j = 0; j < ns; ++j) {
    const uint32_t ma = sent_ - 1;  // slice j's parts
    ctx.slice = j;
    ctx.phase = "wire reduce";
    const ring::Span mine = part(r, j);
    for (int q = 0; q < n; ++q) {
      ctx.step = q;
      srcs_[q] = q == r ? wire_own_.data() : recv_wide(ctx, q, ma, parts_bytes(j)) + at(q, r);
    }
    over += cpu::wire_reduce(w, srcs_.data(), n, mine.count, v.divisor,
                             v.ar ? wire_res_.data() : nullptr, c.dtype,
                             v.out + (mine.begin - v.out_shift) * v.es);
    if (over) wire_flags_ |= kFlagOverflow;
    release_wide(ma);
    if (!v.ar) {
      if (j + 1 < ns) publish(j + 1);
      continue;
    }
    ctx.phase = "wire gather";
    ctx.step = 0;
    const uint32_t mb = sent_;
    wait_all_consumed(mb + 1 - kSlots, ctx);
    const size_t rb = wire_span_bytes(w, mine.count);
    put(slot(r, mb) + sizeof(MsgHeader), wire_res_.data(), rb);
    wide_until_ = mb + 1;
    post_send(ctx, rb);
    // As in two-shot: slice j+1's input is unread by the copy-out below (it writes slice j only).
    if (j + 1 < ns) publish(j + 1);
    ctx.slice = j;
    ctx.phase = "wire gather";
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      ctx.step = q;
      const ring::Span sp = part(q, j);
      const char* src = recv_wide(ctx, q, mb, wire_span_bytes(w, sp.count));
      cpu::wire_decode(w, src, sp.count, c.dtype, v.out + sp.begin * v.es);
    }
    release_wide(mb);  // B(j) read; A(j+1) from the others is not (released next round)
  }
  // Every rank's last message carries what it learned from every rank's last parts.
  return over + ((wire_flags_ & kFlagOverflow) && !over ? 1 : 0);
}

}  // namespace shm
}  // namespace ringreduce
