// Python binding: torch tensors in, typed spans out. Thin and defensive; the ring lives elsewhere.
#include <torch/extension.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <torch/csrc/autograd/python_variable.h>

#include "shm/segment.h"
#include "torch_types.h"

namespace rr = ringreduce;

// Defined in csrc/backend.cpp: the torch.distributed backend's C++ half.
void register_backend(py::module_& m);

#ifdef RINGREDUCE_WITH_CUDA
// Defined in csrc/cuda/binding_cuda.cpp: adds the CUDA communicator classes to the module.
void register_cuda(py::module_& m);
#endif

namespace {

// Python delivers signals to the main thread only; the module is imported there.
unsigned long& main_thread_ident() {
  static unsigned long ident = 0;
  return ident;
}

rr::shm::Algo parse_algo(const std::string& name) {
  for (auto a : {rr::shm::Algo::Auto, rr::shm::Algo::Ring, rr::shm::Algo::OneShot})
    if (name == rr::shm::algo_name(a)) return a;
  TORCH_CHECK_VALUE(false, "ringreduce: RINGREDUCE_ALGO must be auto, ring or oneshot, got '", name, "'");
}

void check_cpu(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "ringreduce: ", arg, " is on ", t.device(),
                    "; the shared-memory transport takes CPU tensors");
  TORCH_CHECK_VALUE(t.is_contiguous(), "ringreduce: ", arg, " must be contiguous");
}

class ShmComm {
 public:
  ShmComm(const std::string& name, bool create, int rank, int nranks, size_t slice_bytes,
          double timeout_s, int64_t spin_ns, int64_t yield_ns, const std::string& algo,
          int64_t oneshot_max_bytes) {
    rr::shm::Options opt;
    opt.rank = rank;
    opt.nranks = nranks;
    opt.timeout_s = timeout_s;
    opt.spin_ns = spin_ns;
    opt.yield_ns = yield_ns;
    opt.algo = parse_algo(algo);
    TORCH_CHECK_VALUE(oneshot_max_bytes >= 0, "ringreduce: oneshot_max_bytes must be >= 0, got ",
                      oneshot_max_bytes);
    opt.oneshot_max_bytes = static_cast<size_t>(oneshot_max_bytes);
    nranks_ = nranks;
    TORCH_CHECK_VALUE(slice_bytes >= 64, "ringreduce: slice_bytes must be >= 64, got ", slice_bytes);
    comm_ = std::make_unique<rr::shm::Comm>(name, create, opt, slice_bytes);
  }

  void all_reduce(at::Tensor t, int op) {
    check_cpu(t, "tensor");
    run({rr::Coll::AllReduce, rr::to_dtype(t, "tensor"), rr::to_op(op), t.numel(), t.data_ptr(), t.data_ptr()});
  }

  // The fast path of ringreduce.all_reduce: runs a synchronous all-reduce of obj and returns true
  // when obj is a plain (not a subclass), contiguous CPU tensor of a supported dtype and no other
  // call is running on this communicator; otherwise returns false and touches nothing (the caller
  // takes the full path, which checks and raises). op is a valid code (the caller's table).
  bool try_all_reduce(py::handle obj, int op) {
    if (!THPVariable_CheckExact(obj.ptr())) return false;
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    if (t.layout() != at::kStrided || !t.device().is_cpu() || !t.is_contiguous()) return false;
    rr::DType dt;
    switch (t.scalar_type()) {
      case at::kFloat: dt = rr::DType::F32; break;
      case at::kDouble: dt = rr::DType::F64; break;
      case at::kHalf: dt = rr::DType::F16; break;
      case at::kBFloat16: dt = rr::DType::BF16; break;
      case at::kChar: dt = rr::DType::I8; break;
      case at::kByte: dt = rr::DType::U8; break;
      case at::kInt: dt = rr::DType::I32; break;
      case at::kLong: dt = rr::DType::I64; break;
      default: return false;
    }
    std::unique_lock<std::mutex> lk(run_mu_, std::try_to_lock);
    if (!lk.owns_lock() || comm_->closed()) return false;
    run_locked({rr::Coll::AllReduce, dt, rr::to_op(op), t.numel(), t.data_ptr(), t.data_ptr()});
    return true;
  }

  void reduce_scatter(at::Tensor out, const at::Tensor& in, int op) {
    check_cpu(out, "output");
    check_cpu(in, "input");
    TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(), "ringreduce: output dtype ",
                     out.scalar_type(), " differs from input dtype ", in.scalar_type());
    TORCH_CHECK_VALUE(in.numel() == out.numel() * nranks(), "ringreduce: input has ", in.numel(),
                      " elements; expected output.numel() * world size = ", out.numel() * nranks());
    run({rr::Coll::ReduceScatter, rr::to_dtype(in, "input"), rr::to_op(op), in.numel(), in.data_ptr(),
         out.data_ptr()});
  }

  void all_gather(at::Tensor out, const at::Tensor& in) {
    check_cpu(out, "output_tensor");
    check_cpu(in, "input_tensor");
    TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(), "ringreduce: output_tensor dtype ",
                     out.scalar_type(), " differs from input_tensor dtype ", in.scalar_type());
    TORCH_CHECK_VALUE(out.numel() == in.numel() * nranks(), "ringreduce: output_tensor has ",
                      out.numel(), " elements; expected input_tensor.numel() * world size = ",
                      in.numel() * nranks());
    run({rr::Coll::AllGather, rr::to_dtype(in, "input_tensor"), rr::RedOp::Sum, out.numel(), in.data_ptr(),
         out.data_ptr()});
  }

  void abort(const std::string& why) {
    if (!comm_->closed()) comm_->ring().abort(why);
  }
  bool broken() { return !comm_->closed() && comm_->ring().broken(); }
  std::string reason() { return comm_->closed() ? "" : comm_->ring().abort_reason(); }
  int64_t slice_bytes() { return static_cast<int64_t>(comm_->ring().slice_bytes()); }
  int64_t op_seq() { return static_cast<int64_t>(comm_->ring().op_seq()); }
  // The algorithm an all-reduce of numel elements of dtype runs with.
  std::string algo(int64_t numel, const at::Tensor& like) {
    const rr::Call c{rr::Coll::AllReduce, rr::to_dtype(like, "like"), rr::RedOp::Sum, numel, nullptr, nullptr};
    return rr::shm::algo_name(comm_->ring().choose(c));
  }
  void close() {
    std::unique_lock<std::mutex> lk(run_mu_, std::try_to_lock);
    if (!lk.owns_lock()) {  // a call still holds it (it ends: aborted or done); wait without the GIL
      py::gil_scoped_release nogil;
      lk.lock();
    }
    comm_->close();
  }
  bool closed() { return comm_->closed(); }

 private:
  int nranks() const { return nranks_; }
  // Waits release the GIL. On the main thread a pending signal (Ctrl-C) ends the wait: the group
  // is aborted and the handler's exception (KeyboardInterrupt) is raised instead of RingReduceError.
  void run(const rr::Call& c) {
    std::unique_lock<std::mutex> lk(run_mu_, std::try_to_lock);
    if (!lk.owns_lock()) {
      py::gil_scoped_release nogil;  // never wait for the lock holding the GIL
      lk.lock();
    }
    run_locked(c);  // closed: ring() raises RingError
  }
  // run_mu_ held: calls on one communicator never overlap (threads, the fast path, the worker).
  void run_locked(const rr::Call& c) {
    std::unique_ptr<py::error_already_set> pending;
    const std::function<bool()> check = [&pending] {
      py::gil_scoped_acquire gil;
      if (PyErr_CheckSignals() == 0) return false;
      pending = std::make_unique<py::error_already_set>();
      return true;
    };
    const bool main_thread = PyThread_get_thread_ident() == main_thread_ident();
    try {
      py::gil_scoped_release nogil;
      comm_->ring().run(c, main_thread ? &check : nullptr);
    } catch (const rr::RingError&) {
      if (pending) throw *pending;
      throw;
    }
  }

  std::unique_ptr<rr::shm::Comm> comm_;
  std::mutex run_mu_;
  int nranks_ = 0;
};

// The fast path as a plain CPython function (METH_FASTCALL): fast(tensor, op) -> bool. pybind11's
// dispatch costs ~0.3 us a call and hashing a ReduceOp ~0.4 us, as much as an all-reduce of 4 KiB
// between two ranks; this costs a C call. op must be one of the ReduceOp objects given when the
// function was made (identity, in code order); anything else returns False (the caller's full path).
PyObject* ring_error_type = nullptr;

struct FastCall {
  py::object owner;          // the ShmComm's Python object: keeps comm alive
  ShmComm* comm;
  std::vector<py::object> ops;  // ops[code]
};

constexpr const char* kFastCapsule = "ringreduce.FastCall";

PyObject* fast_all_reduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* f = static_cast<FastCall*>(PyCapsule_GetPointer(self, kFastCapsule));
  if (f == nullptr) return nullptr;
  if (nargs != 2) {
    PyErr_Format(PyExc_TypeError, "fast all_reduce takes (tensor, op), got %zd arguments", nargs);
    return nullptr;
  }
  int code = -1;
  for (size_t i = 0; i < f->ops.size(); ++i)
    if (args[1] == f->ops[i].ptr()) code = static_cast<int>(i);
  try {
    if (code >= 0 && f->comm->try_all_reduce(args[0], code)) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const rr::RingError& e) {
    PyErr_SetString(ring_error_type, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

PyMethodDef fast_def = {"fast_all_reduce", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(
                                               &fast_all_reduce)),
                        METH_FASTCALL, "fast(tensor, op) -> bool: a synchronous all-reduce, or False"};

py::object make_fast(py::object owner, const std::vector<py::object>& ops) {
  auto* f = new FastCall{owner, owner.cast<ShmComm*>(), ops};
  py::capsule cap(f, kFastCapsule, [](void* p) { delete static_cast<FastCall*>(p); });
  PyObject* fn = PyCFunction_New(&fast_def, cap.ptr());
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ringreduce native core: ring collectives over shared memory";
  ring_error_type = py::register_exception<rr::RingError>(m, "RingReduceError", PyExc_RuntimeError).ptr();
  main_thread_ident() = PyThread_get_thread_ident();

  py::class_<ShmComm>(m, "ShmComm")
      .def(py::init<const std::string&, bool, int, int, size_t, double, int64_t, int64_t,
                    const std::string&, int64_t>(),
           py::arg("name"), py::arg("create"), py::arg("rank"), py::arg("nranks"), py::arg("slice_bytes"),
           py::arg("timeout_s"), py::arg("spin_ns"), py::arg("yield_ns") = 0, py::arg("algo") = "auto",
           py::arg("oneshot_max_bytes") = 0)
      .def("all_reduce", &ShmComm::all_reduce, py::arg("tensor"), py::arg("op"))
      .def("try_all_reduce", &ShmComm::try_all_reduce, py::arg("tensor"), py::arg("op"))
      .def("fast_all_reduce", [](py::object self, const std::vector<py::object>& ops) {
        return make_fast(std::move(self), ops);
      }, py::arg("ops"), "A function fast(tensor, op) -> bool running try_all_reduce; ops[code] is "
         "the ReduceOp object of each op code")
      .def("reduce_scatter", &ShmComm::reduce_scatter, py::arg("output"), py::arg("input"), py::arg("op"))
      .def("all_gather", &ShmComm::all_gather, py::arg("output"), py::arg("input"))
      .def("abort", &ShmComm::abort, py::arg("why"))
      .def("broken", &ShmComm::broken)
      .def("reason", &ShmComm::reason)
      .def("slice_bytes", &ShmComm::slice_bytes)
      .def("op_seq", &ShmComm::op_seq)
      .def("algo", &ShmComm::algo, py::arg("numel"), py::arg("like"))
      .def("close", &ShmComm::close)
      .def("closed", &ShmComm::closed);

  m.def("shm_unlink", &rr::shm::Comm::unlink, py::arg("name"));
  m.def("segment_bytes", &rr::shm::segment_bytes, py::arg("nranks"), py::arg("slice_bytes"));
  register_backend(m);
#ifdef RINGREDUCE_WITH_CUDA
  m.attr("cuda_compiled") = true;
  register_cuda(m);
#else
  m.attr("cuda_compiled") = false;
#endif
}
