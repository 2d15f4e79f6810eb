#include "shm/protocol.h"

#include <sys/prctl.h>
#include <unistd.h>

#include <cstring>
#include <stdexcept>

#include "cpu/reduce.h"
#include "ring/loop.h"
#include "ring/schedule.h"
#include "runtime/transport.h"

namespace ringreduce {
namespace shm {
namespace {

bool uses_cma(const Options& o) {
  if (o.algo == Algo::Cma) return true;
  for (const Step& s : o.steps)
    if (s.algo == Algo::Cma) return true;
  return false;
}

// The ring's primitives (ring/loop.h) on the slots: a send is posted when it is made.
struct RingPrims {
  Mailbox& mail;
  Writer& writer;
  const Call& c;
  Ctx& ctx;
  const size_t es;

  void at(const char* phase, int step, int64_t slice) {
    ctx.phase = phase;
    ctx.step = step;
    ctx.slice = slice;
  }
  void send(const char* src, int64_t n) {
    char* d = mail.acquire_send(ctx);
    writer.put(d, src, n * es);
    mail.post_send(ctx, n * es);
  }
  void recv_reduce_send(const char* own, int64_t n) {
    const char* src = mail.recv(ctx, n * es);
    char* d = mail.acquire_send(ctx);
    cpu::reduce(c.dtype, c.op, d, src, own, n);
    mail.post_send(ctx, n * es);
    mail.release_recv();
  }
  void recv_reduce_copy(const char* own, char* dst, int64_t n, int divisor, bool and_send) {
    const char* src = mail.recv(ctx, n * es);
    cpu::reduce(c.dtype, c.op, dst, src, own, n, divisor);
    if (and_send) send(dst, n);
    mail.release_recv();
  }
  void recv_copy(char* dst, int64_t n, bool and_send) {
    const char* src = mail.recv(ctx, n * es);
    std::memcpy(dst, src, n * es);
    if (and_send) send(src, n);
    mail.release_recv();
  }
  void copy(char* dst, const char* src, int64_t n) { std::memmove(dst, src, n * es); }
};

}  // namespace

void run_ring(Parts& p, const Call& c, Ctx& ctx) {
  const size_t es = dtype_size(c.dtype);
  RingPrims prims{p.mail, p.writer, c, ctx, es};
  ring::run_ring(c, p.n, p.rank, std::max<int64_t>(1, static_cast<int64_t>(p.slice_bytes() / es)), prims);
}

GroupHeader* Protocol::checked(void* base, size_t bytes, const Options& opt) {
  auto* hdr = static_cast<GroupHeader*>(base);
  if (opt.nranks < 1 || opt.rank < 0 || opt.rank >= opt.nranks)
    throw std::invalid_argument("ringreduce: rank " + std::to_string(opt.rank) + " out of range for " +
                                std::to_string(opt.nranks) + " ranks");
  if (hdr->magic != kMagic || hdr->nranks != static_cast<uint32_t>(opt.nranks))
    throw RingError("ringreduce: shared segment is not an initialised ring of " +
                    std::to_string(opt.nranks) + " ranks");
  if (bytes < segment_bytes(opt.nranks, hdr->slice_bytes))
    throw RingError("ringreduce: shared segment too small for its ring");
  return hdr;
}

Protocol::Protocol(void* base, size_t bytes, const Options& opt)
    : opt_(opt), hdr_(checked(base, bytes, opt)), areas_(areas_of(base)), waits_(hdr_, areas_, opt),
      writer_(opt.stream), mail_(base, opt, waits_, writer_) {
  areas_[opt.rank].probe.store(reinterpret_cast<uint64_t>(&kProbeWord));
  areas_[opt.rank].pid.store(static_cast<int32_t>(getpid()));
  // Where Yama restricts ptrace to descendants, let the peers read this process (cma only).
  if (uses_cma(opt)) prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
}

const Step* Protocol::step_of(const Call& c) const {
  if (c.coll != Coll::AllReduce) return nullptr;
  const uint64_t bytes = static_cast<uint64_t>(c.numel) * dtype_size(c.dtype);
  const Step* at = nullptr;
  for (const Step& s : opt_.steps)
    if (bytes >= s.from_bytes) at = &s;
  return at;
}

uint64_t Protocol::cma_block(const Call& c) const {
  const Step* s = opt_.algo == Algo::Auto ? step_of(c) : nullptr;
  return s && s->algo == Algo::Cma && s->cma_whole ? 0 : opt_.cma_block_bytes;
}

Algo Protocol::choose(const Call& c, const Pool* pool) const {
  if (c.wire != Wire::None && c.coll != Coll::AllGather) return Algo::Wire;
  if (opt_.nranks == 1 || c.coll == Coll::AllGather) return Algo::Ring;  // nothing to reduce
  const bool ar = c.coll == Coll::AllReduce;
  // A pool tensor's all-reduce reads the peers' copies in place (rank order, so deterministic
  // too), unless an algorithm is forced.
  if (pool && ar && c.in == c.out && opt_.algo == Algo::Auto) return Algo::Pool;
  const uint64_t bytes = static_cast<uint64_t>(c.numel) * dtype_size(c.dtype);
  const bool small = ar && bytes <= opt_.oneshot_max_bytes;
  const Step* step = step_of(c);
  const Algo big = step ? step->algo : Algo::Ring;  // Auto above the one-shot threshold
  if (opt_.algo == Algo::Cma) return Algo::Cma;  // rank order as well
  if (c.deterministic) {  // rank order whatever RINGREDUCE_ALGO says
    if (opt_.algo == Algo::OneShot && ar) return Algo::OneShot;
    if (opt_.algo == Algo::TwoShot) return Algo::TwoShot;
    if (small) return Algo::OneShot;
    return opt_.algo == Algo::Auto && big == Algo::Cma ? Algo::Cma : Algo::TwoShot;
  }
  switch (opt_.algo) {
    case Algo::OneShot: return ar ? Algo::OneShot : Algo::Ring;  // one-shot: all-reduce only
    case Algo::Auto: return small ? Algo::OneShot : big;
    default: return opt_.algo;
  }
}

void Protocol::run(const Call& c, Algo algo, const std::function<bool()>* interrupted, const Pool* pool) {
  waits_.begin(op_seq_ + 1, interrupted);  // broken between calls: this one fails first
  const int n = opt_.nranks, r = opt_.rank;
  runtime::check_call(c, n, broken() ? abort_reason() : std::string());
  ++op_seq_;
  mail_.begin(algo);
  Parts parts{waits_, mail_, writer_, scratch_, r, n};
  if (algo == Algo::Wire) {
    Ctx ctx{c, op_seq_, "wire", 0, 0};
    if (run_wire(parts, c, ctx))
      throw std::overflow_error(
          std::string("ringreduce: ") + coll_name(c.coll) + "(wire_dtype=float16): a finite value "
          "beyond float16's range (65504) on the wire (an input, or a sum) of some rank; the result "
          "holds inf there. Divide first (op=AVG), or use wire_dtype=torch.bfloat16 (float32's range)");
    return;
  }
  const CallView v(c, n, r);
  if (n == 1) {
    if (c.op == RedOp::Avg || v.in != v.out) cpu::divide(c.dtype, v.out, v.in, c.numel, 1);
    return;
  }
  Ctx ctx{c, op_seq_, "reduce-scatter", 0, 0};
  switch (algo) {
    case Algo::OneShot: return run_oneshot(parts, c, ctx);
    case Algo::TwoShot: return run_twoshot(parts, c, ctx);
    case Algo::Cma: return run_cma(parts, c, ctx, cma_block(c));
    case Algo::Pool: return run_pool(parts, c, ctx, *pool);
    default: return run_ring(parts, c, ctx);
  }
}

}  // namespace shm
}  // namespace ringreduce
