// The torch.distributed backend "ringreduce" as torch sees it: a c10d::Backend that forwards every
// operation to a Python object (ringreduce/backend.py), which runs it on the ring or hands it to a
// Gloo/NCCL delegate. In C++ because torch's own Python trampoline for Backend forwards only some
// operations (not _allgather_base, _reduce_scatter_base, alltoall_base or getBackendName, which
// all_gather_into_tensor, reduce_scatter_tensor and FSDP use), and because a Work defined in Python
// loses its Python half once only C++ holds it. The ring's Work is RingWork, completed from Python.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/extension.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace {

using c10d::Work;
using WorkPtr = c10::intrusive_ptr<Work>;

// A collective the ring runs: done when Python calls complete(); its future holds the output
// tensors (as c10d's own backends' futures do: DDP's reducer reads them).
class RingWork : public Work {
 public:
  RingWork(c10d::OpType op, std::vector<at::Tensor> outputs) : Work(-1, op), outputs_(std::move(outputs)) {
    std::vector<c10::Device> devices;
    for (const at::Tensor& t : outputs_)
      if (!t.device().is_cpu()) {
        devices.push_back(t.device());
        break;
      }
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()),
                                                       devices);
  }
  // error "": success. Called once, from the thread that saw the collective end.
  void complete(const std::string& error) {
    if (error.empty()) {
      future_->markCompleted(c10::IValue(outputs_));
      finish();
    } else {
      auto e = std::make_exception_ptr(std::runtime_error(error));
      future_->setError(e);
      finish(e);
    }
  }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

class ForwardingBackend : public c10d::Backend {
 public:
  ForwardingBackend(int rank, int size, py::object impl) : Backend(rank, size), impl_(std::move(impl)) {}
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
    py::gil_scoped_acquire gil;
    return impl_.attr(name)(std::forward<Args>(args)...).template cast<WorkPtr>();
  }

  WorkPtr broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    return call("broadcast", t, o);
  }
  WorkPtr allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return call("allreduce", t, o);
  }
  WorkPtr allreduce_sparse(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return call("allreduce_sparse", t, o);
  }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o) override {
    return call("allreduce_coalesced", t, o);
  }
  WorkPtr reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    return call("reduce", t, o);
  }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                    const c10d::AllgatherOptions& o) override {
    return call("allgather", out, in, o);
  }
  WorkPtr _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    return call("_allgather_base", out, in, o);
  }
  WorkPtr allgather_coalesced(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                              const c10d::AllgatherOptions& o) override {
    return call("allgather_coalesced", out, in, o);
  }
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllgatherOptions& o) override {
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
  WorkPtr reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                         const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter", out, in, o);
  }
  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override {
    return call("_reduce_scatter_base", out, in, o);
  }
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::ReduceScatterOptions& o) override {
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

 private:
  py::object impl_;
};

}  // namespace

void register_backend(py::module_& m) {
  m.def("make_backend", [](int rank, int size, py::object impl) -> c10::intrusive_ptr<c10d::Backend> {
    return c10::make_intrusive<ForwardingBackend>(rank, size, std::move(impl));
  }, py::arg("rank"), py::arg("size"), py::arg("impl"));
  // op: the name of the Backend method, for profilers and debug output.
  m.def("ring_work", [](const std::string& op, std::vector<at::Tensor> outputs) -> WorkPtr {
    c10d::OpType type = c10d::OpType::UNKNOWN;
    if (op == "allreduce") type = c10d::OpType::ALLREDUCE;
    else if (op == "allreduce_coalesced") type = c10d::OpType::ALLREDUCE_COALESCED;
    else if (op == "allgather") type = c10d::OpType::ALLGATHER;
    else if (op == "_allgather_base") type = c10d::OpType::_ALLGATHER_BASE;
    else if (op == "reduce_scatter") type = c10d::OpType::REDUCE_SCATTER;
    else if (op == "_reduce_scatter_base") type = c10d::OpType::_REDUCE_SCATTER_BASE;
    return c10::make_intrusive<RingWork>(type, std::move(outputs));
  }, py::arg("op"), py::arg("outputs"));
  m.def("ring_work_complete", [](const WorkPtr& work, const std::string& error) {
    auto* w = dynamic_cast<RingWork*>(work.get());
    TORCH_CHECK(w, "ringreduce: ring_work_complete: not a ring Work");
    py::gil_scoped_release nogil;  // DDP's callbacks on the future may run here
    w->complete(error);
  }, py::arg("work"), py::arg("error"));
}
