// The two-level CUDA transport: see endpoint.h.
#include "cuda/hier/endpoint.h"

#include <algorithm>
#include <chrono>
#include <functional>

#include "cuda/host.h"

namespace ringreduce::cuda::hier {

Layout::Layout(const Options& o) : rank(o.rank), by_host(o.hosts) {
  nhosts = static_cast<int>(by_host.size());
  if (nhosts < 1) throw std::invalid_argument("ringreduce: two-level plan: no hosts");
  nlocal = static_cast<int>(by_host[0].size());
  std::vector<int> seen;
  for (int h = 0; h < nhosts; ++h) {
    if (static_cast<int>(by_host[h].size()) != nlocal || nlocal < 1)
      throw std::invalid_argument("ringreduce: two-level plan: every host needs the same number of "
                                  "ranks (got " + std::to_string(by_host[h].size()) + " on host " +
                                  std::to_string(h) + ", " + std::to_string(nlocal) + " on host 0)");
    for (int j = 0; j < nlocal; ++j) {
      seen.push_back(by_host[h][j]);
      if (by_host[h][j] == rank) host = h, local = j;
    }
  }
  nranks = nhosts * nlocal;
  std::sort(seen.begin(), seen.end());
  for (int r = 0; r < nranks; ++r)
    if (seen[r] != r) throw std::invalid_argument("ringreduce: two-level plan: the hosts' ranks are not 0.." +
                                                  std::to_string(nranks - 1) + " once each");
  if (rank < 0 || rank >= nranks) throw std::invalid_argument("ringreduce: two-level plan: bad rank");
}

std::string Layout::host_text(int h) const {
  std::string s = "host " + std::to_string(h) + " (rank" + (nlocal > 1 ? "s " : " ");
  for (int j = 0; j < nlocal; ++j) s += (j ? ", " : "") + std::to_string(by_host[h][j]);
  return s + ")";
}

Endpoint::Endpoint(const Options& o, std::unique_ptr<p2p::Endpoint> intra,
                   std::unique_ptr<nccl::Endpoint> cross)
    : opt_(o), layout_(o), intra_(std::move(intra)), cross_(std::move(cross)) {
  if (!intra_ || !cross_ || intra_->nranks() != layout_.nlocal || cross_->nranks() != layout_.nhosts)
    throw std::invalid_argument("ringreduce: two-level plan: the host's ring must have one rank per "
                                "local rank and the ring between hosts one per host");
  RR_CUDA_CHECK(cudaGetDevice(&device_));
  RR_CUDA_CHECK(cudaStreamCreateWithFlags(&x_, cudaStreamNonBlocking));
  RR_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  RR_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  // A slot holds a piece (its chunks reordered) and the piece's shard: piece + piece / L bytes. A
  // piece is at least 16 elements of 8 bytes per rank (piece_elems' unit).
  opt_.piece_bytes = std::max<size_t>(opt_.piece_bytes, 128 * static_cast<size_t>(layout_.nranks));
  const size_t piece = opt_.piece_bytes;
  slot_bytes_ = (piece + piece / layout_.nlocal + 255) / 256 * 256;
  // and at least a wire piece of one block per row, of 4-byte elements
  for (Wire w : {Wire::BF16, Wire::E4M3})
    slot_bytes_ = std::max<size_t>(slot_bytes_, wire_slot_bytes(w, 4, kWireBlock));
  RR_CUDA_CHECK(cudaMalloc(&pad_, static_cast<size_t>(layout_.nranks) * kWireBlock * 4));
  char* mem = nullptr;
  RR_CUDA_CHECK(cudaMalloc(&mem, slot_bytes_ * kSlots));
  for (int k = 0; k < kSlots; ++k) {
    slots_[k].buf = mem + k * slot_bytes_;
    for (cudaEvent_t* e : {&slots_[k].in_host, &slots_[k].between, &slots_[k].free})
      RR_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
  }
  watcher_ = std::thread([this] { watch(); });
}

Endpoint::~Endpoint() {
  try {
    close(false);
  } catch (...) {
  }
}

runtime::Caps Endpoint::caps() const {
  runtime::Caps k;
  k.device = true;
  k.two_phase_close = true;  // the host's ranks map each other
  k.polls = true;            // NCCL's asynchronous errors, between hosts
  k.run_waits = true;        // NCCL's groups settle on the host
  k.wire = true;             // between hosts: all_reduce on a bfloat16 or float8 wire
  k.wire_reduce_scatter = false;
  k.wire_f16 = false;        // float16's overflow check is not built there
  return k;
}

runtime::Transport& Endpoint::local() { return *intra_; }

Plan Endpoint::plan(const Call& c) {
  if (c.deterministic)
    throw RingError("ringreduce: deterministic mode reduces in rank order, which the two-level plan "
                    "(each host's partial sum first) cannot: this group must run the flat nccl ring "
                    "(RINGREDUCE_TRANSPORT=nccl, or set deterministic mode before the group's first call)");
  Plan p;
  p.algo = Algo::TwoLevel;
  return p;
}

std::string Endpoint::failure() {
  // Between hosts first: a lost host stops this host's ranks too (watch()), and then the reason
  // that names the host is the one to give on every rank of it.
  const std::string x = cross_->failure();
  if (!x.empty()) {
    // The other hosts of this rank's ring (NCCL's groups do not say which peer never came).
    std::string others;
    for (int h = 0, k = 0; h < layout_.nhosts; ++h)
      if (h != layout_.host) others += (k++ ? ", " : "") + layout_.host_text(h);
    return "ringreduce: rank " + std::to_string(layout_.rank) + " (" + layout_.host_text(layout_.host) +
           ", local rank " + std::to_string(layout_.local) + "): the step between hosts failed, with " +
           (layout_.nhosts == 2 ? "the other host, " : "one of the other hosts: ") + others +
           " (NCCL among local rank " + std::to_string(layout_.local) + " of every host; its rank h is host h): " + x;
  }
  return intra_->failure();
}

uint64_t Endpoint::failed_seq() {
  const uint64_t a = intra_->failed_seq(), b = cross_->failed_seq();
  if (!a && !b) return 0;
  std::lock_guard<std::mutex> lk(mu_);
  // The first of our calls that contains an inner call that failed.
  for (const Ends& e : ends_)
    if ((a && e.intra >= a) || (b && e.cross >= b)) return e.seq;
  return ends_.empty() ? op_seq_.load() : ends_.back().seq + 1;
}

void Endpoint::abort(const std::string& why) {
  intra_->abort(why);
  cross_->abort(why);
}

void Endpoint::watch_peers(std::vector<runtime::Peer> peers) {
  // Only this host's ranks can be seen; they are the host's ring's ranks (by local rank).
  std::vector<runtime::Peer> local;
  for (const runtime::Peer& p : peers)
    for (int j = 0; j < layout_.nlocal; ++j)
      if (layout_.by_host[layout_.host][j] == p.rank) local.push_back({j, p.pid});
  intra_->watch_peers(local);
}

void Endpoint::watch() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!cv_.wait_for(lk, nccl::kWatchPeriod, [this] { return stop_; })) {
    lk.unlock();
    const std::string x = cross_->failure();
    if (!x.empty() && intra_->failure().empty())
      intra_->abort("the step between hosts failed on local rank " + std::to_string(layout_.local) +
                    ": " + x);
    lk.lock();
  }
}

void Endpoint::stop_threads() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watcher_.joinable()) watcher_.join();
  intra_->stop_threads();
  cross_->stop_threads();
}

bool Endpoint::unmap_peers() {
  DeviceScope scope(device_);
  cudaStreamSynchronize(x_);
  return intra_->unmap_peers();
}

void Endpoint::close(bool peers_done) {
  if (closed_) return;
  stop_threads();
  DeviceScope scope(device_);
  cudaStreamSynchronize(x_);
  cross_->close(peers_done);
  intra_->close(peers_done);
  // Our stream and slots: the device is done with them (x_ synchronized; the caller's stream
  // waited for every event of ours before a call returned its work).
  if (slots_[0].buf) cudaFree(slots_[0].buf);
  if (pad_) cudaFree(pad_);
  for (Slot& s : slots_)
    for (cudaEvent_t e : {s.in_host, s.between, s.free})
      if (e) cudaEventDestroy(e);
  cudaEventDestroy(ready_);
  cudaEventDestroy(done_);
  cudaStreamDestroy(x_);
  closed_ = true;
}

// ---- the calls ------------------------------------------------------------------------------

void Endpoint::pipeline(int64_t pieces, cudaStream_t s, bool first_on_caller, const Leg& first,
                        const Leg& second, const Leg& third) {
  // first on a, second on b, third on s; piece p + 1's first leg is issued before piece p's
  // third, so that the two streams work at once.
  cudaStream_t a = first_on_caller ? s : x_, b = first_on_caller ? x_ : s;
  if (a == x_) {  // the call's input was made on the caller's stream
    RR_CUDA_CHECK(cudaEventRecord(ready_, s));
    RR_CUDA_CHECK(cudaStreamWaitEvent(x_, ready_, 0));
  }
  auto after = [](cudaEvent_t e, cudaStream_t from, cudaStream_t to) {
    if (from == to) return;
    RR_CUDA_CHECK(cudaEventRecord(e, from));
    RR_CUDA_CHECK(cudaStreamWaitEvent(to, e, 0));
  };
  auto finish = [&](int64_t p) {
    Slot& k = slots_[p % kSlots];
    if (b != s) RR_CUDA_CHECK(cudaStreamWaitEvent(s, k.between, 0));  // recorded after its second leg
    third(p, k, s);
    RR_CUDA_CHECK(cudaEventRecord(k.free, s));
    k.used = true;
  };
  for (int64_t p = 0; p < pieces; ++p) {
    Slot& k = slots_[p % kSlots];
    if (k.used) RR_CUDA_CHECK(cudaStreamWaitEvent(a, k.free, 0));  // its last reader is done
    first(p, k, a);
    after(k.in_host, a, b);
    second(p, k, b);
    if (b != s) RR_CUDA_CHECK(cudaEventRecord(k.between, b));  // here, not later: only piece p's legs
    if (p > 0) finish(p - 1);
  }
  if (pieces > 0) finish(pieces - 1);
}

// Elements per piece: whole units, a piece's bytes at most piece_bytes (at least one unit).
static int64_t piece_elems(size_t piece_bytes, size_t es, int64_t unit) {
  const int64_t fit = static_cast<int64_t>(piece_bytes / es) / unit * unit;
  return std::max(unit, fit);
}

void Endpoint::all_reduce(const Call& c, cudaStream_t s) {
  const int L = layout_.nlocal, N = layout_.nranks;
  const size_t es = dtype_size(c.dtype);
  const RedOp red = c.op == RedOp::Avg ? RedOp::Sum : c.op;
  const int64_t M = c.numel / L * L, P = piece_elems(opt_.piece_bytes, es, 16 * L);
  const char* in = static_cast<const char*>(c.in);
  char* out = static_cast<char*>(c.out);
  auto len = [&](int64_t p) { return std::min(P, M - p * P); };
  pipeline(
      (M + P - 1) / P, s, true,
      [&](int64_t p, Slot& k, cudaStream_t st) {  // reduce-scatter inside the host
        intra_->run(sub_call(c, Coll::ReduceScatter, c.dtype, red, len(p), in + p * P * es, k.buf), st);
      },
      [&](int64_t p, Slot& k, cudaStream_t st) {  // the shard between hosts
        const int64_t q = len(p) / L;
        cross_->run(sub_call(c, Coll::AllReduce, c.dtype, red, q, k.buf, k.buf), st);
        if (c.op == RedOp::Avg) launch_divide(c.dtype, k.buf, q, N, st);
      },
      [&](int64_t p, Slot& k, cudaStream_t st) {  // all-gather inside the host
        intra_->run(sub_call(c, Coll::AllGather, c.dtype, RedOp::Sum, len(p), k.buf, out + p * P * es), st);
      });
  const int64_t r = c.numel - M;  // under L elements: reduced inside the host, then between hosts
  if (r == 0) return;
  intra_->run(sub_call(c, Coll::AllReduce, c.dtype, red, r, in + M * es, out + M * es), s);
  RR_CUDA_CHECK(cudaEventRecord(ready_, s));
  RR_CUDA_CHECK(cudaStreamWaitEvent(x_, ready_, 0));
  cross_->run(sub_call(c, Coll::AllReduce, c.dtype, red, r, out + M * es, out + M * es), x_);
  if (c.op == RedOp::Avg) launch_divide(c.dtype, out + M * es, r, N, x_);
  RR_CUDA_CHECK(cudaEventRecord(done_, x_));
  RR_CUDA_CHECK(cudaStreamWaitEvent(s, done_, 0));
}

// Pieces of a reduce_scatter / all_gather: elements [a, a + k) of every rank's chunk of m.
void Endpoint::reduce_scatter(const Call& c, cudaStream_t s) {
  const int L = layout_.nlocal, H = layout_.nhosts, N = layout_.nranks;
  const size_t es = dtype_size(c.dtype);
  const RedOp red = c.op == RedOp::Avg ? RedOp::Sum : c.op;
  const int64_t m = c.numel / N, K = piece_elems(opt_.piece_bytes / N, es, 16);
  const char* in = static_cast<const char*>(c.in);
  char* out = static_cast<char*>(c.out);
  auto len = [&](int64_t p) { return std::min(K, m - p * K); };
  pipeline(
      (m + K - 1) / K, s, true,
      [&](int64_t p, Slot& sl, cudaStream_t st) {  // the piece in (local rank, host) order, reduced inside the host
        const int64_t k = len(p);
        for (int j = 0; j < L; ++j)
          for (int h = 0; h < H; ++h)
            RR_CUDA_CHECK(cudaMemcpyAsync(sl.buf + (j * H + h) * k * es,
                                          in + (layout_.by_host[h][j] * m + p * K) * es, k * es,
                                          cudaMemcpyDeviceToDevice, st));
        intra_->run(sub_call(c, Coll::ReduceScatter, c.dtype, red, N * k, sl.buf, sl.buf + N * k * es), st);
      },
      [&](int64_t p, Slot& sl, cudaStream_t st) {  // this rank's chunk from every host's partial
        const int64_t k = len(p);
        char* dst = out + p * K * es;
        cross_->run(sub_call(c, Coll::ReduceScatter, c.dtype, red, H * k, sl.buf + N * k * es, dst), st);
        if (c.op == RedOp::Avg) launch_divide(c.dtype, dst, k, N, st);
      },
      [](int64_t, Slot&, cudaStream_t) {});
}

void Endpoint::all_gather(const Call& c, cudaStream_t s) {
  const int L = layout_.nlocal, H = layout_.nhosts, N = layout_.nranks;
  const size_t es = dtype_size(c.dtype);
  const int64_t m = c.numel / N, K = piece_elems(opt_.piece_bytes / N, es, 16);
  const char* in = static_cast<const char*>(c.in);
  char* out = static_cast<char*>(c.out);
  auto len = [&](int64_t p) { return std::min(K, m - p * K); };
  pipeline(
      (m + K - 1) / K, s, false,
      [&](int64_t p, Slot& sl, cudaStream_t st) {  // local rank j's piece from every host
        const int64_t k = len(p);
        cross_->run(sub_call(c, Coll::AllGather, c.dtype, RedOp::Sum, H * k, in + p * K * es, sl.buf), st);
      },
      [&](int64_t p, Slot& sl, cudaStream_t st) {  // every local rank's, in (local rank, host) order
        const int64_t k = len(p);
        intra_->run(sub_call(c, Coll::AllGather, c.dtype, RedOp::Sum, N * k, sl.buf, sl.buf + H * k * es), st);
      },
      [&](int64_t p, Slot& sl, cudaStream_t st) {  // into the group's rank order
        const int64_t k = len(p);
        for (int j = 0; j < L; ++j)
          for (int h = 0; h < H; ++h)
            RR_CUDA_CHECK(cudaMemcpyAsync(out + (layout_.by_host[h][j] * m + p * K) * es,
                                          sl.buf + (H + j * H + h) * k * es, k * es,
                                          cudaMemcpyDeviceToDevice, st));
      });
}

static uint64_t up256(uint64_t x) { return (x + 255) / 256 * 256; }

uint64_t Endpoint::wire_slot_bytes(Wire w, size_t es, int64_t n) const {
  const uint64_t H = static_cast<uint64_t>(layout_.nhosts), rb = wire_row_bytes(w, n);
  return up256(H * n * es) + up256(H * rb) + H * H * rb;
}

void Endpoint::all_reduce_wire(const Call& c, cudaStream_t s) {
  const int L = layout_.nlocal, H = layout_.nhosts, N = layout_.nranks;
  const size_t es = dtype_size(c.dtype);
  const Wire w = c.wire;
  // A piece: L * H rows of n elements, n whole wire blocks (the blocks then lie on the tensor's
  // grid of 128, so the bits do not depend on the piece size), within piece_bytes and a slot.
  const int64_t unit = static_cast<int64_t>(L) * H * kWireBlock;
  int64_t n = std::max<int64_t>(kWireBlock, static_cast<int64_t>(opt_.piece_bytes / es) / unit * kWireBlock);
  while (n > kWireBlock && wire_slot_bytes(w, es, n) > slot_bytes_) n = std::max<int64_t>(kWireBlock, n / 2 / kWireBlock * kWireBlock);
  const int64_t P = static_cast<int64_t>(L) * H * n, M = c.numel / unit * unit, tail = c.numel - M;
  const int64_t main_pieces = (M + P - 1) / P, pieces = main_pieces + (tail > 0);
  const char* in = static_cast<const char*>(c.in);
  char* out = static_cast<char*>(c.out);
  auto len = [&](int64_t p) { return p < main_pieces ? std::min(P, M - p * P) : unit; };
  auto src = [&](int64_t p) { return p < main_pieces ? in + p * P * es : pad_; };
  auto dst = [&](int64_t p) { return p < main_pieces ? out + p * P * es : pad_; };
  pipeline(
      pieces, s, true,
      [&](int64_t p, Slot& k, cudaStream_t st) {  // the host's partial sums
        if (p == main_pieces) {  // the tail, then zeros (which move no block's largest value)
          RR_CUDA_CHECK(cudaMemsetAsync(pad_, 0, unit * es, st));
          RR_CUDA_CHECK(cudaMemcpyAsync(pad_, in + M * es, tail * es, cudaMemcpyDeviceToDevice, st));
        }
        intra_->run(sub_call(c, Coll::ReduceScatter, c.dtype, RedOp::Sum, len(p), src(p), k.buf), st);
      },
      [&](int64_t p, Slot& k, cudaStream_t st) {  // onto the wire, to every host, folded, rounded
        const int64_t rn = len(p) / (static_cast<int64_t>(L) * H);  // a row's elements
        const uint64_t rb = wire_row_bytes(w, rn);
        char* send = k.buf + up256(static_cast<uint64_t>(H) * rn * es);
        char* got = send + up256(H * rb);
        if (c.op == RedOp::Avg) launch_divide(c.dtype, k.buf, H * rn, N, st);
        launch_wire_put(c.dtype, w, k.buf, H, rn, send, st);
        cross_->run(sub_call(c, Coll::AllGather, DType::U8, RedOp::Sum, static_cast<int64_t>(H * H * rb), send, got), st);
        launch_wire_fold(c.dtype, w, got, H, H, rn, k.buf, st);
      },
      [&](int64_t p, Slot& k, cudaStream_t st) {  // every rank gets the piece
        intra_->run(sub_call(c, Coll::AllGather, c.dtype, RedOp::Sum, len(p), k.buf, dst(p)), st);
        if (p == main_pieces)
          RR_CUDA_CHECK(cudaMemcpyAsync(out + M * es, pad_, tail * es, cudaMemcpyDeviceToDevice, st));
      });
}

void Endpoint::run(const Call& c, cudaStream_t stream) {
  if (closed_) throw closed_error();
  runtime::check_call(c, layout_.nranks, failure());
  runtime::check_wire(caps(), name(), c);
  plan(c);
  DeviceScope scope(device_);
  const uint64_t seq = ++op_seq_;
  if (c.numel > 0) {
    switch (c.coll) {
      case Coll::AllReduce: c.wire != Wire::None ? all_reduce_wire(c, stream) : all_reduce(c, stream); break;
      case Coll::ReduceScatter: reduce_scatter(c, stream); break;
      case Coll::AllGather: all_gather(c, stream); break;
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  ends_.push_back({seq, intra_->op_seq(), cross_->op_seq()});
  if (ends_.size() > 4096) ends_.pop_front();
}

}  // namespace ringreduce::cuda::hier
