// Host side of the p2p transport, the front (endpoint.h): construction, the plan, launches, and
// the close that walks the parts in order.
#include "cuda/p2p/endpoint.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "cuda/host.h"
#include "cuda/p2p/kept.h"

namespace ringreduce::cuda::p2p {

Endpoint::Endpoint(const Options& opt) : opt_(opt) {
  check_options(opt);
  RR_CUDA_CHECK(cudaGetDevice(&device_));
  if (opt_.max_blocks == 0) opt_.max_blocks = sm_count();
  up_ = ring::mod(opt.rank - 1, opt.nranks);
  down_ = ring::mod(opt.rank + 1, opt.nranks);
  try {
    areas_.create(layout_);
    // An abort reaches the peers through their areas' abort words, then the copy waits.
    failures_.create([this](uint32_t word) {
      areas_.post_abort(word);
      copy_.release_waits(word);
    });
    if (copies())
      copy_.watch(
          failures_.ctl(), [this] { return broken(); },
          [this](const std::string& why, uint64_t call) { failures_.fail(why, call, kTimeout); });
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
  if (!areas_.own()) return;
  DeviceScope scope(device_);
  RR_CUDA_CHECK(cudaStreamSynchronize(areas_.side()));
  for (int b = 0; b < kMaxSymBlocks; ++b) {
    Area* at = reinterpret_cast<Area*>(areas_.own());
    RR_CUDA_CHECK(cudaMemcpy(&at->sym[b].epoch.value, &epoch, 8, cudaMemcpyHostToDevice));
    RR_CUDA_CHECK(cudaMemcpy(&at->sym[b].ll.value, &ll_calls, 8, cudaMemcpyHostToDevice));
  }
  RR_CUDA_CHECK(cudaDeviceSynchronize());  // a copy from pageable memory may land late
}

std::string Endpoint::handle() const {
  if (closed_) throw closed_error();
  return areas_.handle();
}

void Endpoint::connect(const std::vector<std::string>& handles) {
  if (opt_.nranks == 1) return;
  areas_.connect(handles, up_, down_, opt_.direct && opt_.nranks <= kMaxPeers);
}

void Endpoint::set_ll_max(size_t bytes) {
  // The slots were sized for the reach at construction; a smaller one fits them.
  const size_t cap = layout_.ll_reach();
  if (bytes > cap)
    throw std::invalid_argument("ringreduce: p2p LL reach " + std::to_string(bytes) + " B is more than its " +
                                "buffers hold (" + std::to_string(cap) + " B)");
  opt_.ll_max = static_cast<int64_t>(bytes);
}

void Endpoint::set_sym_blocks(int blocks) {
  check_sym_blocks(blocks);
  opt_.sym_blocks = blocks;
}

void Endpoint::connect_local(const std::vector<const Endpoint*>& rings) {
  std::vector<const Areas*> others;
  for (const Endpoint* e : rings) others.push_back(&e->areas_);
  areas_.connect_local(others, opt_.direct && opt_.nranks <= kMaxPeers);
}

Memory Endpoint::memory_of(const Call& c) const {
  Memory m = registered_.find(c.in, static_cast<size_t>(c.numel) * dtype_size(c.dtype));
  m.board = imported_.attached();
  return m;
}

Plan Endpoint::plan_of(const Call& c) const { return p2p::plan(c, opt_, direct(), memory_of(c)); }

int Endpoint::reg_alloc(size_t bytes, std::string* handle) {
  if (closed_) throw closed_error();
  if (opt_.nranks > 1 && !direct())
    throw RingError("ringreduce: shared buffers need every rank of the group to map every other "
                    "rank's memory through CUDA IPC (and at most " + std::to_string(kMaxPeers) +
                    " ranks); this group cannot");
  return registered_.alloc(bytes, handle);
}

void Endpoint::reg_connect(int id, const std::vector<std::string>& handles) { registered_.connect(id, handles); }

void Endpoint::reg_connect_local(int id, const std::vector<const Endpoint*>& rings) {
  std::vector<const Registered*> others;
  for (const Endpoint* e : rings) others.push_back(&e->registered_);
  registered_.connect_local(id, others);
}

void Endpoint::reg_release(int id) { registered_.release(id, pins_->load() > 0, broken()); }

std::shared_ptr<char> Endpoint::reg_memory(int id) const { return registered_.memory(id); }

runtime::Caps Endpoint::caps() const {
  runtime::Caps k;
  k.device = true;
  k.on_caller_stream = true;
  k.capture_safe = true;
  k.wire = true;
  k.two_phase_close = true;
  return k;
}

void Endpoint::run(const Call& c, cudaStream_t stream, const Plan* plan) {
  if (closed_ || unmapped_) throw closed_error();
  const int n = opt_.nranks;
  runtime::check_call(c, n, failure());
  // Before the call is counted: a deterministic call the group cannot run throws here, on every
  // rank alike, and the ranks stay in step; so does a copy-algorithm call that cannot run.
  const Plan p = n < 2 ? Plan{} : plan ? *plan : plan_of(c);
  if (n > 1 && p.algo == Algo::Copy) copy_.check(c.captured);
  if (p.algo == Algo::Imported) {
    // Inside a capture no new mapping (the IPC calls would invalidate it): memory seen before only.
    imp_ = imported_.prepare(c, c.captured, failures_.ctl(), op_seq_);
  }
  ++op_seq_;
  LogOnReturn logged{calls_, op_seq_, stream, c.captured};
  const size_t es = dtype_size(c.dtype);
  if (n == 1 && c.wire != Wire::None) {  // rounded as a group of one rounds: no workspace
    p2p::plan(c, opt_, true);  // its argument checks (the wire plan)
    launch_wire_local(c, &failures_.ctl_dev()->wire_overflow[op_seq_ % kWireOverflowSlots], op_seq_, stream);
    return;
  }
  if (n == 1) {  // AVG over one rank divides by 1: a copy at most
    if (c.in != c.out && c.numel > 0)
      RR_CUDA_CHECK(cudaMemcpyAsync(c.out, c.in, c.numel * es, cudaMemcpyDeviceToDevice, stream));
    return;
  }
  if (!areas_.all()[up_] || !areas_.all()[down_]) throw RingError("ringreduce: p2p ring is not connected");
  try {
    if (p.algo == Algo::Copy) {
      copy_.run(c, p, args(c, p), areas_.all(), failures_.ctl_dev(), op_seq_, stream);
    } else {
      const bool graph = c.captured;
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
  RR_CUDA_CHECK(cudaMemcpyAsync(areas_.own() + offsetof(Area, host_abort), &failures_.ctl()->abort,
                                sizeof(uint32_t), cudaMemcpyHostToDevice, stream));
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
  fill_base(a, c, p, areas_.all(), up_, down_);
  a.self = reinterpret_cast<Area*>(areas_.own());
  a.ctl = failures_.ctl_dev();
  a.cctl = copy_.counters_dev();
  a.op_seq = op_seq_;
  a.timeout_ns = static_cast<uint64_t>(opt_.timeout_s * 1e9);
  a.rank = opt_.rank;
  const std::vector<char*>& at = areas_.all();
  a.self_data = areas_.own() + layout_.fifo_at();
  a.down_data = at[down_] ? at[down_] + layout_.fifo_at() : nullptr;
  a.slice_elems = p.slice_elems;
  a.steps = p.steps;
  a.slot_stride = slot_stride(opt_.slice_bytes);
  if (p.algo == Algo::Copy) {
    a.self_data = areas_.own() + layout_.inbox_at();
    a.slot_stride = slot_stride(opt_.copy_slot_bytes);
  }
  return a;
}

SymArgs Endpoint::sym_args(const Call& c, const Plan& p) const {
  SymArgs a{};
  fill_base(a, c, p, areas_.all(), up_, down_);
  a.self = reinterpret_cast<Area*>(areas_.own());
  a.ctl = failures_.ctl_dev();
  a.cctl = copy_.counters_dev();
  a.op_seq = op_seq_;
  a.timeout_ns = static_cast<uint64_t>(opt_.timeout_s * 1e9);
  a.rank = opt_.rank;
  a.half_bytes = layout_.half;
  a.chunk_elems = p.slice_elems;
  a.pieces = p.steps;
  if (c.wire != Wire::None)
    a.wire_span = workspace_wire_bytes(wire_scaled(c.wire), wire_elem_bytes(c.wire), p.slice_elems / kWireBlock);
  a.ll_at = layout_.ll_at();
  a.ll_slot = layout_.ll_slot;
  fill_data(p, &a);
  return a;
}

void Endpoint::fill_data(const Plan& p, SymArgs* a) const {
  const int n = opt_.nranks;
  if (p.algo == Algo::Registered) {
    registered_.addresses(p.reg, p.reg_offset, a->data);
    a->reg_tag = (static_cast<uint64_t>(p.reg) + 1) << kRegTagShift | p.reg_offset;
    return;
  }
  const std::vector<char*>& at = areas_.all();
  for (int q = 0; q < n; ++q) a->data[q] = at[q] ? at[q] + layout_.workspace_at() : nullptr;
  if (p.algo == Algo::Imported) {
    a->tag = imp_.tag;
    a->tag_hash = imp_.hash;
    for (int q = 0; q < n; ++q) a->imp[q] = imp_.at[q];
  }
}

size_t Endpoint::kept_bytes() { return kept_counter().load(); }

void Endpoint::stop_threads() {
  failures_.stop();
  copy_.stop();
  imported_.stop();  // its IPC closes would run into the runtime's teardown
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
  stop_threads();  // the watchers write into the peers' areas; the reaper closes beside us
  if (maps_kept_) return false;
  if (closed_ || unmapped_ || !areas_.own()) return true;
  if (pins_->load() > 0) return false;
  unmapped_ = true;
  areas_.unmap();
  registered_.unmap();
  imported_.close_mappings();
  return true;
}

void Endpoint::close(bool peers_done) {
  stop_threads();
  calls_.close();
  DeviceScope scope(device_);
  // A graph may still replay our kernels: keep everything they touch; stop them at their first
  // wait (this rank's flag only: the peers' areas may be gone).
  const bool replayable = areas_.own() && pins_->load() > 0;
  const bool keep = areas_.own() && opt_.nranks > 1 && !peers_done;
  failures_.close_begin(keep, replayable);
  if (replayable) maps_kept_ = true;
  areas_.close(keep, replayable);  // after the abort words have landed (its side stream)
  // Shared buffers: unmapped like the areas; this rank's copy then lives as long as a tensor
  // holds it, or (kept, as the area is) until exit where a peer or a graph may still touch it.
  registered_.close(replayable, keep);
  // Imported memory: the peers' mappings closed as the areas are (kept under a graph's pin); this
  // rank's exports withdrawn (the allocations are the caller's: nothing to free), their holds
  // dropped only where every peer has closed its mappings.
  if (!replayable) imported_.close_mappings();
  imported_.release(!keep && !replayable);
  closed_ = true;
  failures_.close_end(replayable);
  // The copy counters, unless this rank's stream may still write them (kept until exit).
  copy_.close(keep);
  cudaGetLastError();
}

}  // namespace ringreduce::cuda::p2p
