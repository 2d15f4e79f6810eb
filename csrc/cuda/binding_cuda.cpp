// Torch binding of the CUDA transports: tensors in, typed spans out, and the stream semantics of
// torch.distributed with NCCL. Every collective runs on the communicator's own stream, ordered
// after the caller's current stream (an event), and the caller's stream waits for it (sync) or the
// returned Work does so in wait() (async). The only file of csrc/cuda that includes torch.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <memory>
#include <string>
#include <vector>

#include "cuda/kernels.h"
#include "cuda/nccl_ring.h"
#include "cuda/p2p.h"
#include "torch_types.h"

namespace rr = ringreduce;
namespace rc = ringreduce::cuda;

namespace {

// What a Work needs of its communicator: whether it failed, and the stream it ran on.
struct Failure {
  virtual ~Failure() = default;
  virtual std::string failure() = 0;
};

template <class Ring>
struct Shared : Failure {
  std::unique_ptr<Ring> ring;
  std::string failure() override { return ring ? ring->failure() : ""; }
};

void raise_if(Failure& f) {
  const std::string why = f.failure();
  if (!why.empty()) throw rr::RingError(why);
}

// The handle of an async collective: an event on the communicator's stream.
class CudaWork {
 public:
  CudaWork(cudaEvent_t done, int device, std::shared_ptr<Failure> comm)
      : done_(done), device_(device), comm_(std::move(comm)) {}
  ~CudaWork() {
    if (done_) cudaEventDestroy(done_);
  }
  // The caller's current stream waits for the collective; raises if the communicator already failed.
  void wait() {
    c10::cuda::CUDAGuard guard(device_);
    C10_CUDA_CHECK(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(device_).stream(), done_, 0));
    raise_if(*comm_);
  }
  bool is_completed() {
    c10::cuda::CUDAGuard guard(device_);
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaErrorNotReady) return false;
    C10_CUDA_CHECK(e);
    return true;
  }
  // Blocks the host until the collective is done; raises its failure.
  void synchronize() {
    c10::cuda::CUDAGuard guard(device_);
    {
      py::gil_scoped_release nogil;
      C10_CUDA_CHECK(cudaEventSynchronize(done_));
    }
    raise_if(*comm_);
  }

 private:
  cudaEvent_t done_;
  int device_;
  std::shared_ptr<Failure> comm_;
};

// One communicator on one device: a ring (p2p::Ring or nccl::Ring) and its stream.
template <class Ring>
class CudaComm {
 public:
  CudaComm(std::unique_ptr<Ring> ring, int nranks) : nranks_(nranks) {
    C10_CUDA_CHECK(cudaGetDevice(&device_));
    shared_ = std::make_shared<Shared<Ring>>();
    shared_->ring = std::move(ring);
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
  }
  ~CudaComm() { close(); }

  Ring& ring() {
    if (!shared_->ring || shared_->ring->closed()) throw rr::RingError("ringreduce: communicator is closed");
    return *shared_->ring;
  }

  py::object all_reduce(at::Tensor t, int op, bool async_op) {
    check(t, "tensor");
    return run({rr::Coll::AllReduce, rr::to_dtype(t, "tensor"), rr::to_op(op), t.numel(), t.data_ptr(),
                t.data_ptr()}, {t}, async_op);
  }

  py::object reduce_scatter(at::Tensor out, at::Tensor in, int op, bool async_op) {
    check(out, "output");
    check(in, "input");
    TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(), "ringreduce: output dtype ",
                     out.scalar_type(), " differs from input dtype ", in.scalar_type());
    TORCH_CHECK_VALUE(in.numel() == out.numel() * nranks_, "ringreduce: input has ", in.numel(),
                      " elements; expected output.numel() * world size = ", out.numel() * nranks_);
    return run({rr::Coll::ReduceScatter, rr::to_dtype(in, "input"), rr::to_op(op), in.numel(), in.data_ptr(),
                out.data_ptr()}, {out, in}, async_op);
  }

  py::object all_gather(at::Tensor out, at::Tensor in, bool async_op) {
    check(out, "output_tensor");
    check(in, "input_tensor");
    TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(), "ringreduce: output_tensor dtype ",
                     out.scalar_type(), " differs from input_tensor dtype ", in.scalar_type());
    TORCH_CHECK_VALUE(out.numel() == in.numel() * nranks_, "ringreduce: output_tensor has ",
                      out.numel(), " elements; expected input_tensor.numel() * world size = ",
                      in.numel() * nranks_);
    return run({rr::Coll::AllGather, rr::to_dtype(in, "input_tensor"), rr::RedOp::Sum, out.numel(),
                in.data_ptr(), out.data_ptr()}, {out, in}, async_op);
  }

  std::string failure() { return shared_->failure(); }
  void abort(const std::string& why) {
    if (shared_->ring && !shared_->ring->closed()) shared_->ring->abort(why);
  }
  // Blocks the host until every collective enqueued so far is done; raises a failure.
  void synchronize() {
    if (stream_) {
      c10::cuda::CUDAGuard guard(device_);
      py::gil_scoped_release nogil;
      C10_CUDA_CHECK(cudaStreamSynchronize(stream_));
    }
    raise_if(*shared_);
  }
  // Waits for the stream (collectives end by their deadline at the latest), then frees everything.
  void close() {
    if (!stream_) return;
    c10::cuda::CUDAGuard guard(device_);
    {
      py::gil_scoped_release nogil;
      cudaStreamSynchronize(stream_);
      if (shared_->ring) shared_->ring->close();
    }
    cudaEventDestroy(ready_);
    cudaEventDestroy(done_);
    cudaStreamDestroy(stream_);
    stream_ = nullptr;
    cudaGetLastError();
  }
  bool closed() const { return stream_ == nullptr; }
  uintptr_t stream_ptr() const { return reinterpret_cast<uintptr_t>(stream_); }
  int64_t op_seq() { return static_cast<int64_t>(ring().op_seq()); }
  int device() const { return device_; }

 private:
  void check(const at::Tensor& t, const char* arg) {
    TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == device_, "ringreduce: ", arg, " is on ",
                      t.device(), "; this communicator moves tensors on cuda:", device_);
    TORCH_CHECK_VALUE(t.is_contiguous(), "ringreduce: ", arg, " must be contiguous");
  }

  py::object run(const rr::Call& c, const std::vector<at::Tensor>& tensors, bool async_op) {
    Ring& ring = this->ring();
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t cur = c10::cuda::getCurrentCUDAStream(device_).stream();
    C10_CUDA_CHECK(cudaEventRecord(ready_, cur));
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    {
      py::gil_scoped_release nogil;  // nccl: may poll NCCL until its calls are enqueued
      ring.run(c, stream_);
    }
    // The caching allocator must not reuse these tensors' memory before our stream is done.
    const c10::Stream ours = c10::cuda::getStreamFromExternal(stream_, device_);
    for (const at::Tensor& t : tensors) t.record_stream(ours);
    if (!async_op) {
      C10_CUDA_CHECK(cudaEventRecord(done_, stream_));
      C10_CUDA_CHECK(cudaStreamWaitEvent(cur, done_, 0));
      return py::none();
    }
    return marker();
  }

 public:
  // A Work whose event follows everything enqueued on our stream so far.
  py::object marker() {
    c10::cuda::CUDAGuard guard(device_);
    cudaEvent_t done = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    const cudaError_t e = cudaEventRecord(done, stream_);
    if (e != cudaSuccess) cudaEventDestroy(done);
    C10_CUDA_CHECK(e);
    return py::cast(std::make_unique<CudaWork>(done, device_, shared_));
  }

 private:

  int nranks_ = 1;
  int device_ = 0;
  std::shared_ptr<Shared<Ring>> shared_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
};

using P2pComm = CudaComm<rc::p2p::Ring>;
using NcclComm = CudaComm<rc::nccl::Ring>;

template <class C>
void bind_common(py::class_<C>& cls) {
  cls.def("all_reduce", &C::all_reduce, py::arg("tensor"), py::arg("op"), py::arg("async_op"))
      .def("reduce_scatter", &C::reduce_scatter, py::arg("output"), py::arg("input"), py::arg("op"),
           py::arg("async_op"))
      .def("all_gather", &C::all_gather, py::arg("output"), py::arg("input"), py::arg("async_op"))
      .def("failure", &C::failure)
      .def("abort", &C::abort, py::arg("why"))
      .def("synchronize", &C::synchronize)
      .def("close", &C::close)
      .def("closed", &C::closed)
      .def("stream_ptr", &C::stream_ptr)
      .def("marker", &C::marker)
      .def("op_seq", &C::op_seq)
      .def("device", &C::device);
}

}  // namespace

void register_cuda(py::module_& m) {
  py::class_<CudaWork>(m, "CudaWork")
      .def("wait", &CudaWork::wait)
      .def("is_completed", &CudaWork::is_completed)
      .def("synchronize", &CudaWork::synchronize);

  py::class_<P2pComm> p2p(m, "P2pComm");
  p2p.def(py::init([](int device, int rank, int nranks, int channels, size_t slice_bytes,
                      double timeout_s) {
           c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
           rc::p2p::Options o;
           o.rank = rank;
           o.nranks = nranks;
           o.channels = channels;
           o.slice_bytes = slice_bytes;
           o.timeout_s = timeout_s;
           return std::make_unique<P2pComm>(std::make_unique<rc::p2p::Ring>(o), nranks);
         }),
         py::arg("device"), py::arg("rank"), py::arg("nranks"), py::arg("channels"),
         py::arg("slice_bytes"), py::arg("timeout_s"))
      .def("handle", [](P2pComm& c) { return py::bytes(c.ring().handle()); })
      .def("connect", [](P2pComm& c, const std::string& up, const std::string& down) {
        c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device()));
        c.ring().connect(up, down);
      }, py::arg("up"), py::arg("down"));
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
  m.def("cuda_device_count", [] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
}
