// The torch.distributed backend "ringreduce" as torch sees it: a c10d::Backend. The ring's
// operations on CPU tensors of a one-host group run from here straight into the shared-memory
// communicator (no Python, no GIL): synchronous calls on the calling thread, asynchronous ones
// queued on the communicator's executor, whose Work completes from C++. Everything else — the first
// call (which creates the communicator, collectively), other devices, multi-host plans, dtypes and
// ops the ring does not serve, the operations delegated to Gloo/NCCL — is forwarded to a Python
// object (ringreduce/backend.py). In C++ because torch's own Python trampoline for Backend forwards
// only some operations (not _allgather_base, _reduce_scatter_base, alltoall_base or getBackendName),
// and because a Work defined in Python loses its Python half once only C++ holds it.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "binding/shm_comm.h"
#include "binding/torch_types.h"

namespace {

namespace rr = ringreduce;
using c10d::Work;
using rr::binding::RingWork;
using rr::binding::WorkPtr;

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// What the C++ half runs without Python: the group's shared-memory communicator, once Python has
// created it (set_cpu), and counts of the calls it ran, by operation.
class Slot {
 public:
  std::shared_ptr<rr::binding::ShmComm> cpu() {
    std::lock_guard<std::mutex> lk(mu_);
    return cpu_;
  }
  void set_cpu(std::shared_ptr<rr::binding::ShmComm> c) {
    std::lock_guard<std::mutex> lk(mu_);
    cpu_ = std::move(c);
  }
  void count(const char* op) {
    std::lock_guard<std::mutex> lk(mu_);
    ++counts_[op];
  }
  std::map<std::string, int64_t> counts() {
    std::lock_guard<std::mutex> lk(mu_);
    return counts_;
  }

 private:
  std::mutex mu_;
  std::shared_ptr<rr::binding::ShmComm> cpu_;
  std::map<std::string, int64_t> counts_;
};

// The ring's code of a ReduceOp (ring/types.h: RedOp), or -1 (PREMUL_SUM, bitwise ops: Python's
// path delegates them).
int op_code(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return static_cast<int>(rr::RedOp::Sum);
    case c10d::ReduceOp::AVG: return static_cast<int>(rr::RedOp::Avg);
    case c10d::ReduceOp::MIN: return static_cast<int>(rr::RedOp::Min);
    case c10d::ReduceOp::MAX: return static_cast<int>(rr::RedOp::Max);
    case c10d::ReduceOp::PRODUCT: return static_cast<int>(rr::RedOp::Prod);
    default: return -1;
  }
}

bool ring_dtype(at::ScalarType t) {
  ringreduce::DType unused;
  return ringreduce::binding::try_dtype(t, unused);  // the dtypes the core reduces (torch_types.h)
}

// Dense CPU tensors of one ring dtype.
bool ring_can(const std::vector<at::Tensor>& ts) {
  if (ts.empty()) return false;
  for (const at::Tensor& t : ts)
    if (!t.defined() || !t.device().is_cpu() || t.layout() != at::kStrided || t.is_sparse() ||
        t.scalar_type() != ts[0].scalar_type() || !ring_dtype(t.scalar_type()))
      return false;
  return true;
}

template <class O>
auto async_of(const O& o, int) -> decltype(o.asyncOp) { return o.asyncOp; }
template <class O>
bool async_of(const O&, long) { return true; }

class ForwardingBackend : public c10d::Backend {
 public:
  ForwardingBackend(int rank, int size, py::object impl, std::shared_ptr<Slot> slot)
      : Backend(rank, size), impl_(std::move(impl)), slot_(std::move(slot)) {}
  ~ForwardingBackend() override {
    // Another thread taking the GIL while the interpreter finalizes is ended by pthread_exit, whose
    // unwinding through this (noexcept) destructor would abort the process: leak the object then.
    if (Py_IsInitialized() && (PyGILState_Check() || !finalizing())) {
      py::gil_scoped_acquire gil;
      impl_ = py::object();
    } else {
      impl_.release();  // the interpreter is gone or going: nothing to decrement
    }
  }
  const std::string getBackendName() const override { return "ringreduce"; }

  template <class... Args>
  WorkPtr call(const char* name, Args&&... args) {
    rr::runtime::SourceScope source(rr::runtime::Source::Backend);
    py::gil_scoped_acquire gil;
    return impl_.attr(name)(std::forward<Args>(args)...).template cast<WorkPtr>();
  }

  WorkPtr broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    return call("broadcast", t, o);
  }
  WorkPtr allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    const int code = op_code(o.reduceOp);
    if (code >= 0 && ring_can(t))
      if (auto c = open_cpu()) {
        slot_->count("ring allreduce");
        return run(*c, t.size() == 1 ? c->all_reduce(t[0], code) : c->all_reduce_flat(t, code),
                   async_of(o, 0), c10d::OpType::ALLREDUCE);
      }
    return call("allreduce", t, o);
  }
  WorkPtr allreduce_sparse(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return call("allreduce_sparse", t, o);
  }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o) override {
    const int code = op_code(o.reduceOp);
    if (code >= 0 && ring_can(t))
      if (auto c = open_cpu()) {
        slot_->count("ring allreduce_coalesced");
        return run(*c, c->all_reduce_flat(t, code), async_of(o, 0), c10d::OpType::ALLREDUCE_COALESCED);
      }
    return call("allreduce_coalesced", t, o);
  }
  WorkPtr reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    return call("reduce", t, o);
  }
  // The list form with one input: gathered into one buffer by the ring, then split.
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                    const c10d::AllgatherOptions& o) override {
    if (in.size() == 1 && out.size() == 1 && same_shapes(out[0], in[0]))
      if (auto c = open_cpu()) {
        std::vector<at::Tensor> outs = out[0];
        const at::Tensor inp = in[0];
        at::Tensor flat = at::empty({size_ * inp.numel()}, inp.options());
        rr::binding::Prepared p = c->all_gather(flat, inp.reshape(-1));
        p.after = [outs, flat, n = inp.numel()]() mutable {
          for (size_t r = 0; r < outs.size(); ++r)
            outs[r].copy_(flat.narrow(0, static_cast<int64_t>(r) * n, n).view(outs[r].sizes()));
        };
        p.outputs = outs;
        slot_->count("ring allgather");
        return run(*c, std::move(p), async_of(o, 0), c10d::OpType::ALLGATHER);
      }
    return call("allgather", out, in, o);
  }
  WorkPtr _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    if (ring_can({out, in}))
      if (auto c = open_cpu()) {
        rr::binding::check_sizes("all_gather_into_tensor", "output_tensor", out, "input_tensor", in, size_);
        slot_->count("ring _allgather_base");
        return run(*c, c->all_gather(out, in), async_of(o, 0), c10d::OpType::_ALLGATHER_BASE);
      }
    return call("_allgather_base", out, in, o);
  }
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                              const c10d::AllgatherOptions& o) override {
    return call("allgather_coalesced", out, in, o);
  }
  // Several all_gather_into_tensor calls as one Work (functional collectives, FSDP2): one job.
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllgatherOptions& o) override {
    if (!out.empty() && out.size() == in.size() && ring_can(out) && ring_can(in) &&
        out[0].scalar_type() == in[0].scalar_type())
      if (auto c = open_cpu()) {
        rr::binding::Prepared all;
        for (size_t i = 0; i < out.size(); ++i) {
          rr::binding::check_sizes("all_gather_into_tensor", "output_tensor", out[i], "input_tensor", in[i], size_);
          rr::binding::Prepared p = c->all_gather(out[i], in[i]);
          if (i == 0) all = std::move(p); else all.append(std::move(p));
        }
        slot_->count("ring allgather_into_tensor_coalesced");
        return run(*c, std::move(all), async_of(o, 0), c10d::OpType::_ALLGATHER_BASE);
      }
    return call("allgather_into_tensor_coalesced", out, in, o);
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                 const c10d::GatherOptions& o) override {
    return call("gather", out, in, o);
  }
  WorkPtr scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                  const c10d::ScatterOptions& o) override {
    return call("scatter", out, in, o);
  }
  // The list form with one output: the inputs concatenated, reduce-scattered by the ring.
  WorkPtr reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                         const c10d::ReduceScatterOptions& o) override {
    const int code = op_code(o.reduceOp);
    if (code >= 0 && in.size() == 1 && out.size() == 1 && same_shapes(in[0], out[0]))
      if (auto c = open_cpu()) {
        std::vector<at::Tensor> parts;
        for (const at::Tensor& t : in[0]) parts.push_back(t.reshape(-1));
        rr::binding::Prepared p = c->reduce_scatter(out[0], at::cat(parts), code);
        slot_->count("ring reduce_scatter");
        return run(*c, std::move(p), async_of(o, 0), c10d::OpType::REDUCE_SCATTER);
      }
    return call("reduce_scatter", out, in, o);
  }
  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override {
    const int code = op_code(o.reduceOp);
    if (code >= 0 && ring_can({out, in}))
      if (auto c = open_cpu()) {
        rr::binding::check_sizes("reduce_scatter_tensor", "input", in, "output", out, size_);
        slot_->count("ring _reduce_scatter_base");
        return run(*c, c->reduce_scatter(out, in, code), async_of(o, 0),
                   c10d::OpType::_REDUCE_SCATTER_BASE);
      }
    return call("_reduce_scatter_base", out, in, o);
  }
  // Several reduce_scatter_tensor calls as one Work (functional collectives, FSDP2): one job.
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::ReduceScatterOptions& o) override {
    const int code = op_code(o.reduceOp);
    if (code >= 0 && !out.empty() && out.size() == in.size() && ring_can(out) && ring_can(in) &&
        out[0].scalar_type() == in[0].scalar_type())
      if (auto c = open_cpu()) {
        rr::binding::Prepared all;
        for (size_t i = 0; i < out.size(); ++i) {
          rr::binding::check_sizes("reduce_scatter_tensor", "input", in[i], "output", out[i], size_);
          rr::binding::Prepared p = c->reduce_scatter(out[i], in[i], code);
          if (i == 0) all = std::move(p); else all.append(std::move(p));
        }
        slot_->count("ring reduce_scatter_tensor_coalesced");
        return run(*c, std::move(all), async_of(o, 0), c10d::OpType::_REDUCE_SCATTER_BASE);
      }
    return call("reduce_scatter_tensor_coalesced", out, in, o);
  }
  WorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                        std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    return call("alltoall_base", out, in, out_splits, in_splits, o);
  }
  WorkPtr alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                   const c10d::AllToAllOptions& o) override {
    return call("alltoall", out, in, o);
  }
  WorkPtr send(std::vector<at::Tensor>& t, int dst, int tag) override { return call("send", t, dst, tag); }
  WorkPtr recv(std::vector<at::Tensor>& t, int src, int tag) override { return call("recv", t, src, tag); }
  WorkPtr recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    return call("recv_anysource", t, tag);
  }
  WorkPtr barrier(const c10d::BarrierOptions& o) override { return call("barrier", o); }

  // dist.shrink_group: the survivors agree on the lost ranks and get a new backend of their own
  // (ringreduce/backend.py: RingBackend.shrink). torch passes the excluded ranks sorted and checked.
  bool supportsShrinking() const override { return true; }
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude, int flags,
                                           const c10::intrusive_ptr<Options>&) override {
    py::gil_scoped_acquire gil;
    return impl_.attr("shrink")(ranks_to_exclude, flags).template cast<c10::intrusive_ptr<c10d::Backend>>();
  }
  py::object impl() const { return impl_; }

 private:
  // The group's shared-memory communicator when Python has made it and it is still open.
  std::shared_ptr<rr::binding::ShmComm> open_cpu() {
    auto c = slot_->cpu();
    if (c && c->closed()) c.reset();
    return c;
  }

  // Runs p now (a completed Work; errors raised here, as the direct API's synchronous call) or
  // queued (the executor's Work).
  WorkPtr run(rr::binding::ShmComm& c, rr::binding::Prepared p, bool async_op, c10d::OpType type) {
    std::vector<at::Tensor> outputs = p.outputs;
    rr::runtime::SourceScope source(rr::runtime::Source::Backend);
    WorkPtr w = c.start(std::move(p), async_op, type, /*gil=*/false);
    if (w) return w;
    return c10::make_intrusive<rr::binding::DoneWork>(type, std::move(outputs));
  }

  // One tensor per rank, each of like's shape and dtype, all ring tensors.
  bool same_shapes(const std::vector<at::Tensor>& ts, const at::Tensor& like) {
    if (static_cast<int>(ts.size()) != size_) return false;
    std::vector<at::Tensor> all = ts;
    all.push_back(like);
    if (!ring_can(all)) return false;
    for (const at::Tensor& t : ts)
      if (t.sizes() != like.sizes()) return false;
    return true;
  }

  py::object impl_;
  std::shared_ptr<Slot> slot_;
};

}  // namespace

void register_backend(py::module_& m) {
  py::class_<Slot, std::shared_ptr<Slot>>(m, "BackendSlot")
      .def(py::init<>())
      .def("set_cpu", &Slot::set_cpu, py::arg("comm"),
           "the shared-memory communicator the C++ half runs CPU ring calls on (None: none)")
      .def("counts", &Slot::counts, "calls the C++ half ran on the ring, by operation");
  m.def("make_backend", [](int rank, int size, py::object impl, std::shared_ptr<Slot> slot)
            -> c10::intrusive_ptr<c10d::Backend> {
    return c10::make_intrusive<ForwardingBackend>(rank, size, std::move(impl), std::move(slot));
  }, py::arg("rank"), py::arg("size"), py::arg("impl"), py::arg("slot"));
  m.def("backend_impl", [](const c10::intrusive_ptr<c10d::Backend>& b) -> py::object {
    auto* f = dynamic_cast<ForwardingBackend*>(b.get());
    return f ? f->impl() : py::none();
  }, py::arg("backend"), "the RingBackend behind a group's backend; None for another backend's");
  // op: the name of the Backend method, for profilers and debug output.
  m.def("ring_work", [](const std::string& op, std::vector<at::Tensor> outputs) -> WorkPtr {
    return c10::make_intrusive<RingWork>(rr::binding::op_type(op), std::move(outputs));
  }, py::arg("op"), py::arg("outputs"));
  m.def("ring_work_complete", [](const WorkPtr& work, const std::string& error) {
    auto* w = dynamic_cast<RingWork*>(work.get());
    TORCH_CHECK(w, "ringreduce: ring_work_complete: not a ring Work");
    py::gil_scoped_release nogil;  // DDP's callbacks on the future may run here
    w->complete(error);
  }, py::arg("work"), py::arg("error"));
}
