// The copy algorithm of the p2p transport (Algo::Copy): for ranks that share a GPU without MPS,
// whose contexts take turns in time slices, so that a kernel spinning on another rank's flag holds
// its slice while the other rank cannot run. Here no kernel waits: per piece, each rank copies its
// part into every peer's inbox (cudaMemcpyAsync into the IPC mapping), writes the piece's header
// into the peer's memory and then its count for that peer (cuStreamWriteValue64, which fences the
// copy before it), waits on its own counts until every peer's part is there (cuStreamWaitValue64: the GPU's
// front end waits, no SM spins), and folds with a kernel that only checks headers and computes.
// Two inbox slots per source, reused safely by stream order alone (kCopyDepth says why).
// The counters live in host memory every rank maps (CopyCtl): stream waits never time out, so the
// watchdog (CopyPath::tick) fails a piece waited on past the timeout and releases the waits with CPU
// stores; a kernel that stops releases them too (record_stop).
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "cuda/host.h"
#include "cuda/p2p/copy.h"
#include "cuda/p2p/failures.h"
#include "cuda/p2p/launch.h"
#include "runtime/shm_map.h"

namespace ringreduce::cuda::p2p {
namespace {

// The driver's stream memory operations, found at run time through the runtime (no link against
// libcuda). CUresult, CUstream and CUdeviceptr as the driver API defines them: an enum, the
// runtime's stream handle, a 64-bit address.
using StreamValue64 = int (*)(cudaStream_t, unsigned long long, unsigned long long, unsigned);
constexpr unsigned kWaitGeq = 0;       // CU_STREAM_WAIT_VALUE_GEQ
constexpr unsigned kWriteFenced = 0;   // CU_STREAM_WRITE_VALUE_DEFAULT: earlier work lands first

struct MemOps {
  StreamValue64 write = nullptr, wait = nullptr;
  std::string missing;  // why not, or ""
};

const MemOps& mem_ops() {
  static const MemOps ops = [] {
    MemOps m;
    auto find = [&](const char* name, StreamValue64* fn) {
      void* p = nullptr;
#if CUDART_VERSION >= 12000
      cudaDriverEntryPointQueryResult q{};
#if CUDART_VERSION >= 12050
      const cudaError_t e = cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q);
#else
      const cudaError_t e = cudaGetDriverEntryPoint(name, &p, cudaEnableDefault, &q);
#endif
      const bool found = e == cudaSuccess && q == cudaDriverEntryPointSuccess && p;
#else
      const bool found = false;  // CUDA 11: not looked up (the copy algorithm refuses to run)
#endif
      if (!found) {
        cudaGetLastError();
        m.missing += std::string(m.missing.empty() ? "" : ", ") + name;
        return;
      }
      *fn = reinterpret_cast<StreamValue64>(p);
    };
    find("cuStreamWriteValue64", &m.write);
    find("cuStreamWaitValue64", &m.wait);
    return m;
  }();
  return ops;
}

void check_result(int result, const char* what) {
  if (result != 0)
    throw RingError(std::string("ringreduce: ") + what + " failed (CUresult " + std::to_string(result) +
                    "); stream memory operations may be off in this driver");
}

unsigned long long addr(const void* p) { return reinterpret_cast<unsigned long long>(p); }

}  // namespace

void CopyPath::check(bool captured) const {
  if (!on())
    throw RingError("ringreduce: the copy algorithm needs its inbox (RINGREDUCE_CUDA_ALGO=copy or "
                    "ranks sharing a GPU without MPS, at most " + std::to_string(kMaxPeers) + " ranks)");
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!cctl_) throw RingError("ringreduce: the copy algorithm's counters are not attached (copy_attach)");
  }
  if (!mem_ops().missing.empty())
    throw RingError("ringreduce: the copy algorithm (ranks sharing a GPU without MPS) needs the "
                    "driver's stream memory operations, and this driver lacks " + mem_ops().missing +
                    "; start MPS (nvidia-cuda-mps-control -d) or use one GPU per rank");
  // The driver's CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS (the runtime names it
  // cudaDevAttrReserved122): 64-bit stream waits and writes.
  int ops64 = 0;
  if (cudaDeviceGetAttribute(&ops64, static_cast<cudaDeviceAttr>(122), device_) != cudaSuccess || !ops64) {
    cudaGetLastError();
    throw RingError("ringreduce: the copy algorithm (ranks sharing a GPU without MPS) needs 64-bit "
                    "stream memory operations, which this GPU or driver does not offer; start MPS "
                    "(nvidia-cuda-mps-control -d) or use one GPU per rank");
  }
  if (captured)
    throw RingError("ringreduce: a CUDA graph cannot capture the copy algorithm, which ranks sharing "
                    "a GPU without MPS run (its stream waits name each call's counts); start MPS "
                    "(nvidia-cuda-mps-control -d) or use one GPU per rank to capture collectives");
}

void CopyPath::attach(const std::string& name, bool create) {
  if (!on()) throw RingError("ringreduce: copy_attach: this ring has no copy algorithm");
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (cctl_) throw RingError("ringreduce: copy_attach: the counters are attached already");
  }
  uint64_t bytes = sizeof(CopyCtl);
  char* p = create ? runtime::shm_create(name, bytes) : runtime::shm_map(name, &bytes);
  if (create) std::memset(p, 0, sizeof(CopyCtl));
  DeviceScope scope(device_);
  const cudaError_t e = cudaHostRegister(p, sizeof(CopyCtl), cudaHostRegisterMapped | cudaHostRegisterPortable);
  void* dev = nullptr;
  if (e != cudaSuccess || cudaHostGetDevicePointer(&dev, p, 0) != cudaSuccess) {
    const cudaError_t err = e != cudaSuccess ? e : cudaGetLastError();
    if (e == cudaSuccess) cudaHostUnregister(p);
    cudaGetLastError();
    runtime::shm_unmap(p, sizeof(CopyCtl));
    throw RingError(std::string("ringreduce: the copy algorithm's counters (shared memory ") + name +
                    ") cannot be registered with CUDA: " + cudaGetErrorString(err));
  }
  std::lock_guard<std::mutex> lk(mu_);
  cctl_ = reinterpret_cast<CopyCtl*>(p);
  cctl_dev_ = static_cast<CopyCtl*>(dev);
}

void CopyPath::run(const Call& c, const Plan& p, Args a, const std::vector<char*>& areas, HostCtl* ctl_dev,
                   uint64_t op_seq, cudaStream_t s) {
  const MemOps& m = mem_ops();
  const int n = opt_.nranks, r = opt_.rank;
  const int64_t es = static_cast<int64_t>(dtype_size(c.dtype));
  const int64_t span = c.coll == Coll::AllReduce ? c.numel : c.numel / n;
  const size_t stride = slot_stride(opt_.copy_slot_bytes);
  CopyCtl* cctl_dev = cctl_dev_;  // set before the first call (attach), then fixed until close
  auto write = [&](const uint64_t* at, uint64_t v) { check_result(m.write(s, addr(at), v, kWriteFenced), "cuStreamWriteValue64"); };
  auto wait = [&](const uint64_t* at, uint64_t v) { check_result(m.wait(s, addr(at), v, kWaitGeq), "cuStreamWaitValue64"); };
  for (int64_t k = 0; k < p.steps; ++k) {
    const uint64_t piece = pieces_ + static_cast<uint64_t>(k);
    const int slot = static_cast<int>(piece % kCopyDepth);
    const int64_t begin = k * p.slice_elems, count = std::min(p.slice_elems, span - begin);
    const size_t bytes = static_cast<size_t>(count * es);
    // The slot's offset mod 16: that of the element in the fold's destination (all_gather: this
    // rank's chunk of the output), so that the receiver's copy or fold runs on 16-byte vectors.
    const int64_t at_out = c.coll == Coll::AllGather ? r * span + begin : begin;
    const size_t shift = static_cast<size_t>(at_out * es) & (kVecBytes - 1);
    write(&ctl_dev->copy_call, op_seq);
    write(&ctl_dev->copy_reached, piece + 1);
    MsgHeader h{};
    h.op_seq = op_seq;
    h.numel = c.numel;
    h.nbytes = bytes;
    h.index = static_cast<uint32_t>(k);
    h.coll = static_cast<uint8_t>(c.coll);
    h.dtype = static_cast<uint8_t>(c.dtype);
    h.op = static_cast<uint8_t>(c.op);
    h.algo = static_cast<uint8_t>(Algo::Copy);
    uint64_t words[sizeof h / 8];
    std::memcpy(words, &h, sizeof h);
    if (k == 0) {
      std::lock_guard<std::mutex> lk(mu_);
      sent_[op_seq % 64] = Sent{h, piece};
    }
    for (int j = 1; j < n; ++j) {  // from the next rank on, so that the ranks start on different peers
      const int q = (r + j) % n;
      Area* peer = reinterpret_cast<Area*>(areas[q]);
      const char* src = static_cast<const char*>(c.in) +
                        (c.coll == Coll::ReduceScatter ? q * span + begin : begin) * es;
      char* dst = areas[q] + layout_.inbox_at() + (static_cast<size_t>(slot) * n + r) * stride + shift;
      if (bytes) RR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s));
      const uint64_t* hw = reinterpret_cast<const uint64_t*>(&peer->copy_hdr[slot][r]);
      for (size_t w = 0; w < sizeof h / 8; ++w) write(hw + w, words[w]);
      write(&cctl_dev->arrived[q][r].value, piece + 1);
    }
    for (int j = 1; j < n; ++j) wait(&cctl_dev->arrived[r][(r + j) % n].value, piece + 1);
    a.piece_begin = begin;
    a.piece_count = count;
    a.piece_index = static_cast<uint32_t>(k);
    a.copy_slot = slot;
    launch_copy(a, copy_blocks(count * es), s);  // before the next piece's copies: the slots' reuse depends on it
    write(&ctl_dev->copy_done, piece + 1);
  }
  pieces_ += static_cast<uint64_t>(p.steps);
}

void CopyPath::release_waits(uint32_t word) {
  std::lock_guard<std::mutex> lk(mu_);
  release_locked(word);
}

void CopyPath::release_locked(uint32_t word) {
  if (!cctl_) return;
  uint32_t none = 0;
  if (word) __atomic_compare_exchange_n(&cctl_->abort, &none, word, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  for (int q = 0; q < opt_.nranks; ++q)
    for (int s = 0; s < opt_.nranks; ++s) __atomic_store_n(&cctl_->arrived[q][s].value, kReleased, __ATOMIC_SEQ_CST);
}

void CopyPath::watch(const HostCtl* ctl, std::function<bool()> broken,
                     std::function<void(const std::string&, uint64_t)> fail) {
  ctl_ = ctl;
  broken_ = std::move(broken);
  fail_ = std::move(fail);
  ticker_ = std::make_unique<runtime::Ticker>(std::chrono::milliseconds(50), [this] { tick(); });
}

void CopyPath::tick() {
  const auto now = std::chrono::steady_clock::now();
  bool broken = broken_();  // before mu_: the other part's lock is never taken under this one
  std::string why;
  uint64_t call = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!ctl_ || !cctl_) return;
    broken = broken || __atomic_load_n(&cctl_->abort, __ATOMIC_ACQUIRE) != 0;
    const volatile HostCtl* ctl = ctl_;
    const uint64_t done = ctl->copy_done, reached = ctl->copy_reached;
    if (done >= reached || reached != watch_.reached || done != watch_.done) {
      watch_ = Watch{reached, done, now};  // idle, or moving
      if (done >= reached) return;
    }
    // A piece this rank's stream waits on (or folds): once the group is broken every wait is
    // released, again each time (a peer's later count may have lowered a released counter).
    if (broken) {
      release_locked(0);
      return;
    }
    if (now - watch_.since < std::chrono::duration<double>(opt_.timeout_s)) return;
    call = ctl->copy_call;
    char t[32];
    std::snprintf(t, sizeof t, "%g", opt_.timeout_s);
    const Sent& cc = sent_[call % 64];
    const bool known = cc.call.op_seq == call;
    const std::string what = known ? call_text(cc.call) : std::string("call");
    // The peers whose count for this piece has not come: the ranks that did not make the call (or
    // made it later, are stuck in an earlier piece, or died). None: the data came, the stream did
    // not get through its fold (time slices, a shared hardware queue).
    std::string missing;
    for (int q = 0; q < opt_.nranks; ++q)
      if (q != opt_.rank && __atomic_load_n(&cctl_->arrived[opt_.rank][q].value, __ATOMIC_ACQUIRE) < reached)
        missing += (missing.empty() ? "" : ", ") + std::to_string(q);
    const std::string from = missing.find(',') == std::string::npos ? "rank " + missing : "ranks " + missing;
    why = "ringreduce: rank " + std::to_string(opt_.rank) + ": " + what + " #" + std::to_string(call) +
          " (copy algorithm, piece " + (known ? std::to_string(reached - 1 - cc.first_piece) : "?") +
          ") timed out after " + t +
          (missing.empty() ? std::string(" s: every peer's data came, its fold did not finish")
                           : " s waiting for data from " + from) +
          " (RINGREDUCE_TIMEOUT; did every rank make the same call?)";
  }
  fail_(why, call);  // the abort word to every peer, then the waits released (release_waits)
}

void CopyPath::close(bool keep) {
  stop();
  std::lock_guard<std::mutex> lk(mu_);
  if (cctl_ && !keep) {
    cudaHostUnregister(cctl_);
    runtime::shm_unmap(reinterpret_cast<char*>(cctl_), sizeof(CopyCtl));
  }
  cctl_ = cctl_dev_ = nullptr;
  ctl_ = nullptr;
}

}  // namespace ringreduce::cuda::p2p
