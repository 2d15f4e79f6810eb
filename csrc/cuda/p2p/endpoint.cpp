// Host side of the p2p transport: the area and flags of one rank, IPC mappings of its neighbours,
// registered buffers, launches, abort and close. What a failure says: diagnose.cpp.
#include "cuda/p2p/endpoint.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "cuda/host.h"
#include "runtime/shm_map.h"

namespace ringreduce::cuda::p2p {
namespace {

// Memory close() or reg_release() keeps until the process exits (a peer or a graph may use it).
std::mutex g_kept_mu;
size_t g_kept_bytes = 0;

}  // namespace

std::string device_bus_id() {
  int dev = 0;
  RR_CUDA_CHECK(cudaGetDevice(&dev));
  char id[32] = {};
  RR_CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof id, dev));
  return id;
}

bool can_map(const std::string& bus_id, std::string* why) {
  int dev = 0, other = -1, can = 0;
  RR_CUDA_CHECK(cudaGetDevice(&dev));
  if (cudaDeviceGetByPCIBusId(&other, bus_id.c_str()) != cudaSuccess) {
    cudaGetLastError();
    *why = "device " + bus_id + " is not visible to this process";
    return false;
  }
  if (other == dev) return true;
  RR_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, dev, other));
  if (!can) *why = "devices " + std::to_string(dev) + " and " + std::to_string(other) + " (" + bus_id +
                   ") have no peer access (cudaDeviceCanAccessPeer)";
  return can != 0;
}

bool Endpoint::ring_fifo() const {
  return opt_.nranks > 1 && (!opt_.direct || opt_.nranks > kMaxPeers || opt_.algo == Algo::Ring);
}

size_t Endpoint::fifo_bytes() const {
  return ring_fifo() ? static_cast<size_t>(opt_.channels) * kSlots * slot_stride(opt_.slice_bytes) : 0;
}

size_t Endpoint::ws_half_bytes() const {
  // A piece of chunk_bytes laid out as the tensor mod 16; reduce_scatter's n regions each start
  // on 16 bytes (sym_kernel.cu's Layout): 32 bytes of slack per region.
  return opt_.nranks > 1 && opt_.direct && opt_.nranks <= kMaxPeers
             ? round_up(opt_.chunk_bytes + 2 * kVecBytes * kMaxPeers, 256)
             : 0;
}

size_t Endpoint::copy_bytes() const {
  return opt_.algo == Algo::Copy && opt_.nranks > 1 && opt_.nranks <= kMaxPeers
             ? static_cast<size_t>(kCopyDepth) * opt_.nranks * slot_stride(opt_.copy_slot_bytes)
             : 0;
}

size_t Endpoint::ll_slot_bytes() const {
  // The LL slots (ll_kernel.cu): a header and ll_limit() bytes of data, 8 bytes a 4-byte word;
  // sized at construction (set_ll_max may lower the reach later, not the slots).
  if (ll_slot_fixed_ != kNoSlot) return ll_slot_fixed_;
  const size_t limit = ll_limit(opt_);
  return opt_.nranks > 1 && opt_.direct && opt_.nranks <= kMaxPeers && limit > 0
             ? round_up((kLLHeaderWords + (limit + 3) / 4) * 8, 256)
             : 0;
}

size_t Endpoint::area_bytes() const {
  return opt_.nranks > 1 ? ll_offset() + ll_bytes() : 0;
}

Endpoint::Endpoint(const Options& opt) : opt_(opt) {
  if (opt.nranks < 1 || opt.rank < 0 || opt.rank >= opt.nranks)
    throw std::invalid_argument("ringreduce: rank " + std::to_string(opt.rank) + " out of range for " +
                                std::to_string(opt.nranks) + " ranks");
  if (opt.channels < 1 || opt.channels > kMaxChannels)
    throw std::invalid_argument("ringreduce: channels must be 1.." + std::to_string(kMaxChannels) +
                                ", got " + std::to_string(opt.channels));
  if (opt.slice_bytes < kVecBytes || opt.slice_bytes % kVecBytes)
    throw std::invalid_argument("ringreduce: p2p slice_bytes must be a positive multiple of 16, got " +
                                std::to_string(opt.slice_bytes));
  if (opt.chunk_bytes < kVecBytes || opt.chunk_bytes % kVecBytes)
    throw std::invalid_argument("ringreduce: p2p chunk_bytes must be a positive multiple of 16, got " +
                                std::to_string(opt.chunk_bytes));
  if (opt.max_blocks < 0)
    throw std::invalid_argument("ringreduce: p2p max_blocks must be >= 0 (0: this device's SM count), got " +
                                std::to_string(opt.max_blocks));
  if (opt.sym_blocks < 1 || opt.sym_blocks > kMaxSymBlocks)
    throw std::invalid_argument("ringreduce: p2p sym_blocks must be 1.." + std::to_string(kMaxSymBlocks) +
                                ", got " + std::to_string(opt.sym_blocks));
  if (opt.copy_slot_bytes < kVecBytes || opt.copy_slot_bytes % kVecBytes)
    throw std::invalid_argument("ringreduce: p2p copy_slot_bytes must be a positive multiple of 16, got " +
                                std::to_string(opt.copy_slot_bytes));
  RR_CUDA_CHECK(cudaGetDevice(&device_));
  if (opt_.max_blocks == 0) opt_.max_blocks = sm_count();
  up_ = ring::mod(opt.rank - 1, opt.nranks);
  down_ = ring::mod(opt.rank + 1, opt.nranks);
  try {
    RR_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    void* p = nullptr;
    peers_.assign(opt.nranks, nullptr);
    if (opt.nranks > 1) {  // world 1: no device memory (a call is a copy at most)
      RR_CUDA_CHECK(cudaMalloc(&p, area_bytes()));
      area_ = static_cast<char*>(p);
      peers_[opt.rank] = area_;
    }
    RR_CUDA_CHECK(cudaHostAlloc(&p, sizeof(HostCtl), cudaHostAllocMapped | cudaHostAllocPortable));
    ctl_ = static_cast<HostCtl*>(p);
    std::memset(static_cast<void*>(ctl_), 0, sizeof(HostCtl));
    RR_CUDA_CHECK(cudaHostGetDevicePointer(&p, ctl_, 0));
    ctl_dev_ = static_cast<HostCtl*>(p);
    RR_CUDA_CHECK(cudaHostAlloc(&p, sizeof(uint32_t), cudaHostAllocPortable));
    abort_src_ = static_cast<uint32_t*>(p);
    *abort_src_ = 0;
    // Counters, flags and abort word start at zero, and so do the LL words (their flags: no
    // epoch is 0); data needs no initialisation.
    if (area_) RR_CUDA_CHECK(cudaMemsetAsync(area_, 0, data_offset(), side_));
    if (area_ && ll_bytes()) RR_CUDA_CHECK(cudaMemsetAsync(area_ + ll_offset(), 0, ll_bytes(), side_));
    RR_CUDA_CHECK(cudaStreamSynchronize(side_));
    if (copies())
      copy_watch_ = std::make_unique<runtime::Ticker>(std::chrono::milliseconds(50), [this] { copy_tick(); });
  } catch (...) {
    close();
    throw;
  }
}

Endpoint::~Endpoint() {
  try {
    close();
  } catch (...) {
  }
}

void Endpoint::set_counts(uint64_t epoch, uint64_t ll_calls) {
  if (!area_) return;
  DeviceScope scope(device_);
  RR_CUDA_CHECK(cudaStreamSynchronize(side_));
  for (int b = 0; b < kMaxSymBlocks; ++b) {
    Area* at = reinterpret_cast<Area*>(area_);
    RR_CUDA_CHECK(cudaMemcpy(&at->sym[b].epoch.value, &epoch, 8, cudaMemcpyHostToDevice));
    RR_CUDA_CHECK(cudaMemcpy(&at->sym[b].ll.value, &ll_calls, 8, cudaMemcpyHostToDevice));
  }
  RR_CUDA_CHECK(cudaDeviceSynchronize());  // a copy from pageable memory may land late
}

std::string Endpoint::handle() const {
  if (closed_) throw RingError("ringreduce: p2p ring is closed");
  if (!area_) return "";  // world 1
  cudaIpcMemHandle_t h;
  RR_CUDA_CHECK(cudaIpcGetMemHandle(&h, area_));
  return std::string(reinterpret_cast<const char*>(&h), sizeof h);
}

void Endpoint::connect(const std::vector<std::string>& handles) {
  const int n = opt_.nranks;
  if (n == 1) return;
  if (static_cast<int>(handles.size()) != n)
    throw RingError("ringreduce: p2p bootstrap: " + std::to_string(handles.size()) +
                    " IPC handles for " + std::to_string(n) + " ranks");
  DeviceScope scope(device_);
  ipc_ = true;
  const bool all = opt_.direct && n <= kMaxPeers;
  for (int q = 0; q < n; ++q) {
    if (q == opt_.rank) continue;
    const std::string& bytes = handles[q];
    if (bytes.empty()) {
      if (q == up_ || q == down_ || all)
        throw RingError("ringreduce: p2p bootstrap: no IPC handle of rank " + std::to_string(q) +
                        (all ? " (every rank's is needed: Options::direct)" : " (a neighbour)"));
      continue;
    }
    if (bytes.size() != sizeof(cudaIpcMemHandle_t))
      throw RingError("ringreduce: p2p bootstrap: IPC handles have the wrong size");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, bytes.data(), sizeof h);
    void* p = nullptr;
    // The lazy flag enables peer access when the peer's memory is on another device.
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw RingError(std::string("ringreduce: rank ") + std::to_string(opt_.rank) +
                      ": cannot map the memory of rank " + std::to_string(q) +
                      " through CUDA IPC (" + cudaGetErrorString(e) +
                      "); the devices may not be peers: use RINGREDUCE_TRANSPORT=nccl");
    }
    peers_[q] = static_cast<char*>(p);
  }
  direct_ = all;
}

void Endpoint::set_ll_max(size_t bytes) {
  // The slots were sized for the reach at construction; a smaller one fits them.
  const size_t cap = ll_slot_bytes() ? (ll_slot_bytes() / 8 - kLLHeaderWords) * 4 : 0;
  if (bytes > cap)
    throw std::invalid_argument("ringreduce: p2p LL reach " + std::to_string(bytes) + " B is more than its " +
                                "buffers hold (" + std::to_string(cap) + " B)");
  ll_slot_fixed_ = ll_slot_bytes();
  opt_.ll_max = static_cast<int64_t>(bytes);
}

void Endpoint::set_sym_blocks(int blocks) {
  if (blocks < 1 || blocks > kMaxSymBlocks)
    throw std::invalid_argument("ringreduce: p2p sym_blocks must be 1.." + std::to_string(kMaxSymBlocks) +
                                ", got " + std::to_string(blocks));
  opt_.sym_blocks = blocks;
}

void Endpoint::connect_local(const std::vector<const Endpoint*>& rings) {
  for (int q = 0; q < opt_.nranks; ++q)
    if (q != opt_.rank) peers_[q] = rings[q]->area_;
  direct_ = opt_.direct && opt_.nranks <= kMaxPeers;
}

Plan Endpoint::plan_of(const Call& c) const {
  const size_t es = dtype_size(c.dtype);
  const size_t bytes = static_cast<size_t>(c.numel) * es;
  // Up to auto's one-shot threshold one-shot stays: one barrier against the registered kernel's
  // two, and its copy into the workspace is small.
  const size_t oneshot_max = opt_.tuned ? opt_.oneshot_max : oneshot_max_bytes(opt_.nranks);
  if (opt_.algo == Algo::Auto && direct_ && c.coll == Coll::AllReduce && c.wire == Wire::None && c.in == c.out &&
      c.numel > 0 && opt_.nranks > 1 && bytes > oneshot_max) {
    const char* p = static_cast<const char*>(c.in);
    std::lock_guard<std::mutex> lk(reg_mu_);
    for (size_t k = 0; k < regs_.size(); ++k) {
      const Reg& g = regs_[k];
      const char* base = g.own.get();
      if (!g.mapped || p < base || p + bytes > base + g.bytes) continue;
      // Blocks as the workspace's two-shot: a block reads its part of chunk r from all n copies.
      Plan r = p2p::plan({c.coll, c.dtype, c.op, c.numel, nullptr, nullptr}, opt_, direct_);
      r.algo = Algo::Registered;
      r.slice_elems = c.numel;
      r.steps = 1;
      r.reg = static_cast<int>(k);
      r.reg_offset = static_cast<uint64_t>(p - base);
      return r;
    }
  }
  Plan r = p2p::plan(c, opt_, direct_);
  // An ordinary tensor: Imported where the group has its board (the same on every rank), with the
  // two-shot plan for the calls that go through the workspace.
  if (opt_.algo == Algo::Auto && imported_.attached() && direct_ && c.coll == Coll::AllReduce && c.wire == Wire::None &&
      c.in == c.out && c.numel > 0 && opt_.nranks > 1 && bytes > oneshot_max && r.algo == Algo::TwoShot)
    r.algo = Algo::Imported;
  return r;
}

int Endpoint::reg_alloc(size_t bytes, std::string* handle) {
  if (closed_) throw RingError("ringreduce: p2p communicator is closed");
  if (opt_.nranks > 1 && !direct_)
    throw RingError("ringreduce: shared buffers need every rank of the group to map every other "
                    "rank's memory through CUDA IPC (and at most " + std::to_string(kMaxPeers) +
                    " ranks); this group cannot");
  DeviceScope scope(device_);
  void* p = nullptr;
  RR_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
  const int dev = device_;
  Reg g;
  g.bytes = bytes;
  g.own = std::shared_ptr<char>(static_cast<char*>(p), [dev](char* q) {
    DeviceScope s(dev);
    cudaFree(q);  // at exit the runtime may be gone: nothing to report then
    cudaGetLastError();
  });
  g.at.assign(opt_.nranks, nullptr);
  g.at[opt_.rank] = g.own.get();
  g.mapped = opt_.nranks == 1;
  cudaIpcMemHandle_t h;
  RR_CUDA_CHECK(cudaIpcGetMemHandle(&h, p));
  handle->assign(reinterpret_cast<const char*>(&h), sizeof h);
  std::lock_guard<std::mutex> lk(reg_mu_);
  regs_.push_back(std::move(g));
  return static_cast<int>(regs_.size()) - 1;
}

void Endpoint::reg_connect(int id, const std::vector<std::string>& handles) {
  std::lock_guard<std::mutex> lk(reg_mu_);
  if (id < 0 || id >= static_cast<int>(regs_.size()))
    throw std::invalid_argument("ringreduce: no shared buffer " + std::to_string(id));
  Reg& g = regs_[id];
  const int n = opt_.nranks;
  if (static_cast<int>(handles.size()) != n)
    throw RingError("ringreduce: shared buffer: " + std::to_string(handles.size()) +
                    " IPC handles for " + std::to_string(n) + " ranks");
  DeviceScope scope(device_);
  g.ipc = true;  // from here close() unmaps what is mapped
  for (int q = 0; q < n; ++q) {
    if (q == opt_.rank) continue;
    if (handles[q].size() != sizeof(cudaIpcMemHandle_t))
      throw RingError("ringreduce: shared buffer: rank " + std::to_string(q) + "'s IPC handle has the wrong size");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[q].data(), sizeof h);
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw RingError("ringreduce: rank " + std::to_string(opt_.rank) + ": cannot map rank " +
                      std::to_string(q) + "'s shared buffer through CUDA IPC (" + cudaGetErrorString(e) + ")");
    }
    g.at[q] = static_cast<char*>(p);
  }
  g.mapped = true;
}

void Endpoint::reg_connect_local(int id, const std::vector<const Endpoint*>& rings) {
  std::lock_guard<std::mutex> lk(reg_mu_);
  Reg& g = regs_.at(id);
  for (int q = 0; q < opt_.nranks; ++q)
    if (q != opt_.rank) g.at[q] = rings[q]->regs_.at(id).own.get();
  g.mapped = true;
}

void Endpoint::reg_release(int id) {
  const bool replayable = pins_->load() > 0;
  const bool broke = broken();  // before reg_mu_: close() takes mu_, then reg_mu_
  std::lock_guard<std::mutex> lk(reg_mu_);
  if (id < 0 || id >= static_cast<int>(regs_.size()) || !regs_[id].own) return;
  Reg& g = regs_[id];
  g.mapped = false;  // no plan picks it again
  if ((replayable || broke) && !g.kept) {
    g.kept = true;
    new std::shared_ptr<char>(g.own);  // never deleted: freed by the process's exit
    std::lock_guard<std::mutex> klk(g_kept_mu);
    g_kept_bytes += g.bytes;
  }
  if (!replayable) {
    // The peers' copies are unmapped here; this rank's own copy is not freed before close(): a
    // peer may still map it (its tensor alive), and freeing memory another process maps is
    // undefined in CUDA. close() frees it after every rank unmapped (unmap_peers, a barrier).
    DeviceScope scope(device_);
    if (g.ipc)
      for (char* p : g.at)
        if (p && p != g.own.get()) cudaIpcCloseMemHandle(p);
    g.at.clear();
  }
}

std::shared_ptr<char> Endpoint::reg_memory(int id) const {
  std::lock_guard<std::mutex> lk(reg_mu_);
  return regs_.at(id).own;
}

runtime::Caps Endpoint::caps() const {
  runtime::Caps k;
  k.device = true;
  k.on_caller_stream = true;
  k.capture_safe = true;
  k.wire = true;
  k.two_phase_close = true;
  return k;
}

// The same call as plan()'s: every field (a Call is plain values).
static bool same_call(const Call& a, const Call& b) {
  return a.coll == b.coll && a.dtype == b.dtype && a.op == b.op && a.numel == b.numel && a.in == b.in &&
         a.out == b.out && a.wire == b.wire;
}

Algo Endpoint::plan(const Call& c) {
  if (opt_.nranks < 2) return Algo::Auto;
  planned_ = plan_of(c);
  planned_call_ = c;
  has_planned_ = true;
  return planned_.algo;
}

void Endpoint::run(const Call& c, void* stream) {
  const bool reuse = has_planned_ && same_call(c, planned_call_);
  has_planned_ = false;
  run(c, static_cast<cudaStream_t>(stream), reuse ? &planned_ : nullptr);
}

void Endpoint::run(const Call& c, cudaStream_t stream, const Plan* plan) {
  if (closed_ || unmapped_) throw RingError("ringreduce: p2p communicator is closed");
  const int n = opt_.nranks;
  runtime::check_call(c, n, failure());
  // Before the call is counted: a deterministic call the group cannot run throws here, on every
  // rank alike, and the ranks stay in step; so does a copy-algorithm call that cannot run.
  const Plan p = n < 2 ? Plan{} : plan ? *plan : plan_of(c);
  if (n > 1 && p.algo == Algo::Copy) copy_check(stream);
  if (p.algo == Algo::Imported) {
    // Inside a capture no new mapping (the IPC calls would invalidate it): memory seen before only.
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    RR_CUDA_CHECK(cudaStreamIsCapturing(stream, &st));
    imp_ = imported_.prepare(c, st != cudaStreamCaptureStatusNone, ctl_, op_seq_);
  }
  ++op_seq_;
  LogOnReturn logged{calls_, op_seq_, stream};
  const size_t es = dtype_size(c.dtype);
  if (n == 1 && c.wire != Wire::None) {  // rounded as a group of one rounds: no workspace
    p2p::plan(c, opt_, true);  // its argument checks (the wire plan)
    launch_wire_local(c, &ctl_dev_->wire_overflow[op_seq_ % kWireOverflowSlots], op_seq_, stream);
    return;
  }
  if (n == 1) {  // AVG over one rank divides by 1: a copy at most
    if (c.in != c.out && c.numel > 0)
      RR_CUDA_CHECK(cudaMemcpyAsync(c.out, c.in, c.numel * es, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  if (!peers_[up_] || !peers_[down_]) throw RingError("ringreduce: p2p ring is not connected");
  try {
    if (p.algo == Algo::Copy) {
      run_copy(c, p, stream);
    } else {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      RR_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
      const bool graph = capture != cudaStreamCaptureStatusNone;
      if (graph) copy_host_abort(stream);
      if (p.algo == Algo::Ring) {
        Args a = args(c, p);
        a.graph = graph;
        launch(a, stream);
      } else {
        SymArgs a = sym_args(c, p);
        a.graph = graph;
        launch_sym(a, stream);
      }
    }
  } catch (const std::exception& e) {
    // The peers may be waiting for this call's kernel (or hold some of its pieces): stop everyone.
    abort(std::string("could not enqueue call #") + std::to_string(op_seq_) + ": " + e.what());
    throw;
  }
}

void Endpoint::copy_host_abort(cudaStream_t stream) const {
  RR_CUDA_CHECK(cudaMemcpyAsync(area_ + offsetof(Area, host_abort), &ctl_->abort, sizeof(uint32_t),
                                cudaMemcpyHostToDevice, stream));
}

void Endpoint::launch_again(const Call& c, cudaStream_t stream) const {
  const Plan p = plan_of(c);
  if (p.algo != Algo::Copy) copy_host_abort(stream);  // as a replay runs the captured copy first
  if (p.algo == Algo::Ring) {
    Args a = args(c, p);
    a.graph = 1;  // as a graph's replay
    launch(a, stream);
  } else if (p.algo != Algo::Copy) {
    SymArgs a = sym_args(c, p);
    a.graph = 1;
    launch_sym(a, stream);
  } else
    throw std::invalid_argument("ringreduce: the copy algorithm's calls are not launched again");
}

// What every kernel reads: this rank's and the peers' areas, the stop words and the call.
static void fill_base(KernelBase& a, const Call& c, const Plan& p, const std::vector<char*>& peers,
                      int up, int down) {
  const int n = static_cast<int>(peers.size());
  for (int q = 0; q < n && q < kMaxPeers; ++q) a.peer[q] = reinterpret_cast<Area*>(peers[q]);
  a.up = reinterpret_cast<Area*>(peers[up]);
  a.down = reinterpret_cast<Area*>(peers[down]);
  a.in = c.in;
  a.out = c.out;
  a.numel = c.numel;
  a.nranks = n;
  a.blocks = p.blocks;
  a.divisor = c.op == RedOp::Avg ? n : 1;
  a.coll = static_cast<uint8_t>(c.coll);
  a.dtype = static_cast<uint8_t>(c.dtype);
  a.op = static_cast<uint8_t>(c.op);
  a.algo = static_cast<uint8_t>(p.algo);
  a.wire = static_cast<uint8_t>(c.wire);
}

Args Endpoint::args(const Call& c, const Plan& p) const {
  Args a{};
  fill_base(a, c, p, peers_, up_, down_);
  a.self = reinterpret_cast<Area*>(area_);
  a.ctl = ctl_dev_;
  a.cctl = cctl_dev_;
  a.op_seq = op_seq_;
  a.timeout_ns = static_cast<uint64_t>(opt_.timeout_s * 1e9);
  a.rank = opt_.rank;
  a.self_data = area_ + data_offset();
  a.down_data = peers_[down_] ? peers_[down_] + data_offset() : nullptr;
  a.slice_elems = p.slice_elems;
  a.steps = p.steps;
  a.slot_stride = slot_stride(opt_.slice_bytes);
  if (p.algo == Algo::Copy) {
    a.self_data = area_ + copy_offset();
    a.slot_stride = slot_stride(opt_.copy_slot_bytes);
  }
  return a;
}

SymArgs Endpoint::sym_args(const Call& c, const Plan& p) const {
  SymArgs a{};
  fill_base(a, c, p, peers_, up_, down_);
  a.self = reinterpret_cast<Area*>(area_);
  a.ctl = ctl_dev_;
  a.cctl = cctl_dev_;
  a.op_seq = op_seq_;
  a.timeout_ns = static_cast<uint64_t>(opt_.timeout_s * 1e9);
  a.rank = opt_.rank;
  a.half_bytes = ws_half_bytes();
  a.chunk_elems = p.slice_elems;
  a.pieces = p.steps;
  if (c.wire != Wire::None)
    a.wire_span = workspace_wire_bytes(wire_scaled(c.wire), wire_elem_bytes(c.wire), p.slice_elems / kWireBlock);
  a.ll_at = ll_offset();
  a.ll_slot = ll_slot_bytes();
  const int n = opt_.nranks;
  if (p.algo == Algo::Registered) {
    std::lock_guard<std::mutex> lk(reg_mu_);
    const Reg& g = regs_[p.reg];
    for (int q = 0; q < n; ++q) a.data[q] = g.at[q] + p.reg_offset;
    a.reg_tag = (static_cast<uint64_t>(p.reg) + 1) << kRegTagShift | p.reg_offset;
  } else {
    for (int q = 0; q < n; ++q) a.data[q] = peers_[q] ? peers_[q] + ws_offset() : nullptr;
  }
  if (p.algo == Algo::Imported) {
    a.tag = imp_.tag;
    a.tag_hash = imp_.hash;
    for (int q = 0; q < n; ++q) a.imp[q] = imp_.at[q];
  }
  return a;
}

void Endpoint::abort(const std::string& why) {
  std::lock_guard<std::mutex> lk(mu_);
  abort_locked(why);
}

void Endpoint::abort_locked(const std::string& why, uint32_t cause) {
  if (!ctl_) return;
  if (reason_.empty()) reason_ = why;
  if (abort_seq_ == 0) abort_seq_ = op_seq_ + 1;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  reinterpret_cast<volatile uint32_t*>(&ctl_->abort)[0] = kCtlAbort;
  // Also stop the peers, which poll only their own memory: copy the abort word into every area this
  // rank maps (its own included) on a side stream, beside a kernel that may be spinning. Not awaited
  // here (close() synchronizes).
  if (area_ && opt_.nranks > 1 && *abort_src_ == 0) {
    *abort_src_ = abort_word(cause, opt_.rank);
    DeviceScope scope(device_);
    for (char* area : peers_)
      if (area)
        cudaMemcpyAsync(area + offsetof(Area, abort), abort_src_, sizeof(uint32_t),
                        cudaMemcpyHostToDevice, side_);
    cudaGetLastError();
  }
  // Then the copy algorithm's stream waits, here and at every peer (after the group's abort word:
  // a released stream's next kernel sees why).
  release_copy_waits_locked(abort_word(cause, opt_.rank));
  if (failure_.empty()) failure_ = "ringreduce: rank " + std::to_string(opt_.rank) + ": aborted: " + why;
}

void Endpoint::watch_peers(std::vector<runtime::Peer> peers) {
  // 50 ms: as the shared-memory ring's peer check; a /proc read per peer each time.
  watcher_ = std::make_unique<runtime::Ticker>(std::chrono::milliseconds(50), [this, peers] {
    const std::string dead = runtime::dead_peer(peers);
    if (dead.empty()) return;
    std::lock_guard<std::mutex> lk(mu_);
    if (reason_.empty()) abort_locked(dead);
  });
}

size_t Endpoint::kept_bytes() {
  std::lock_guard<std::mutex> lk(g_kept_mu);
  return g_kept_bytes;
}

using Pins = std::shared_ptr<std::atomic<int>>;

void* Endpoint::graph_pin() {
  pins_->fetch_add(1);
  return new Pins(pins_);
}

void Endpoint::release_graph_pin(void* pin) {
  Pins* p = static_cast<Pins*>(pin);
  (*p)->fetch_sub(1);
  delete p;
}

bool Endpoint::unmap_peers() {
  if (watcher_) watcher_->stop();  // they take mu_, and write into the peers' areas
  if (copy_watch_) copy_watch_->stop();
  imported_.stop();  // its closes beside ours
  std::lock_guard<std::mutex> lk(mu_);
  if (maps_kept_) return false;
  if (closed_ || unmapped_ || !area_) return true;
  if (pins_->load() > 0) return false;
  unmapped_ = true;
  DeviceScope scope(device_);
  if (side_) cudaStreamSynchronize(side_);  // abort words on their way into the peers' areas
  for (char*& p : peers_) {
    if (ipc_ && p && p != area_) cudaIpcCloseMemHandle(p);
    if (p != area_) p = nullptr;
  }
  std::lock_guard<std::mutex> rlk(reg_mu_);
  for (Reg& g : regs_) {
    if (g.ipc)
      for (char* p : g.at)
        if (p && p != g.own.get()) cudaIpcCloseMemHandle(p);
    g.at.clear();
    g.mapped = false;
  }
  imported_.close_mappings();
  cudaGetLastError();
  return true;
}

void Endpoint::close(bool peers_done) {
  if (watcher_) watcher_->stop();  // it takes mu_
  if (copy_watch_) copy_watch_->stop();  // and so does this one
  imported_.stop();
  calls_.close();
  std::lock_guard<std::mutex> lk(mu_);  // failure() and abort() read ctl_ and area_
  DeviceScope scope(device_);
  // A graph may still replay our kernels: keep everything they touch; stop them at their first
  // wait (this rank's flag only: the peers' areas may be gone).
  const bool replayable = area_ && pins_->load() > 0;
  const bool keep = area_ && opt_.nranks > 1 && !peers_done;
  if (keep) abort_locked("closed while a neighbour may still use this rank's memory");
  if (replayable) {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    reinterpret_cast<volatile uint32_t*>(&ctl_->abort)[0] = kCtlClosed;
  }
  if (side_) cudaStreamSynchronize(side_);
  if (replayable) maps_kept_ = true;
  if (ipc_ && !replayable)
    for (size_t q = 0; q < peers_.size(); ++q)
      if (peers_[q] && peers_[q] != area_) cudaIpcCloseMemHandle(peers_[q]);
  peers_.clear();
  // Shared buffers: unmapped like the areas; this rank's copy then lives as long as a tensor
  // holds it, or (kept, as the area is) until exit where a peer or a graph may still touch it.
  std::lock_guard<std::mutex> rlk(reg_mu_);
  for (Reg& g : regs_) {
    if (!g.own) continue;  // released
    if ((keep || replayable) && !g.kept) {  // a release under a graph pin kept it already
      g.kept = true;
      new std::shared_ptr<char>(g.own);  // never deleted: freed by the process's exit
      std::lock_guard<std::mutex> klk(g_kept_mu);
      g_kept_bytes += g.bytes;
    }
    if (g.ipc && !replayable)
      for (char* p : g.at)
        if (p && p != g.own.get()) cudaIpcCloseMemHandle(p);
  }
  regs_.clear();
  // Imported memory: the peers' mappings closed as the areas are (kept under a graph's pin); this
  // rank's exports withdrawn (the allocations are the caller's: nothing to free).
  if (!replayable) imported_.close_mappings();
  // This rank's exports: their holds dropped only where every peer has closed its mappings.
  imported_.release(!keep && !replayable);
  if (keep || replayable) {
    std::lock_guard<std::mutex> klk(g_kept_mu);
    g_kept_bytes += area_bytes();  // freed by the process's exit
  } else if (area_) {
    cudaFree(area_);
  }
  area_ = nullptr;
  closed_ = true;
  // A Work whose call failed on the device may be waited on after this (the worker's join timed
  // out): the first failed call must outlive the records it was read from.
  closed_failed_seq_ = failed_seq_locked();
  if (ctl_ && !replayable) cudaFreeHost(ctl_);
  ctl_ = ctl_dev_ = nullptr;
  if (abort_src_ && !replayable) cudaFreeHost(abort_src_);
  abort_src_ = nullptr;
  // The copy counters: unregistered and unmapped, unless this rank's stream may still write them
  // (then kept until exit, as the area is).
  if (cctl_ && !keep) {
    cudaHostUnregister(cctl_);
    runtime::shm_unmap(reinterpret_cast<char*>(cctl_), sizeof(CopyCtl));
  }
  cctl_ = cctl_dev_ = nullptr;
  if (side_) cudaStreamDestroy(side_);
  side_ = nullptr;
  cudaGetLastError();
}

}  // namespace ringreduce::cuda::p2p
