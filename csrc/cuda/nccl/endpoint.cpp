// The endpoint: the communicator's life (init, finalize, abort), its calls' groups and NCCL's
// results, and what each call leaves in flight (inflight.h) for the watchdog (watchdog.cpp).
#include "cuda/nccl/endpoint.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "cuda/host.h"
#include "cuda/nccl/library.h"
#include "ring/schedule.h"

namespace ringreduce::cuda::nccl {
namespace {

// settle()'s backoff. It polls without sleeping for the first kSpinFor: a non-blocking
// ncclGroupEnd of p2p calls to connected peers settles in a few to ~20 us, and any sleep costs at
// least Linux's default timer slack (50 us). Longer waits (connection setup, init, finalize, a
// peer that is late) then sleep 1, 2, 4 ... us, at most kMaxPollSleep: it bounds the delay a
// sleep adds to a few hundred us while polling at most a few thousand times a second.
constexpr auto kSpinFor = std::chrono::microseconds(50);
constexpr auto kMaxPollSleep = std::chrono::microseconds(256);

}  // namespace

Algo plan(const Call& c, const Options& o) { return plan(c, o, c.deterministic); }

std::string Endpoint::seconds(double s) {
  char t[32];
  std::snprintf(t, sizeof t, "%g", s);
  return t;
}

std::string Endpoint::rank_text() const { return "ringreduce: rank " + std::to_string(opt_.rank) + ": "; }

Endpoint::Endpoint(const Options& opt, const std::string& id) : opt_(opt) {
  if (opt.nranks < 1 || opt.rank < 0 || opt.rank >= opt.nranks)
    throw std::invalid_argument("ringreduce: rank out of range");
  if (id.size() != sizeof(ncclUniqueId)) throw RingError("ringreduce: bad NCCL unique id");
  // run() cuts chunks into staging_bytes / element-size pieces: fewer bytes than one element of the
  // widest dtype (8) would divide by zero there (RINGREDUCE_NCCL_STAGING_BYTES is a test knob).
  if (opt.staging_bytes < 16)
    throw std::invalid_argument("ringreduce: nccl staging_bytes must be at least 16, got " +
                                std::to_string(opt.staging_bytes));
  const Api& nc = api(opt.lib);
  RR_CUDA_CHECK(cudaGetDevice(&device_));
  try {
    // One allocation (see Groups). The second buffer starts 256-byte aligned, as a cudaMalloc would.
    const size_t first = round_up(opt.staging_bytes, 256);
    void* p = nullptr;
    RR_CUDA_CHECK(cudaMalloc(&p, first + opt.staging_bytes));
    groups_.staging[0] = static_cast<char*>(p);
    groups_.staging[1] = groups_.staging[0] + first;
    groups_.rank = opt.rank;
    groups_.nranks = opt.nranks;
    groups_.staging_bytes = opt.staging_bytes;
    groups_.post = [this](const std::vector<P2p>& ops, cudaStream_t s) { group(ops, s); };
    if (opt.nranks > 1) {
      ncclUniqueId uid;
      std::memcpy(uid.internal, id.data(), sizeof uid.internal);
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;  // every call returns; we poll with a deadline (settle) and can abort
      std::lock_guard<std::mutex> lk(mu_);
      ncclComm_t comm = nullptr;
      const ncclResult_t r = nc.init_rank_config(&comm, opt.nranks, uid, opt.rank, &config);
      comm_ = comm;
      if (r != ncclSuccess && r != ncclInProgress) nccl_check(r, "ncclCommInitRankConfig");
      settle("ncclCommInitRankConfig (did every rank of the group create the communicator?)");
    }
  } catch (...) {
    close();
    throw;
  }
  watchdog_ = std::thread([this] { watch(); });
}

Endpoint::~Endpoint() {
  try {
    close();
  } catch (...) {
  }
}

void Endpoint::fail_locked(const std::string& why) {
  set_failure(why);
  if (comm_) api(opt_.lib).abort(comm_);  // makes NCCL's kernels return; the comm is gone after
  comm_ = nullptr;
  abort_requested_ = false;
}

void Endpoint::nccl_check(int res, const char* what) {
  if (res == ncclSuccess) return;
  const Api& nc = api(opt_.lib);
  std::string msg = rank_text() + what + " failed: " + error_text(nc, static_cast<ncclResult_t>(res), comm_);
  if (res == ncclInvalidUsage)  // NCCL's usual reason: two ranks of the group on one GPU
    msg += ". If ranks of the group share a GPU: NCCL >= 2.30 accepts that with "
           "NCCL_MULTI_RANK_GPU_ENABLE=1 set on every rank; or use RINGREDUCE_TRANSPORT=p2p, which "
           "moves data between ranks on one GPU through CUDA IPC";
  // Mismatched calls are the cause of a truncated message: say so where the descriptors show it.
  const std::string mismatch = known_mismatch();
  if (!mismatch.empty()) msg = mismatch;
  set_failure(msg, inflight_.first_unretired());
  fail_locked(msg);
  throw RingError(msg);
}

void Endpoint::settle(const char* what) {
  const Api& nc = api(opt_.lib);
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(opt_.timeout_s));
  std::chrono::nanoseconds nap = std::chrono::microseconds(1);
  for (;;) {
    if (!comm_) throw RingError(failure());
    if (abort_requested_) {
      fail_locked(failure());
      throw RingError(failure());
    }
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = nc.async_error(comm_, &state);
    if (r != ncclSuccess) nccl_check(r, "ncclCommGetAsyncError");
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) nccl_check(state, what);
    const auto now = Clock::now();
    if (now > deadline) {
      std::string msg = known_mismatch();
      if (msg.empty())
        msg = rank_text() + what + " timed out after " + seconds(opt_.timeout_s) + " s (RINGREDUCE_TIMEOUT)";
      fail_locked(msg);
      throw RingError(msg);
    }
    if (now - start < kSpinFor) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::duration_cast<std::chrono::nanoseconds>(kMaxPollSleep));
    }
  }
}

void Endpoint::post(const std::vector<P2p>& ops, cudaStream_t stream, const char* what) {
  const Api& nc = api(opt_.lib);
  nccl_check(nc.group_start(), "ncclGroupStart");
  const char* failed = nullptr;
  ncclResult_t r = ncclSuccess;
  for (const P2p& o : ops) {
    failed = o.send ? "ncclSend" : "ncclRecv";
    r = o.send ? nc.send(o.buf, o.bytes, ncclInt8, o.peer, comm_, stream)
               : nc.recv(const_cast<void*>(o.buf), o.bytes, ncclInt8, o.peer, comm_, stream);
    if (r != ncclSuccess) break;
  }
  // The group is ended whatever happened inside it: a group left open would defer every later NCCL
  // call of this thread, torch's included, without an error.
  const ncclResult_t end = nc.group_end();
  if (r != ncclSuccess) nccl_check(r, failed);
  if (end != ncclInProgress) nccl_check(end, "ncclGroupEnd");
  settle(what);
}

void Endpoint::group(const std::vector<P2p>& ops, cudaStream_t stream) {
  // The call's first group is preceded by a group of its own that exchanges the call's descriptor
  // with every peer, whatever the algorithm: every rank posts the same sends and receives of the
  // same size there, so it completes even when the calls differ, and its copy to the host (checked
  // by retire_locked, the watchdog, and any NCCL error of the call) is not held back by a data
  // group that mismatched calls block (ranks on different algorithms talking to different peers).
  // The price: one more small group per call.
  if (next_.slot >= 0 && !next_.descs) {
    char* dev = inflight_.dev(next_.slot);
    gops_.clear();
    for (int k = 1; k < opt_.nranks; ++k) {
      const int to = (opt_.rank + k) % opt_.nranks, from = ring::mod(opt_.rank - k, opt_.nranks);
      gops_.push_back({true, dev + opt_.rank * sizeof(Desc), sizeof(Desc), to});
      gops_.push_back({false, dev + from * sizeof(Desc), sizeof(Desc), from});
      next_.from.push_back(from);
    }
    post(gops_, stream, "ncclGroupEnd (call descriptors with the peers)");
    RR_CUDA_CHECK(cudaEventCreateWithFlags(&next_.descs, cudaEventDisableTiming));
    RR_CUDA_CHECK(cudaMemcpyAsync(inflight_.host(next_.slot), dev, opt_.nranks * sizeof(Desc),
                                  cudaMemcpyDeviceToHost, stream));
    RR_CUDA_CHECK(cudaEventRecord(next_.descs, stream));
  }
  post(ops, stream, "ncclGroupEnd (send/recv with the peers)");
}

runtime::Caps Endpoint::caps() const {
  runtime::Caps k;
  k.device = true;
  k.polls = true;
  k.run_waits = true;
  return k;
}

void Endpoint::run(const Call& c, Algo algo, cudaStream_t stream) {
  if (closed_) throw closed_error();
  const int n = opt_.nranks;
  runtime::check_call(c, n, failure());
  // A CUDA graph would replay NCCL's calls but not this function's host side (the staging
  // schedule's settle() polls, the watchdog's per-call events): refuse rather than record a graph
  // whose replays the watchdog cannot follow.
  if (c.captured) throw RingError(runtime::capture_refusal(name()));
  std::lock_guard<std::mutex> lk(mu_);
  // Earlier calls first: an NCCL error they left is theirs, and raises here before this call.
  const std::string earlier = retire_locked();
  if (!earlier.empty()) {
    set_failure(earlier, inflight_.first_unretired());
    fail_locked(earlier);
    throw RingError(earlier);
  }
  ++op_seq_;
  LogOnReturn logged{calls_, op_seq_, stream, false};  // never captured: refused above
  in_call_ = true;
  struct Done {
    std::atomic<bool>& flag;
    ~Done() { flag = false; }
  } done_guard{in_call_};
  const size_t es = dtype_size(c.dtype);
  const char* in = static_cast<const char*>(c.in);
  char* out = static_cast<char*>(c.out);
  if (n == 1 || c.numel == 0) {
    if (c.in != c.out && c.numel > 0)
      RR_CUDA_CHECK(cudaMemcpyAsync(out, in, c.numel * es, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  // This call's descriptor, copied to the device for the first group to send (group()). If the
  // call throws before it is in flight, its slot and events go back (the ring is broken then).
  next_ = Pending{};
  next_.seq = op_seq_;
  struct Release {
    Endpoint& ring;
    ~Release() {
      if (ring.next_.slot >= 0) ring.inflight_.release(ring.next_);
    }
  } release{*this};
  next_.slot = inflight_.take();
  Desc& mine = inflight_.host(next_.slot)[opt_.rank];
  mine = describe(c, op_seq_, algo);
  RR_CUDA_CHECK(cudaMemcpyAsync(inflight_.dev(next_.slot) + opt_.rank * sizeof(Desc), &mine, sizeof(Desc),
                                cudaMemcpyHostToDevice, stream));
  run_algo(groups_, c, algo, stream);
  // The watchdog times the call from here (or from when the call before it finished).
  RR_CUDA_CHECK(cudaEventCreateWithFlags(&next_.done, cudaEventDisableTiming));
  RR_CUDA_CHECK(cudaEventRecord(next_.done, stream));
  next_.enqueued = Clock::now();
  inflight_.push(std::move(next_));
  next_ = Pending{};  // in flight now: the guard releases nothing
}

void Endpoint::abort(const std::string& why) {
  const std::string msg = rank_text() + "aborted: " + why;
  set_failure(msg);
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (lk.owns_lock())
    fail_locked(msg);
  else
    abort_requested_ = true;
}

void Endpoint::stop_threads() {
  inflight_.stop();
  if (watchdog_.joinable()) watchdog_.join();
}

void Endpoint::close() {
  if (closed_) return;
  closed_ = true;
  calls_.close();
  stop_threads();
  DeviceScope scope(device_);
  std::lock_guard<std::mutex> lk(mu_);
  if (comm_) {
    const Api& nc = api(opt_.lib);
    bool clean = failure().empty();
    if (clean) {
      const ncclResult_t r = nc.finalize(comm_);  // flushes, then the state settles to success
      clean = r == ncclSuccess || r == ncclInProgress;
    }
    if (clean) {
      try {
        settle("ncclCommFinalize");
      } catch (const RingError&) {
        clean = false;  // settle aborted the communicator
      }
    }
    if (clean && comm_) nc.destroy(comm_);
    else if (comm_) nc.abort(comm_);
    comm_ = nullptr;
  }
  inflight_.release(next_);
  inflight_.clear();
  if (groups_.staging[0]) cudaFree(groups_.staging[0]);
  groups_.staging[0] = groups_.staging[1] = nullptr;
  cudaGetLastError();
}

}  // namespace ringreduce::cuda::nccl
