#include "cuda/nccl/endpoint.h"

#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <type_traits>

#include "cuda/host.h"
#include "cuda/nccl/reduce.h"
#include "ring/loop.h"
#include "ring/schedule.h"

namespace ringreduce::cuda::nccl {
namespace {

using Clock = std::chrono::steady_clock;

// settle()'s backoff. It polls without sleeping for the first kSpinFor: a non-blocking
// ncclGroupEnd of p2p calls to connected peers settles in a few to ~20 us, and any sleep costs at
// least Linux's default timer slack (50 us). Longer waits (connection setup, init, finalize, a
// peer that is late) then sleep 1, 2, 4 ... us, at most kMaxPollSleep: it bounds the delay a
// sleep adds to a few hundred us while polling at most a few thousand times a second.
constexpr auto kSpinFor = std::chrono::microseconds(50);
// Descriptor slots allocated at a time (a slot per call in flight), and the mark of a descriptor.
constexpr int kDescSlotsPerChunk = 16;
constexpr uint32_t kDescMagic = 0x52524443;  // "RRDC"
constexpr auto kMaxPollSleep = std::chrono::microseconds(256);

// The few NCCL entry points we use, looked up in the already loaded library.
struct Api {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) init_rank_config = nullptr;
  decltype(&ncclCommFinalize) finalize = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclCommAbort) abort = nullptr;
  decltype(&ncclCommGetAsyncError) async_error = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetLastError) last_error = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  int version = 0;
};

const Api& api(const std::string& lib) {
  static std::once_flag once;
  static Api a;
  static std::string error;
  std::call_once(once, [&] {
    // The copy torch loaded first (same soname), then the given path, then the default search.
    void* h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    if (!h && !lib.empty()) h = dlopen(lib.c_str(), RTLD_NOW);
    if (!h) h = dlopen("libnccl.so.2", RTLD_NOW);
    if (!h) {
      const char* e = dlerror();
      error = std::string("ringreduce: cannot load libnccl.so.2 (") + (e ? e : "?") +
              "); the nccl transport needs the NCCL that comes with torch (nvidia-nccl-cu13)";
      return;
    }
    bool ok = true;
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(h, name));
      if (!fn) {
        ok = false;
        error = std::string("ringreduce: libnccl.so.2 lacks ") + name + " (NCCL >= 2.18 needed)";
      }
    };
    get(a.get_version, "ncclGetVersion");
    get(a.get_unique_id, "ncclGetUniqueId");
    get(a.init_rank_config, "ncclCommInitRankConfig");
    get(a.finalize, "ncclCommFinalize");
    get(a.destroy, "ncclCommDestroy");
    get(a.abort, "ncclCommAbort");
    get(a.async_error, "ncclCommGetAsyncError");
    get(a.error_string, "ncclGetErrorString");
    get(a.last_error, "ncclGetLastError");
    get(a.group_start, "ncclGroupStart");
    get(a.group_end, "ncclGroupEnd");
    get(a.send, "ncclSend");
    get(a.recv, "ncclRecv");
    if (ok && a.get_version(&a.version) != ncclSuccess) a.version = 0;
    if (!ok) a.get_version = nullptr;
  });
  if (!a.get_version) throw RingError(error);
  return a;
}


std::string seconds(double s) {
  char t[32];
  std::snprintf(t, sizeof t, "%g", s);
  return t;
}

}  // namespace

int version(const std::string& lib) { return api(lib).version; }


size_t oneshot_max_bytes(int n) {
  constexpr double kAlphaS = 10e-6;           // one group round trip (header: settle + p2p latency)
  constexpr double kNetBytesPerS = 25e9;      // a 200 Gb/s NIC
  constexpr size_t kCap = 1 << 20;
  if (n <= 2) return kCap;
  const double limit = kAlphaS * kNetBytesPerS * n / ((n - 1.0) * (n - 2.0));
  size_t b = 1;
  while (b * 2 <= limit && b * 2 <= kCap) b *= 2;
  return b;
}

Algo plan(const Call& c, const Options& o) {
  const int n = o.nranks;
  if (n < 2) return Algo::Ring;  // run() copies; nothing moves
  const size_t es = dtype_size(c.dtype), bytes = static_cast<size_t>(c.numel) * es;
  const size_t region = 2 * o.staging_bytes;
  // Deterministic reductions: only the direct algorithms reduce in rank order (the ring starts
  // each chunk at another rank), so a forced ring and the ring of large sizes give way to them.
  const bool det = deterministic() && c.coll != Coll::AllGather;
  Algo a = o.algo;
  if (det && a == Algo::Ring) a = Algo::Auto;
  if (a == Algo::Auto)
    a = c.coll == Coll::AllReduce && bytes <= oneshot_max_bytes(n) ? Algo::OneShot
        : bytes <= kTwoShotMaxBytes || det                         ? Algo::TwoShot
                                                                   : Algo::Ring;
  if (a == Algo::OneShot &&
      (c.coll != Coll::AllReduce || (n - 1) * round_up(bytes, kSlotAlign) > region))
    a = Algo::TwoShot;
  // Two-shot's reduce-scatter receives pieces of region / (N-1) bytes: at least one element.
  if (a == Algo::TwoShot && c.coll != Coll::AllGather &&
      region / (n - 1) / kSlotAlign * kSlotAlign < es) {
    if (det) {
      // 2 x staging cut into N-1 pieces of 16 bytes at least (the widest element, aligned).
      const size_t need = kSlotAlign / 2 * (n - 1);
      throw RingError("ringreduce: deterministic " + std::string(coll_name(c.coll)) +
                      " (RINGREDUCE_DETERMINISTIC=1) on the nccl transport cannot run with " +
                      std::to_string(n) + " ranks and " + std::to_string(o.staging_bytes) +
                      " bytes of staging: its rank-order algorithms receive every rank's piece "
                      "into the staging at once, which needs at least " + std::to_string(need) +
                      " bytes; raise RINGREDUCE_NCCL_STAGING_BYTES on every rank, or turn "
                      "deterministic mode off");
    }
    a = Algo::Ring;
  }
  return a;
}

std::string unique_id(const std::string& lib) {
  ncclUniqueId id;
  const ncclResult_t r = api(lib).get_unique_id(&id);
  if (r != ncclSuccess)
    throw RingError(std::string("ringreduce: ncclGetUniqueId failed: ") + api(lib).error_string(r));
  return std::string(id.internal, sizeof id.internal);
}

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
  up_ = ring::mod(opt.rank - 1, opt.nranks);
  down_ = ring::mod(opt.rank + 1, opt.nranks);
  try {
    // One allocation: the ring alternates two buffers, the direct algorithms use the first
    // 2 x staging_bytes as one region. The second starts 256-byte aligned, as a cudaMalloc would.
    const size_t first = round_up(opt.staging_bytes, 256);
    void* p = nullptr;
    RR_CUDA_CHECK(cudaMalloc(&p, first + opt.staging_bytes));
    staging_[0] = static_cast<char*>(p);
    staging_[1] = staging_[0] + first;
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
  last_done_ = Clock::now();
  watchdog_ = std::thread([this] { watch(); });
}

Endpoint::~Endpoint() {
  try {
    close();
  } catch (...) {
  }
}

uint64_t Endpoint::first_unfinished() {
  RelaxedCapture relaxed;
  std::lock_guard<std::mutex> qlk(qmu_);
  uint64_t seq = 0;
  for (const Pending& p : inflight_)
    if (cudaEventQuery(p.done) != cudaSuccess) {
      seq = p.seq;
      break;
    }
  cudaGetLastError();
  if (seq) return seq;
  return op_seq_ + (in_call_ ? 0 : 1);  // the call being enqueued, else the next one
}

uint64_t Endpoint::first_unretired() {
  std::lock_guard<std::mutex> qlk(qmu_);
  if (!inflight_.empty()) return inflight_.front().seq;
  return op_seq_ + (in_call_ ? 0 : 1);
}

std::string Endpoint::retire_locked() {
  RelaxedCapture relaxed;
  uint64_t upto = 0;
  {
    std::string mismatch;
    uint64_t mismatch_seq = 0;
    {
      std::lock_guard<std::mutex> qlk(qmu_);
      for (Pending& p : inflight_) {  // calls on other streams may complete out of order
        if (p.checked) continue;
        if (p.descs) {
          const cudaError_t q = cudaEventQuery(p.descs);
          if (q == cudaErrorNotReady) continue;
          if (q != cudaSuccess) break;  // a fault is the watchdog's to report
        }
        p.checked = true;
        mismatch = p.descs ? check_descs(p) : std::string();
        if (!mismatch.empty()) {
          mismatch_seq = p.seq;
          break;
        }
      }
      cudaGetLastError();
    }
    if (!mismatch.empty()) {
      set_failure(mismatch, mismatch_seq);
      return mismatch;
    }
  }
  {
    std::lock_guard<std::mutex> qlk(qmu_);
    for (Pending& p : inflight_) {
      if (!p.checked || cudaEventQuery(p.done) != cudaSuccess) break;  // a fault: the watchdog's
      if (p.seen_done == Clock::time_point{}) p.seen_done = Clock::now();
      upto = p.seq;
    }
    cudaGetLastError();
  }
  const std::string why = async_error_locked();
  if (!why.empty() || upto == 0) return why;
  std::lock_guard<std::mutex> qlk(qmu_);
  while (!inflight_.empty() && inflight_.front().seq <= upto) {
    last_done_ = inflight_.front().seen_done;
    release_pending(inflight_.front());
    inflight_.pop_front();
  }
  return "";
}

std::string Endpoint::check_descs(Pending& p) {
  const Desc* d = desc_slots_[p.slot].host;
  const Desc& mine = d[opt_.rank];
  auto text = [](const Desc& x) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s(numel=%lld, dtype=%s, op=%s; %s)", coll_name(Coll(x.coll)),
                  static_cast<long long>(x.numel), dtype_name(DType(x.dtype)), op_name(RedOp(x.op)),
                  algo_name(Algo(x.algo)));
    return std::string(buf);
  };
  for (int q : p.from) {
    const Desc& o = d[q];
    if (o.magic == kDescMagic && o.op_seq == mine.op_seq && o.numel == mine.numel &&
        o.coll == mine.coll && o.dtype == mine.dtype && o.op == mine.op && o.algo == mine.algo)
      continue;
    if (o.magic != kDescMagic)
      return "ringreduce: rank " + std::to_string(opt_.rank) + ": call #" + std::to_string(mine.op_seq) +
             " on the nccl transport, " + text(mine) + ": rank " + std::to_string(q) +
             " sent data where its call descriptor was due (mismatched calls or algorithms; did "
             "every rank make the same call?)";
    return "ringreduce: mismatched collective calls: rank " + std::to_string(q) + " called " + text(o) +
           " as its call #" + std::to_string(o.op_seq) + " on this communicator, while rank " +
           std::to_string(opt_.rank) + " called " + text(mine) + " as its call #" +
           std::to_string(mine.op_seq);
  }
  return "";
}

int Endpoint::take_desc_slot() {
  if (desc_free_.empty()) {
    const size_t per = static_cast<size_t>(opt_.nranks) * sizeof(Desc);
    const size_t bytes = kDescSlotsPerChunk * per;
    void* dev = nullptr;
    void* host = nullptr;
    RR_CUDA_CHECK(cudaMalloc(&dev, bytes));
    const cudaError_t e = cudaHostAlloc(&host, bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) cudaFree(dev);
    RR_CUDA_CHECK(e);
    std::memset(host, 0, bytes);
    desc_chunks_.push_back({dev, host});
    for (int i = 0; i < kDescSlotsPerChunk; ++i) {
      desc_free_.push_back(static_cast<int>(desc_slots_.size()));
      desc_slots_.push_back({static_cast<char*>(dev) + i * per, reinterpret_cast<Desc*>(static_cast<char*>(host) + i * per)});
    }
  }
  const int slot = desc_free_.back();
  desc_free_.pop_back();
  return slot;
}

void Endpoint::release_pending(Pending& p) {
  if (p.done) cudaEventDestroy(p.done);
  if (p.descs) cudaEventDestroy(p.descs);
  if (p.slot >= 0) desc_free_.push_back(p.slot);
  p.done = p.descs = nullptr;
  p.slot = -1;
}

void Endpoint::set_failure(const std::string& why, uint64_t seq) {
  if (seq == 0) seq = first_unfinished();
  std::lock_guard<std::mutex> lk(fmu_);
  if (!failure_.empty()) return;
  failure_ = why;
  failed_seq_ = seq;
}

std::string Endpoint::failure() {
  std::lock_guard<std::mutex> lk(fmu_);
  return failure_;
}

void Endpoint::fail_locked(const std::string& why) {
  set_failure(why);
  if (comm_) api(opt_.lib).abort(comm_);  // makes NCCL's kernels return; the comm is gone after
  comm_ = nullptr;
  abort_requested_ = false;
}

std::string Endpoint::descs_if_seen(Pending& p) {
  if (!p.descs || p.slot < 0) return "";
  RelaxedCapture relaxed;
  const cudaError_t q = cudaEventQuery(p.descs);
  cudaGetLastError();
  return q == cudaSuccess ? check_descs(p) : std::string();
}

std::string Endpoint::known_mismatch() {
  {
    std::lock_guard<std::mutex> qlk(qmu_);
    for (Pending& p : inflight_) {
      const std::string m = descs_if_seen(p);
      if (!m.empty()) return m;
    }
  }
  return descs_if_seen(next_);
}

void Endpoint::nccl_check(int res, const char* what) {
  if (res == ncclSuccess) return;
  const Api& nc = api(opt_.lib);
  std::string msg = std::string("ringreduce: rank ") + std::to_string(opt_.rank) + ": " + what +
                    " failed: " + nc.error_string(static_cast<ncclResult_t>(res));
  const char* last = comm_ ? nc.last_error(comm_) : nullptr;
  if (last && *last) msg += std::string(" (") + last + ")";
  if (res == ncclInvalidUsage)  // NCCL's usual reason: two ranks of the group on one GPU
    msg += ". If ranks of the group share a GPU: NCCL >= 2.30 accepts that with "
           "NCCL_MULTI_RANK_GPU_ENABLE=1 set on every rank; or use RINGREDUCE_TRANSPORT=p2p, which "
           "moves data between ranks on one GPU through CUDA IPC";
  // Mismatched calls are the cause of a truncated message: say so where the descriptors show it.
  const std::string mismatch = known_mismatch();
  if (!mismatch.empty()) msg = mismatch;
  set_failure(msg, first_unretired());
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
        msg = "ringreduce: rank " + std::to_string(opt_.rank) + ": " + what + " timed out after " +
              seconds(opt_.timeout_s) + " s (RINGREDUCE_TIMEOUT)";
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
    const DescSlot& ds = desc_slots_[next_.slot];
    gops_.clear();
    for (int k = 1; k < opt_.nranks; ++k) {
      const int to = (opt_.rank + k) % opt_.nranks, from = ring::mod(opt_.rank - k, opt_.nranks);
      gops_.push_back({true, ds.dev + opt_.rank * sizeof(Desc), sizeof(Desc), to});
      gops_.push_back({false, ds.dev + from * sizeof(Desc), sizeof(Desc), from});
      next_.from.push_back(from);
    }
    post(gops_, stream, "ncclGroupEnd (call descriptors with the peers)");
    RR_CUDA_CHECK(cudaEventCreateWithFlags(&next_.descs, cudaEventDisableTiming));
    RR_CUDA_CHECK(cudaMemcpyAsync(ds.host, ds.dev, opt_.nranks * sizeof(Desc), cudaMemcpyDeviceToHost,
                                  stream));
    RR_CUDA_CHECK(cudaEventRecord(next_.descs, stream));
  }
  post(ops, stream, "ncclGroupEnd (send/recv with the peers)");
}

void Endpoint::group(const void* sbuf, size_t sbytes, void* rbuf, size_t rbytes, cudaStream_t stream) {
  ops_.assign({{true, sbuf, sbytes, down_}, {false, rbuf, rbytes, up_}});
  group(ops_, stream);
}

runtime::Caps Endpoint::caps() const {
  runtime::Caps k;
  k.device = true;
  k.polls = true;
  k.run_waits = true;
  return k;
}

void Endpoint::run(const Call& c, cudaStream_t stream) {
  if (closed_) throw RingError("ringreduce: nccl communicator is closed");
  const int n = opt_.nranks;
  runtime::check_call(c, n, failure());
  // A CUDA graph would replay NCCL's calls but not this function's host side (the staging
  // schedule's settle() polls, the watchdog's per-call events): refuse rather than record a graph
  // whose replays the watchdog cannot follow.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  RR_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone)
    throw RingError("ringreduce: the nccl transport cannot run inside a CUDA graph capture; use "
                    "RINGREDUCE_TRANSPORT=p2p (capture-safe) or call the collective outside the capture");
  // Before the call is counted: a call deterministic mode cannot run throws on every rank alike
  // (the plan depends only on the call and the options), and the ranks stay in step.
  const Algo algo = nccl::plan(c, opt_);
  std::lock_guard<std::mutex> lk(mu_);
  // Earlier calls first: an NCCL error they left is theirs, and raises here before this call.
  const std::string earlier = retire_locked();
  if (!earlier.empty()) {
    set_failure(earlier, first_unretired());
    fail_locked(earlier);
    throw RingError(earlier);
  }
  ++op_seq_;
  LogOnReturn logged{calls_, op_seq_, stream};
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
  // This call's descriptor, copied to the device for the first group to send (see Desc). If the
  // call throws before it is in flight, its slot and events go back (the ring is broken then).
  next_ = Pending{};
  next_.seq = op_seq_;
  struct Release {
    Endpoint& ring;
    ~Release() {
      if (ring.next_.slot >= 0) ring.release_pending(ring.next_);
    }
  } release{*this};
  next_.slot = take_desc_slot();
  {
    const DescSlot& ds = desc_slots_[next_.slot];
    Desc& mine = ds.host[opt_.rank];
    mine = Desc{op_seq_, c.numel, static_cast<uint8_t>(c.coll), static_cast<uint8_t>(c.dtype),
                static_cast<uint8_t>(c.op), static_cast<uint8_t>(algo), kDescMagic, 0};
    RR_CUDA_CHECK(cudaMemcpyAsync(ds.dev + opt_.rank * sizeof(Desc), &mine, sizeof(Desc),
                                  cudaMemcpyHostToDevice, stream));
  }
  if (algo == Algo::Ring) {
    run_ring(c, stream);
  } else {
    if (c.coll != Coll::AllGather) direct_reduce(c, algo == Algo::OneShot, stream);
    if (c.coll == Coll::AllGather || (c.coll == Coll::AllReduce && algo == Algo::TwoShot))
      direct_gather(c, stream);
  }
  // The watchdog times the call from here (or from when the call before it finished).
  RR_CUDA_CHECK(cudaEventCreateWithFlags(&next_.done, cudaEventDisableTiming));
  RR_CUDA_CHECK(cudaEventRecord(next_.done, stream));
  next_.enqueued = Clock::now();
  std::lock_guard<std::mutex> qlk(qmu_);
  inflight_.push_back(std::move(next_));
  next_ = Pending{};  // in flight now: the guard releases nothing
}

// Chunks of call c: all_reduce cuts any numel (ring::chunk); the others numel / n each.
static ring::Span coll_chunk(const Call& c, int n, int k) {
  if (c.coll == Coll::AllReduce) return ring::chunk(c.numel, n, k);
  return {k * (c.numel / n), c.numel / n};
}

void Endpoint::direct_reduce(const Call& c, bool one_shot, cudaStream_t stream) {
  const int n = opt_.nranks, r = opt_.rank;
  const size_t es = dtype_size(c.dtype);
  const char* in = static_cast<const char*>(c.in);
  char* out = static_cast<char*>(c.out);
  // Piece of rank q's input this rank receives (one-shot: all of it; else q's part of chunk r) into
  // slot q of the region, slots kSlotAlign-aligned; this rank's own piece is read from its input.
  const size_t slot_bytes = one_shot ? round_up(c.numel * es, kSlotAlign)
                                     : 2 * opt_.staging_bytes / (n - 1) / kSlotAlign * kSlotAlign;
  const int64_t S = one_shot ? std::max<int64_t>(c.numel, 1) : static_cast<int64_t>(slot_bytes / es);
  // (launch_reduce_ranks reads the slots in this layout.)
  auto slot = [&](int q) { return staging_[0] + (q < r ? q : q - 1) * slot_bytes; };
  auto part = [&](int k) { return one_shot ? ring::Span{0, c.numel} : coll_chunk(c, n, k); };
  const int64_t ns = ring::num_slices(part(0).count, S);  // chunk 0 is the largest
  const int64_t out_shift = c.coll == Coll::ReduceScatter ? r * (c.numel / n) : 0;
  const int divisor = c.op == RedOp::Avg ? n : 1;
  for (int64_t j = 0; j < ns; ++j) {
    const ring::Span mine = ring::slice(part(r), j, S);
    ops_.clear();
    for (int k = 1; k < n; ++k) {  // peers in ring order from each side: spreads the traffic
      const int to = (r + k) % n, from = ring::mod(r - k, n);
      const ring::Span sp = ring::slice(part(to), j, S);
      ops_.push_back({true, in + sp.begin * es, sp.count * es, to});
      ops_.push_back({false, slot(from), mine.count * es, from});
    }
    group(ops_, stream);
    // One launch folds the n pieces in rank order, ((x0 op x1) op x2) ..., in the compute type,
    // rounded once: bitwise the same on every rank and under every slicing (the contract of
    // ringreduce::deterministic(), kept in every mode: it also reads each piece once, where a
    // launch per rank re-read and re-wrote the running result n-1 times). The output may be the
    // input (in place): each element is read before it is written.
    launch_reduce_ranks(c.dtype, c.op, out + (mine.begin - out_shift) * es, in + mine.begin * es, r,
                        staging_[0], slot_bytes, n, mine.count, divisor, stream);
  }
}

void Endpoint::direct_gather(const Call& c, cudaStream_t stream) {
  const int n = opt_.nranks, r = opt_.rank;
  const size_t es = dtype_size(c.dtype);
  char* out = static_cast<char*>(c.out);
  const ring::Span mine = coll_chunk(c, n, r);
  // all_reduce: the chunk direct_reduce finished in the output; all_gather: the input.
  const char* src = c.coll == Coll::AllGather ? static_cast<const char*>(c.in) : out + mine.begin * es;
  if (src != out + mine.begin * es && mine.count > 0)
    RR_CUDA_CHECK(cudaMemcpyAsync(out + mine.begin * es, src, mine.count * es,
                                  cudaMemcpyDeviceToDevice, stream));
  ops_.clear();
  for (int k = 1; k < n; ++k) {
    const int to = (r + k) % n, from = ring::mod(r - k, n);
    const ring::Span rp = coll_chunk(c, n, from);
    ops_.push_back({true, src, mine.count * es, to});
    ops_.push_back({false, out + rp.begin * es, rp.count * es, from});
  }
  group(ops_, stream);
}

// The ring's primitives (ring/loop.h) over NCCL: a send waits for the next receive, and the two
// go as one group (NCCL's point-to-point pair); receives to be reduced land in the two staging
// buffers in turn, so a group never receives into the buffer it sends from.
struct Endpoint::Prims {
  Endpoint& e;
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
  char* recv(void* dst, int64_t n) {
    e.group(sbuf, sbytes, dst, n * es, stream);
    sbuf = nullptr;
    sbytes = 0;
    return static_cast<char*>(dst);
  }
  void recv_reduce_send(const char* own, int64_t n) {
    char* got = recv(e.staging_[turn++ & 1], n);
    launch_reduce(c.dtype, c.op, got, got, own, n, 1, stream);
    send(got, n);
  }
  void recv_reduce_copy(const char* own, char* dst, int64_t n, int divisor, bool and_send) {
    char* got = recv(e.staging_[turn++ & 1], n);
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

void Endpoint::run_ring(const Call& c, cudaStream_t stream) {
  const size_t es = dtype_size(c.dtype);
  Prims prims{*this, c, stream, es};
  ring::run_ring(c, opt_.nranks, opt_.rank, static_cast<int64_t>(opt_.staging_bytes / es), prims);
}

void Endpoint::watch() {
  RelaxedCapture relaxed;  // this thread's queries, for its whole life
  cudaSetDevice(device_);
  const auto timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(opt_.timeout_s));
  std::unique_lock<std::mutex> qlk(qmu_);
  while (!stop_) {
    qcv_.wait_for(qlk, kWatchPeriod);
    if (stop_) break;
    std::string why;
    uint64_t why_seq = 0;
    // The oldest call not complete is timed from when the one before it was seen complete. Complete
    // calls stay until retire_locked() has also seen NCCL's async state clean after them.
    Clock::time_point prev_done = last_done_;
    for (Pending& p : inflight_) {
      const cudaError_t q = cudaEventQuery(p.done);
      if (q == cudaErrorNotReady) {
        if (Clock::now() - std::max(p.enqueued, prev_done) > timeout) {
          why = descs_if_seen(p);  // mismatched calls, where the descriptors show it
          if (why.empty())
            why = "ringreduce: rank " + std::to_string(opt_.rank) + ": collective #" +
                  std::to_string(p.seq) + " on the nccl transport timed out after " +
                  seconds(opt_.timeout_s) + " s (RINGREDUCE_TIMEOUT; did every rank make the same call?)";
          why_seq = p.seq;
        }
        break;
      }
      cudaGetLastError();
      if (q != cudaSuccess) {  // a fault on the stream (sticky): nothing after it ran right
        why = "ringreduce: rank " + std::to_string(opt_.rank) + ": collective #" +
              std::to_string(p.seq) + " on the nccl transport failed: CUDA error " +
              cudaGetErrorName(q) + " (" + cudaGetErrorString(q) + ")";
        why_seq = p.seq;
        break;
      }
      if (p.seen_done == Clock::time_point{}) p.seen_done = Clock::now();
      prev_done = p.seen_done;
    }
    qlk.unlock();
    if (why.empty()) {
      std::vector<runtime::Peer> peers;
      {
        std::lock_guard<std::mutex> flk(fmu_);
        peers = peers_;
      }
      const std::string dead = runtime::dead_peer(peers);
      if (!dead.empty()) why = "ringreduce: rank " + std::to_string(opt_.rank) + ": " + dead;
    }
    if (why.empty() && failure().empty()) {
      std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);  // else run() retires
      if (lk.owns_lock()) why = retire_locked();
      if (!why.empty()) why_seq = first_unretired();
    }
    if (!why.empty()) set_failure(why, why_seq);  // the first failure wins
    // Abort for a timeout seen now, and also for one requested earlier while run() held mu_ (a
    // timeout here, or abort() from another thread): run() may have returned without polling
    // again, and then nobody aborted the communicator, NCCL's kernels never returned and every
    // synchronize() and close() waited forever. Retried each period until the lock is free.
    if (!why.empty() || abort_requested_) {
      std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
      if (lk.owns_lock())
        fail_locked(failure());
      else
        abort_requested_ = true;  // the thread inside NCCL aborts when it next polls (settle)
    }
    qlk.lock();
  }
}

std::string Endpoint::async_error_locked() {
  if (!comm_) return "";
  ncclResult_t state = ncclSuccess;
  api(opt_.lib).async_error(comm_, &state);
  if (state == ncclSuccess || state == ncclInProgress) return "";
  std::string why = std::string("ringreduce: rank ") + std::to_string(opt_.rank) + ": NCCL error: " +
                    api(opt_.lib).error_string(state);
  const char* last = api(opt_.lib).last_error(comm_);
  if (last && *last) why += std::string(" (") + last + ")";
  return why;
}

void Endpoint::poll() {
  if (!failure().empty()) return;
  std::string why;
  {
    std::lock_guard<std::mutex> lk(mu_);
    why = retire_locked();
    if (!why.empty()) {
      set_failure(why, first_unretired());
      fail_locked(why);
    }
  }
}

void Endpoint::watch_peers(std::vector<runtime::Peer> peers) {
  std::lock_guard<std::mutex> lk(fmu_);
  peers_ = std::move(peers);
}

void Endpoint::abort(const std::string& why) {
  const std::string msg = "ringreduce: rank " + std::to_string(opt_.rank) + ": aborted: " + why;
  set_failure(msg);
  std::unique_lock<std::mutex> lk(mu_, std::try_to_lock);
  if (lk.owns_lock())
    fail_locked(msg);
  else
    abort_requested_ = true;
}

void Endpoint::stop_threads() {
  {
    std::lock_guard<std::mutex> qlk(qmu_);
    stop_ = true;
  }
  qcv_.notify_all();
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
  {
    std::lock_guard<std::mutex> qlk(qmu_);
    for (Pending& p : inflight_) release_pending(p);
    inflight_.clear();
  }
  if (next_.slot >= 0) release_pending(next_);
  for (auto& [dev, host] : desc_chunks_) {
    cudaFree(dev);
    cudaFreeHost(host);
  }
  desc_chunks_.clear();
  desc_slots_.clear();
  desc_free_.clear();
  if (staging_[0]) cudaFree(staging_[0]);
  staging_[0] = staging_[1] = nullptr;
  cudaGetLastError();
}

}  // namespace ringreduce::cuda::nccl
