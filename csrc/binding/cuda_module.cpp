// The CUDA half of the module ringreduce._C: the communicator classes (cuda_comm.h) as Python
// types, the CUDA fast path, and the transport choice's device queries.
#include <Python.h>
#include <torch/csrc/utils/pybind.h>

#include "binding/cuda_comm.h"

namespace ringreduce::binding {
namespace {

using P2pComm = CudaComm<rc::p2p::Ring>;
using NcclComm = CudaComm<rc::nccl::Ring>;

// The CUDA fast path as a plain CPython function (METH_FASTCALL), as the CPU's (csrc/binding/module.cpp):
// fast(tensor, op[, async_op[, wire_dtype]]) -> True when a synchronous all_reduce was enqueued on
// the caller's stream; False when not taken (async, a wire, an op object not given here, a tensor
// try_all_reduce refuses): the caller's full path. The full path costs ~6 us of Python per call
// (_comm_for, checks, the lock, ranges), more than a small call's kernel takes on an H200.
struct CudaFast {
  py::object owner;  // the P2pComm's Python object: keeps comm alive
  P2pComm* comm;
  std::vector<py::object> ops;  // ops[code]
};

constexpr const char* kCudaFastCapsule = "ringreduce.CudaFast";

PyObject* cuda_fast_all_reduce(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  auto* f = static_cast<CudaFast*>(PyCapsule_GetPointer(self, kCudaFastCapsule));
  if (f == nullptr) return nullptr;
  if (nargs < 2 || nargs > 4) {
    PyErr_Format(PyExc_TypeError, "fast all_reduce takes (tensor, op[, async_op[, wire_dtype]]), got "
                 "%zd arguments", nargs);
    return nullptr;
  }
  if ((nargs >= 3 && args[2] != Py_False) || (nargs == 4 && args[3] != Py_None)) Py_RETURN_FALSE;
  int code = -1;
  for (size_t i = 0; i < f->ops.size(); ++i)
    if (args[1] == f->ops[i].ptr()) code = static_cast<int>(i);
  if (code < 0) Py_RETURN_FALSE;
  // The errors the full path (pybind11 with torch's translators) raises: RingReduceError, Python
  // errors, torch's c10 errors (OutOfMemoryError, AcceleratorError, ...) as torch maps them, the
  // standard ones as pybind11 maps them.
  try {
    if (f->comm->try_all_reduce(args[0], code)) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const rr::RingError& e) {
    PyErr_SetString(rr::ring_error_type(), e.what());
  } catch (const c10::Error&) {
    torch::translate_exception_to_python(std::current_exception());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::domain_error& e) {  // pybind11's mapping of the standard exceptions
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::length_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::out_of_range& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const std::range_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::overflow_error& e) {
    PyErr_SetString(PyExc_OverflowError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "ringreduce: unknown C++ exception in all_reduce");
  }
  return nullptr;
}

PyMethodDef cuda_fast_def = {
    "fast_all_reduce",
    reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&cuda_fast_all_reduce)), METH_FASTCALL,
    "fast(tensor, op) -> bool: a synchronous all_reduce on the caller's stream, or False"};

template <class C>
void bind_common(py::class_<C>& cls) {
  cls.def("all_reduce", &C::all_reduce, py::arg("tensor"), py::arg("op"), py::arg("async_op"),
          py::arg("wire") = 0)
      .def("reduce_scatter", &C::reduce_scatter, py::arg("output"), py::arg("input"), py::arg("op"),
           py::arg("async_op"), py::arg("wire") = 0)
      .def("all_gather", &C::all_gather, py::arg("output"), py::arg("input"), py::arg("async_op"))
      .def("failure", &C::failure)
      .def("abort", &C::abort, py::arg("why"))
      .def("synchronize", &C::synchronize)
      .def("close", &C::close, py::arg("peers_done"))
      .def("unmap_peers", &C::unmap_peers)
      .def("closed", &C::closed)
      .def("watch_peers", &C::watch_peers, py::arg("peers"))
      .def("failed_seq", &C::failed_seq)
      .def("stream_ptr", &C::stream_ptr)
      .def("marker", &C::marker)
      .def("attach_recorder", &C::attach_recorder, py::arg("recorder"))
      .def("op_seq", &C::op_seq)
      .def("held_calls", &C::held_calls)
      .def("release_finished", &C::release_finished)
      .def("device", &C::device);
}

}  // namespace
}  // namespace ringreduce::binding

using namespace ringreduce::binding;

void register_cuda(py::module_& m) {
  py::class_<CudaWork>(m, "CudaWork")
      .def("is_completed", &CudaWork::is_completed)
      .def("synchronize", &CudaWork::synchronize);

  py::class_<P2pComm> p2p(m, "P2pComm");
  p2p.def(py::init([](int device, int rank, int nranks, int channels, size_t slice_bytes,
                      double timeout_s, const std::string& algo, size_t chunk_bytes,
                      int max_blocks, bool direct, size_t copy_slot_bytes, int sym_blocks) {
           c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
           rc::p2p::Options o;
           o.rank = rank;
           o.nranks = nranks;
           o.channels = channels;
           o.slice_bytes = slice_bytes;
           o.timeout_s = timeout_s;
           o.chunk_bytes = chunk_bytes;
           o.max_blocks = max_blocks;
           o.direct = direct;
           o.copy_slot_bytes = copy_slot_bytes;
           o.sym_blocks = sym_blocks;
           o.algo = algo == "auto"      ? rc::p2p::Algo::Auto
                    : algo == "ring"    ? rc::p2p::Algo::Ring
                    : algo == "oneshot" ? rc::p2p::Algo::OneShot
                    : algo == "twoshot" ? rc::p2p::Algo::TwoShot
                    : algo == "copy"    ? rc::p2p::Algo::Copy
                                        : rc::p2p::Algo(255);
           TORCH_CHECK_VALUE(o.algo != rc::p2p::Algo(255), "ringreduce: RINGREDUCE_CUDA_ALGO must be one "
                             "of auto, ring, oneshot, twoshot, copy; got '", algo, "'");
           return std::make_unique<P2pComm>(std::make_unique<rc::p2p::Ring>(o), nranks);
         }),
         py::arg("device"), py::arg("rank"), py::arg("nranks"), py::arg("channels"),
         py::arg("slice_bytes"), py::arg("timeout_s"), py::arg("algo") = "auto",
         py::arg("chunk_bytes") = rc::p2p::kDefaultChunkBytes, py::arg("max_blocks") = 0,
         py::arg("direct") = true,
         py::arg("copy_slot_bytes") = rc::p2p::kDefaultCopySlotBytes,
         py::arg("sym_blocks") = rc::p2p::kDefaultSymBlocks)
      .def("handle", [](P2pComm& c) { return py::bytes(c.ring().handle()); })
      .def("connect", [](P2pComm& c, const std::vector<py::bytes>& handles) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device()));
        std::vector<std::string> h;
        for (const py::bytes& b : handles) h.push_back(std::string(b));
        c.ring().connect(h);
      }, py::arg("handles"))
      .def("direct", [](P2pComm& c) { return c.ring().direct(); })
      .def("fast_all_reduce", [](py::object self, const std::vector<py::object>& ops) {
        auto* f = new CudaFast{self, self.cast<P2pComm*>(), ops};
        py::capsule cap(f, kCudaFastCapsule, [](void* p) { delete static_cast<CudaFast*>(p); });
        PyObject* fn = PyCFunction_New(&cuda_fast_def, cap.ptr());
        if (fn == nullptr) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(fn);
      }, py::arg("ops"), "A function fast(tensor, op[, async_op[, wire_dtype]]) -> bool running "
         "try_all_reduce; ops[code] is the ReduceOp object of each op code")
      .def("wire_overflowed", [](P2pComm& c, uint64_t seq) { return c.ring().wire_overflowed(seq); },
           py::arg("op_seq"))
      // Device memory the communicator holds (p2p::Ring::area_bytes), for the log.
      .def("device_bytes", [](P2pComm& c) { return c.ring().area_bytes(); })
      // The copy algorithm (ranks sharing a GPU without MPS): whether this ring has it, and its
      // counters' shared memory (rank 0 creates the segment, the others map it).
      .def("copies", [](P2pComm& c) { return c.ring().copies(); })
      .def("copy_attach", [](P2pComm& c, const std::string& name, bool create) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device()));
        c.ring().copy_attach(name, create);
      }, py::arg("name"), py::arg("create"))
      // Shared buffers (ringreduce.shared_empty on CUDA; p2p::Ring::reg_alloc).
      .def("reg_alloc", [](P2pComm& c, size_t nbytes) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device()));
        std::string h;
        const int id = c.ring().reg_alloc(nbytes, &h);
        return py::make_tuple(id, py::bytes(h));
      }, py::arg("nbytes"))
      .def("reg_connect", [](P2pComm& c, int id, const std::vector<py::bytes>& handles) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device()));
        std::vector<std::string> h;
        for (const py::bytes& b : handles) h.push_back(std::string(b));
        c.ring().reg_connect(id, h);
      }, py::arg("id"), py::arg("handles"))
      .def("reg_tensor", [](P2pComm& c, int id, int64_t numel, const at::Tensor& like) {
        // The tensor holds the buffer (a shared_ptr in its deleter). When it goes, this rank
        // releases the buffer (p2p::Ring::reg_release: the peers' copies unmapped, this one freed
        // with the tensor); after the communicator closed, only its memory remains to free. At
        // the interpreter's exit the deleter makes no CUDA call (see the top).
        auto* mem = new std::shared_ptr<char>(c.ring().reg_memory(id));
        std::weak_ptr<Shared<rc::p2p::Ring>> weak = c.shared();
        auto opts = at::TensorOptions().dtype(like.scalar_type()).device(at::kCUDA, c.device());
        return at::from_blob(mem->get(), {numel}, [mem, weak, id](void*) {
          if (finalizing()) return;
          if (auto s = weak.lock())
            if (s->ring) s->ring->reg_release(id);  // a no-op once the ring closed
          delete mem;
        }, opts);
      }, py::arg("id"), py::arg("numel"), py::arg("like"))
      .def("set_threshold", [](P2pComm& c, size_t oneshot_max) {
        c.ring().set_threshold(oneshot_max);
      }, py::arg("oneshot_max"))
      .def("set_sym_blocks", [](P2pComm& c, int blocks) {
        c.ring().set_sym_blocks(blocks);
      }, py::arg("blocks"))
      .def("algorithm", [](P2pComm& c, const std::string& coll, int64_t numel, int dtype_bytes) {
        // The plan of a float-like call of this size (for logs and tests of the choice).
        const rr::Coll k = coll == "all_reduce" ? rr::Coll::AllReduce
                           : coll == "reduce_scatter" ? rr::Coll::ReduceScatter : rr::Coll::AllGather;
        const rr::DType t = dtype_bytes == 2 ? rr::DType::F16 : dtype_bytes == 8 ? rr::DType::F64
                                                                                 : rr::DType::F32;
        return std::string(rc::p2p::algo_name(c.ring().plan_of({k, t, rr::RedOp::Sum, numel, nullptr, nullptr}).algo));
      }, py::arg("coll"), py::arg("numel"), py::arg("dtype_bytes") = 4);
  bind_common(p2p);

  py::class_<NcclComm> nccl(m, "NcclComm");
  nccl.def(py::init([](int device, int rank, int nranks, double timeout_s, size_t staging_bytes,
                       const std::string& lib, const std::string& id) {
            c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
            rc::nccl::Options o;
            o.rank = rank;
            o.nranks = nranks;
            o.timeout_s = timeout_s;
            o.staging_bytes = staging_bytes;
            o.lib = lib;
            std::unique_ptr<rc::nccl::Ring> ring;
            {
              py::gil_scoped_release nogil;  // waits for the other ranks (bounded by timeout_s)
              ring = std::make_unique<rc::nccl::Ring>(o, id);
            }
            return std::make_unique<NcclComm>(std::move(ring), nranks);
          }),
          py::arg("device"), py::arg("rank"), py::arg("nranks"), py::arg("timeout_s"),
          py::arg("staging_bytes"), py::arg("lib"), py::arg("id"));
  bind_common(nccl);

  m.def("nccl_unique_id", [](const std::string& lib) { return py::bytes(rc::nccl::unique_id(lib)); },
        py::arg("lib"));
  m.def("nccl_version", &rc::nccl::version, py::arg("lib"));
  m.def("cuda_bus_id", [](int device) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    return rc::p2p::device_bus_id();
  }, py::arg("device"));
  m.def("cuda_can_map", [](int device, const std::string& bus_id) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
    std::string why;
    const bool ok = rc::p2p::can_map(bus_id, &why);
    return py::make_tuple(ok, why);
  }, py::arg("device"), py::arg("bus_id"));
  m.def("cuda_free_streams", &free_stream_count, py::arg("device"));
  m.def("cuda_device_count", [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
}
