#include "shm/mailbox.h"

#include <chrono>
#include <cstdio>
#include <cstring>

#include "cpu/reduce.h"

namespace ringreduce {
namespace shm {
namespace {

std::string describe(uint8_t coll, uint8_t dtype, uint8_t op, int64_t numel, uint8_t wire = 0) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "%s(numel=%lld, dtype=%s, op=%s%s%s)", coll_name(Coll(coll)),
                static_cast<long long>(numel), dtype_name(DType(dtype)), op_name(RedOp(op)),
                wire ? ", wire_dtype=" : "", wire ? wire_name(Wire(wire)) : "");
  return buf;
}

}  // namespace

// On this VM an ordinary store to a line another core has cached is sometimes ~20x slower than
// usual for seconds at a time (the peers harness saw it on the AMD machine); non-temporal stores do not slow down
// then, but cost 2-3x the fast state's time (the reader fetches the data from memory). So copy
// with ordinary stores, time each copy, and stream for a while after a run of slow ones.
void Writer::put(void* dst, const void* src, size_t bytes) {
  using Opt = Options::Stream;
  if (bytes < kStreamMinBytes || mode_ == Opt::Never) return (void)std::memcpy(dst, src, bytes);
  if (mode_ == Opt::Always) return cpu::copy_stream(dst, src, bytes);
  const auto ns = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  };
  const int64_t t0 = ns();
  if (t0 < stream_until_ns_) return cpu::copy_stream(dst, src, bytes);
  std::memcpy(dst, src, bytes);
  const int64_t t1 = ns();
  // One slow copy is an interrupt or a preemption; the slow state makes every copy slow.
  slow_copies_ = static_cast<uint64_t>(t1 - t0) * kSlowBytesPerNs > bytes ? slow_copies_ + 1 : 0;
  if (slow_copies_ >= kSlowCopiesToStream) {
    slow_copies_ = 0;
    stream_until_ns_ = t1 + kStreamHoldNs;
    switches_.fetch_add(1, std::memory_order_relaxed);
  }
}

Mailbox::Mailbox(void* base, const Options& opt, Waits& waits, Writer& writer)
    : waits_(waits), writer_(writer), areas_(areas_of(base)),
      slots_(reinterpret_cast<char*>(areas_ + opt.nranks)),
      slice_bytes_(static_cast<GroupHeader*>(base)->slice_bytes), slot_stride_(slot_stride(slice_bytes_)),
      rank_(opt.rank), nranks_(opt.nranks), up_(ring::mod(opt.rank - 1, opt.nranks)),
      down_(ring::mod(opt.rank + 1, opt.nranks)) {}

char* Mailbox::acquire_send(const Ctx& ctx) {
  // The message this slot held was read by the downstream rank only, or by every rank (wide).
  if (static_cast<int32_t>(wide_until_ - (sent_ - kSlots)) > 0)
    wait_all_consumed(sent_ + 1 - kSlots, ctx);
  else
    waits_.wait_ge(areas_[down_].consumed, sent_ + 1 - kSlots, down_, ctx, "a free slot, consumed by");
  return slot(rank_, sent_) + sizeof(MsgHeader);
}

void Mailbox::wait_all_consumed(uint32_t target, const Ctx& ctx) {
  for (int k = 0; k < nranks_; ++k)
    if (k != rank_) waits_.wait_ge(areas_[k].consumed, target, k, ctx, "a free slot, consumed by");
}

void Mailbox::post_send(const Ctx& ctx, uint64_t nbytes) {
  auto* h = reinterpret_cast<MsgHeader*>(slot(rank_, sent_));
  h->op_seq = ctx.seq;
  h->numel = ctx.call.numel;
  h->nbytes = nbytes;
  h->index = msg_in_call_++;
  h->coll = static_cast<uint8_t>(ctx.call.coll);
  h->dtype = static_cast<uint8_t>(ctx.call.dtype);
  h->op = static_cast<uint8_t>(ctx.call.op);
  h->algo = static_cast<uint8_t>(algo_);
  h->wire = static_cast<uint8_t>(ctx.call.wire);
  h->flags = flags_;
  post(areas_[rank_].posted, ++sent_);
}

const char* Mailbox::recv(const Ctx& ctx, uint64_t expect_bytes) {
  waits_.wait_ge(areas_[up_].posted, received_ + 1, up_, ctx, "a message from");
  const char* s = slot(up_, received_);
  check_header(ctx, up_, reinterpret_cast<const MsgHeader*>(s), expect_bytes);
  return s + sizeof(MsgHeader);
}

void Mailbox::release_recv() { post(areas_[rank_].consumed, ++received_); }

char* Mailbox::begin_wide(const Ctx& ctx) {
  wait_all_consumed(sent_ + 1 - kSlots, ctx);
  return slot(rank_, sent_) + sizeof(MsgHeader);
}

uint32_t Mailbox::post_wide(const Ctx& ctx, uint64_t nbytes) {
  const uint32_t m = sent_;
  wide_until_ = m + 1;  // before the post: from here this slot is read by every rank
  post_send(ctx, nbytes);
  return m;
}

uint32_t Mailbox::say_wide(const Ctx& ctx, const void* payload, uint64_t bytes) {
  char* d = begin_wide(ctx);
  if (bytes) std::memcpy(d, payload, bytes);
  return post_wide(ctx, bytes);
}

const char* Mailbox::recv_wide(const Ctx& ctx, int from, uint32_t m, uint64_t expect_bytes) {
  waits_.wait_ge(areas_[from].posted, m + 1, from, ctx, "a message from");
  const char* s = slot(from, m);
  check_header(ctx, from, reinterpret_cast<const MsgHeader*>(s), expect_bytes);
  return s + sizeof(MsgHeader);
}

void Mailbox::release_wide(uint32_t m) {
  received_ = m + 1;
  post(areas_[rank_].consumed, received_);
}

void Mailbox::check_header(const Ctx& ctx, int from, const MsgHeader* h, uint64_t expect_bytes) {
  const Call& c = ctx.call;
  const auto coll = static_cast<uint8_t>(c.coll), dt = static_cast<uint8_t>(c.dtype),
             op = static_cast<uint8_t>(c.op), wire = static_cast<uint8_t>(c.wire);
  if (h->op_seq != ctx.seq || h->coll != coll || h->dtype != dt || h->op != op ||
      h->numel != c.numel || h->wire != wire)
    waits_.fail(ctx, "ringreduce: mismatched collective calls: rank " + std::to_string(from) + " called " +
                         describe(h->coll, h->dtype, h->op, h->numel, h->wire) + " as its call #" +
                         std::to_string(h->op_seq) + " on this communicator, while rank " +
                         std::to_string(rank_) + " called " + describe(coll, dt, op, c.numel, wire) +
                         " as its call #" + std::to_string(ctx.seq));
  flags_ |= h->flags;
  if (h->algo != static_cast<uint8_t>(algo_))
    waits_.fail(ctx, "ringreduce: rank " + std::to_string(from) + " ran " + describe(coll, dt, op, c.numel) +
                         " with the " + algo_name(Algo(h->algo)) + " algorithm and rank " +
                         std::to_string(rank_) + " with " + algo_name(algo_) +
                         " (set RINGREDUCE_ALGO and RINGREDUCE_DETERMINISTIC the same on every rank, "
                         "and pass a ringreduce.shared_empty tensor on every rank or on none)");
  if (h->nbytes != expect_bytes)
    waits_.fail(ctx, "ringreduce: rank " + std::to_string(rank_) + ": message of " +
                         std::to_string(h->nbytes) + " bytes from rank " + std::to_string(from) + " where " +
                         std::to_string(expect_bytes) + " were expected (inconsistent schedules)");
}

}  // namespace shm
}  // namespace ringreduce
