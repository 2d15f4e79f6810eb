// The CUDA communicator of the torch binding (CudaComm, one per transport: p2p and nccl): tensors in, typed spans out, and the stream semantics of
// torch.distributed with NCCL. A synchronous p2p call runs on the caller's current stream (as
// torch's SymmetricMemory ops and vLLM's all-reduce do: no event pairs, ~4 CUDA calls fewer); an
// async one, or any nccl call, on the communicator's own stream, ordered after the caller's
// current stream (an event), and the returned Work waits for it (async) or the caller's stream
// does (sync, nccl). Calls of one communicator run in call order whatever streams they are on
// (follow()). The only file of csrc/cuda that includes torch.
//
// Ownership of what torch sees (a stream or tensor torch still holds must outlive us, or the
// process crashes at exit):
// - communicator streams are never destroyed (take_stream/give_back_stream): torch may hold one
//   after close (the ExternalStream of ringreduce/_cuda, a Future's events, a user's record_stream);
// - the tensors of a call on our stream are held until its event completes (held_), not given to
//   record_stream, so the caching allocator never records an event on our stream when they are
//   freed; a sync p2p call runs on the caller's stream, whose tensors are its own (torch's rule:
//   a tensor from another stream needs record_stream, as for any op), except a shared buffer's
//   (held: its release unmaps the peers' copies);
// - a graph that captured a p2p launch pins the ring's memory (p2p::Ring::graph_pin, a
//   cudaUserObject): close() keeps it while the graph lives;
// - destructors that run while the interpreter finalizes make no CUDA call and do not touch the
//   GIL: what they would free is the process's to free at exit.
#pragma once
#include <Python.h>
#include <nvtx3/nvToolsExt.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/record_function.h>

#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/kernels.h"
#include "runtime/recorder.h"
#include "cuda/nccl/ring.h"
#include "cuda/p2p/ring.h"
#include "binding/torch_types.h"

namespace ringreduce {
PyObject*& ring_error_type();  // ringreduce.RingReduceError (binding/shm_comm.cpp), set at import
}

// Hidden, as pybind11 wants for the classes it binds (the module exports only its init function).
#pragma GCC visibility push(hidden)
namespace ringreduce::binding {
namespace rr = ringreduce;
namespace rc = ringreduce::cuda;

// Whether the interpreter is finalizing: destructors then make no CUDA call and leave the GIL alone.
bool finalizing();

// Streams of closed communicators, per device, are reused, never destroyed (see the top).
// take_stream: a non-blocking stream of our own (not torch's pool: our kernels spin on other ranks
// and must not queue behind user work) on the current device, reused if a closed communicator left
// one; give_back_stream returns it to the free list.
cudaStream_t take_stream(int device);
void give_back_stream(int device, cudaStream_t s);
size_t free_stream_count(int device);

// What a Work needs of its communicator: its failure and which call failed first.
struct Failure {
  virtual ~Failure() = default;
  virtual std::string failure() = 0;
  virtual uint64_t failed_seq() = 0;
  virtual void poll() {}
};

template <class Ring>
struct Shared : Failure {
  std::unique_ptr<Ring> ring;
  std::string failure() override { return ring ? ring->failure() : ""; }
  uint64_t failed_seq() override { return ring ? ring->failed_seq() : 0; }
  void poll() override {
    if constexpr (std::is_same_v<Ring, rc::nccl::Ring>)
      if (ring && !ring->closed()) ring->poll();
  }
};

void raise_if(Failure& f);  // throws RingError when f has failed

// The handle of the calls enqueued up to op_seq `seq`: an event on the communicator's stream.
class CudaWork {
 public:
  CudaWork(cudaEvent_t done, int device, std::shared_ptr<Failure> comm, uint64_t seq)
      : done_(done), device_(device), comm_(std::move(comm)), seq_(seq) {}
  ~CudaWork() {
    if (done_ && !finalizing()) cudaEventDestroy(done_);
  }
  bool is_completed() {
    if (!done_) return true;
    c10::cuda::CUDAGuard guard(device_);
    rc::RelaxedCapture relaxed;  // another thread may be capturing a graph
    const cudaError_t e = cudaEventQuery(done_);
    if (e == cudaErrorNotReady) return false;
    C10_CUDA_CHECK(e);
    return true;
  }
  // Blocks the host until the calls are done on the device (each ends by its deadline at the
  // latest); raises if one of them failed. A failure of a later call does not count.
  void synchronize() {
    if (!done_) return;  // a world-1 call: nothing ran on our stream
    c10::cuda::CUDAGuard guard(device_);
    {
      py::gil_scoped_release nogil;
      rc::RelaxedCapture relaxed;
      const cudaError_t e = cudaEventSynchronize(done_);
      comm_->poll();
      if (e != cudaSuccess) {
        cudaGetLastError();
        const std::string why = comm_->failure();
        throw rr::RingError(!why.empty() ? why : std::string("ringreduce: CUDA error while waiting "
                                                             "for a collective: ") + cudaGetErrorString(e));
      }
    }
    const uint64_t first = comm_->failed_seq();
    if (first != 0 && first <= seq_) raise_if(*comm_);
  }

 private:
  cudaEvent_t done_;
  int device_;
  std::shared_ptr<Failure> comm_;
  uint64_t seq_;
};

// One communicator on one device: a ring (p2p::Ring or nccl::Ring) and its stream.
template <class Ring>
class CudaComm {
 public:
  CudaComm(std::unique_ptr<Ring> ring, int nranks) : nranks_(nranks) {
    C10_CUDA_CHECK(cudaGetDevice(&device_));
    shared_ = std::make_shared<Shared<Ring>>();
    shared_->ring = std::move(ring);
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&after_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&link_, cudaEventDisableTiming));
    stream_ = take_stream(device_);
  }
  ~CudaComm() {
    if (finalizing()) {  // no CUDA call, no GIL: the process frees it all at exit
      if (shared_->ring) shared_->ring->stop_threads();  // host threads only
      (void)shared_->ring.release();
      for (Held& h : held_) (void)h.tensors.release();
      return;
    }
    close(false);  // not closed by Python: a neighbour may still read our memory
  }

  std::weak_ptr<Shared<Ring>> shared() const { return shared_; }

  Ring& ring() {
    if (!shared_->ring || shared_->ring->closed()) throw rr::RingError("ringreduce: communicator is closed");
    return *shared_->ring;
  }

  // wire: a narrow wire's code (rr::Wire; p2p only: sym_wire.cu); 0: none.
  py::object all_reduce(at::Tensor t, int op, bool async_op, int wire) {
    check(t, "tensor");
    return run({rr::Coll::AllReduce, rr::to_dtype(t, "tensor"), rr::to_op(op), t.numel(), t.data_ptr(),
                t.data_ptr(), wire_of(wire, t, op, "tensor")}, {t}, async_op);
  }

  py::object reduce_scatter(at::Tensor out, at::Tensor in, int op, bool async_op, int wire) {
    check(out, "output");
    check(in, "input");
    TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(), "ringreduce: output dtype ",
                     out.scalar_type(), " differs from input dtype ", in.scalar_type());
    TORCH_CHECK_VALUE(in.numel() == out.numel() * nranks_, "ringreduce: input has ", in.numel(),
                      " elements; expected output.numel() * world size = ", out.numel() * nranks_);
    return run({rr::Coll::ReduceScatter, rr::to_dtype(in, "input"), rr::to_op(op), in.numel(), in.data_ptr(),
                out.data_ptr(), wire_of(wire, in, op, "input")}, {out, in}, async_op);
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

  // The fast path's call (cuda_fast_all_reduce): a synchronous all_reduce of an exact, contiguous
  // tensor on this device in a dtype the core reduces, checked here instead of in Python; false
  // for anything else (the full path then checks it and raises the API's errors). Ranges for
  // torch.profiler and NVTX as the full path's (_cuda.Communicator._enqueue).
  bool try_all_reduce(PyObject* obj, int op) {
    // Closing or closed: the full path (a new communicator, or its error); run() checks again
    // under its lock.
    if (!THPVariable_CheckExact(obj) || closing_.load(std::memory_order_relaxed)) return false;
    const at::Tensor& t = THPVariable_Unpack(obj);
    rr::DType dt;
    if (t.layout() != at::kStrided || !t.is_cuda() || t.get_device() != device_ || !t.is_contiguous() ||
        !rr::try_dtype(t.scalar_type(), dt))
      return false;
    RECORD_FUNCTION("ringreduce::all_reduce", std::vector<c10::IValue>({t}));
    nvtxRangePushA("ringreduce::all_reduce");
    struct Pop {
      ~Pop() { nvtxRangePop(); }
    } pop;
    run({rr::Coll::AllReduce, dt, rr::to_op(op), t.numel(), t.data_ptr(), t.data_ptr(), rr::Wire::None},
        {t}, false);
    return true;
  }

  std::string failure() { return shared_->failure(); }
  // The flight recorder this communicator records its calls in; dumps ask the device (without
  // blocking) which of them have finished.
  void attach_recorder(std::shared_ptr<rr::runtime::Recorder> rec) {
    std::weak_ptr<Shared<Ring>> weak = shared_;
    rec->set_device_probe([weak](uint64_t dev_seq, int64_t* done_ns, std::string* error) {
      auto s = weak.lock();
      if (!s || !s->ring || s->ring->closed()) return 0;
      const uint64_t failed = s->ring->failed_seq();
      if (failed != 0 && dev_seq >= failed) {
        *error = s->ring->failure();
        return 3;
      }
      return static_cast<int>(s->ring->calls().state(dev_seq, done_ns));
    });
    ring().calls().enable(rec->on());
    rec_ = std::move(rec);
  }
  void abort(const std::string& why) {
    if (shared_->ring && !shared_->ring->closed()) shared_->ring->abort(why);
  }
  // Blocks the host until every collective enqueued so far is done; raises a failure.
  void synchronize() {
    if (stream_) {
      c10::cuda::CUDAGuard guard(device_);
      {
        py::gil_scoped_release nogil;
        {
          std::lock_guard<std::mutex> calls(call_mu_);  // without the GIL (see run)
          join(true);
        }
        C10_CUDA_CHECK(cudaStreamSynchronize(stream_));
        shared_->poll();
      }
      release_held(false);
    }
    raise_if(*shared_);
  }
  // The first half of the two-phase close (p2p; nothing to unmap on nccl): after the stream is
  // idle, unmap the peers' memory; close(true) frees this rank's once every rank did this.
  // False: this rank keeps mapping its peers (a CUDA graph pins the ring), so none may free.
  bool unmap_peers() {
    if (!stream_ || !shared_->ring) return true;
    if constexpr (std::is_same_v<Ring, rc::p2p::Ring>) {
      c10::cuda::CUDAGuard guard(device_);
      py::gil_scoped_release nogil;
      std::lock_guard<std::mutex> calls(call_mu_);  // a call being enqueued finishes first
      join(false);
      cudaStreamSynchronize(stream_);
      return shared_->ring->unmap_peers();
    }
    return true;
  }
  // Waits for the stream (collectives end by their deadline at the latest), then frees everything.
  // peers_done: every rank has stopped using this rank's memory (see p2p::Ring::close).
  void close(bool peers_done) {
    closing_.store(true, std::memory_order_relaxed);
    if (!stream_) return;
    if (rec_) rec_->set_device_probe(nullptr);  // waits for a dump reading the ring
    c10::cuda::CUDAGuard guard(device_);
    {
      // A destructor called by the garbage collector holds the GIL; one called elsewhere may not.
      std::unique_ptr<py::gil_scoped_release> nogil;
      if (PyGILState_Check()) nogil = std::make_unique<py::gil_scoped_release>();
      // Taken without the GIL, released before it is taken back (see run): a call another thread
      // is enqueueing finishes first, and a later one finds the ring closed.
      std::lock_guard<std::mutex> calls(call_mu_);
      join(false);  // the calls that ran on the callers' streams too
      cudaStreamSynchronize(stream_);
      if (shared_->ring) {
        if constexpr (std::is_same_v<Ring, rc::p2p::Ring>) shared_->ring->close(peers_done);
        else shared_->ring->close();
      }
    }
    release_held(true);  // the stream is idle (or the device lost): nothing uses them now
    {
      std::lock_guard<std::mutex> lk(held_mu_);
      for (cudaEvent_t e : spare_events_) cudaEventDestroy(e);
      spare_events_.clear();
    }
    cudaEventDestroy(ready_);
    cudaEventDestroy(after_);
    cudaEventDestroy(link_);
    give_back_stream(device_, stream_);  // idle; torch may still refer to it: never destroyed
    stream_ = nullptr;
    cudaGetLastError();
  }
  void watch_peers(const std::vector<std::pair<int, int>>& peers) {
    std::vector<ringreduce::runtime::Peer> p;
    for (const auto& [rank, pid] : peers) p.push_back({rank, pid});
    ring().watch_peers(std::move(p));
  }
  int64_t failed_seq() { return static_cast<int64_t>(shared_->failed_seq()); }
  bool closed() const { return stream_ == nullptr; }
  uintptr_t stream_ptr() const { return reinterpret_cast<uintptr_t>(stream_); }
  int64_t op_seq() { return static_cast<int64_t>(ring().op_seq()); }
  int device() const { return device_; }
  size_t held_calls() {
    std::lock_guard<std::mutex> lk(held_mu_);
    return held_.size();
  }
  // Drops the tensors of calls the device has finished (the worker, after a Work's wait).
  void release_finished() {
    if (!stream_) return;
    c10::cuda::CUDAGuard guard(device_);
    release_held(false);
  }

 private:
  // The tensors of one call, held until its event on our stream completes.
  struct Held {
    cudaEvent_t done;
    std::unique_ptr<std::vector<at::Tensor>> tensors;
  };

  cudaEvent_t spare_event() {
    if (!spare_events_.empty()) {
      cudaEvent_t e = spare_events_.back();
      spare_events_.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  // Drops the tensors of calls that finished on the device (all of them if all: the stream is
  // idle). Calls finish in order on our stream: stop at the first that has not. Called from the
  // caller's thread and the worker's: held_ under held_mu_, and the tensors are destroyed after
  // it is released (their destructors may run Python code).
  void release_held(bool all) {
    std::vector<std::unique_ptr<std::vector<at::Tensor>>> done;
    collect_held(all, &done);
  }
  // release_held's first half: moves the finished calls' tensors to *done.
  void collect_held(bool all, std::vector<std::unique_ptr<std::vector<at::Tensor>>>* out) {
    auto& done = *out;
    {
      std::lock_guard<std::mutex> lk(held_mu_);
      // Relaxed: a query must not invalidate a CUDA graph another thread is capturing.
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      cudaThreadExchangeStreamCaptureMode(&mode);
      while (!held_.empty()) {
        Held& h = held_.front();
        if (!all) {
          const cudaError_t e = cudaEventQuery(h.done);
          if (e != cudaSuccess) {
            if (e != cudaErrorNotReady) cudaGetLastError();  // a failed device: keep them
            break;
          }
        }
        spare_events_.push_back(h.done);
        done.push_back(std::move(h.tensors));
        held_.pop_front();
      }
      cudaThreadExchangeStreamCaptureMode(&mode);
    }
  }

  // Holds `tensors` until the work enqueued on `stream` so far is done; the event of that. The
  // tensors of calls found finished go to *finished, for the caller to destroy (after its locks).
  cudaEvent_t hold(const std::vector<at::Tensor>& tensors, cudaStream_t stream,
                   std::vector<std::unique_ptr<std::vector<at::Tensor>>>* finished) {
    collect_held(false, finished);
    std::lock_guard<std::mutex> lk(held_mu_);
    cudaEvent_t e = spare_event();
    const cudaError_t err = cudaEventRecord(e, stream);
    if (err != cudaSuccess) spare_events_.push_back(e);
    C10_CUDA_CHECK(err);
    held_.push_back({e, std::make_unique<std::vector<at::Tensor>>(tensors)});
    return e;
  }

  // World 1: all_reduce is the identity (every op, AVG divides by 1); reduce_scatter and
  // all_gather copy input to output on the caller's stream. No event, no stream of ours.
  // A narrow wire rounds as a group of one would: a kernel on the caller's stream (p2p::Ring::run).
  py::object run_alone(const rr::Call& c, bool async_op) {
    c10::cuda::CUDAGuard guard(device_);
    const std::string failed = shared_->failure();  // aborted: refused, as at any world size
    if (!failed.empty())
      throw rr::RingError("ringreduce: communicator is broken by an earlier failure: " + failed);
    const size_t bytes = static_cast<size_t>(c.numel) * rr::dtype_size(c.dtype);
    if constexpr (std::is_same_v<Ring, rc::p2p::Ring>) {
      if (c.wire != rr::Wire::None) ring().run(c, c10::cuda::getCurrentCUDAStream(device_).stream());
    }
    if (c.wire == rr::Wire::None && c.coll != rr::Coll::AllReduce && c.in != c.out && bytes > 0) {
      const cudaStream_t cur = c10::cuda::getCurrentCUDAStream(device_).stream();
      C10_CUDA_CHECK(cudaMemcpyAsync(c.out, c.in, bytes, cudaMemcpyDeviceToDevice, cur));
    }
    if (rec_ && rec_->on()) {
      const int64_t t = rr::runtime::now_ns();
      const uint64_t seq = rec_->begin(rr::coll_name(c.coll), rr::dtype_name(c.dtype), rr::op_name(c.op),
                                       "local", c.numel, bytes, rr::runtime::current_source(), t, t);
      rec_->finished(seq);
    }
    if (!async_op) return py::none();
    return py::cast(std::make_unique<CudaWork>(nullptr, device_, shared_, 0));
  }

  rr::Wire wire_of(int wire, const at::Tensor& t, int op, const char* arg) {
    const rr::Wire w = rr::to_wire(wire, t, op, arg);
    if constexpr (std::is_same_v<Ring, rc::nccl::Ring>)
      TORCH_CHECK_VALUE(w == rr::Wire::None, "ringreduce: wire_dtype runs on the p2p transport; this "
                        "group runs nccl (RINGREDUCE_TRANSPORT=p2p where every GPU maps its peers)");
    return w;
  }

  void check(const at::Tensor& t, const char* arg) {
    TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == device_, "ringreduce: ", arg, " is on ",
                      t.device(), "; this communicator moves tensors on cuda:", device_);
    TORCH_CHECK_VALUE(t.is_contiguous(), "ringreduce: ", arg, " must be contiguous");
  }

  py::object run(const rr::Call& c, const std::vector<at::Tensor>& tensors, bool async_op) {
    // p2p: the whole call under call_mu_ (its launch does not block), so that close() on another
    // thread waits for it: the fast path does not take the Python lock that orders the full path
    // with close (issue 51, finding 1). Tensors of finished calls are destroyed after the unlock
    // (their destructors may run Python): declared before the lock.
    std::vector<std::unique_ptr<std::vector<at::Tensor>>> finished;
    std::unique_lock<std::mutex> calls;
    if constexpr (std::is_same_v<Ring, rc::p2p::Ring>) {
      calls = lock_calls();
      // Closed, or unmapped by a close in progress: refused before the recorder sees the call.
      if (shared_->ring && shared_->ring->unmapped()) throw rr::RingError("ringreduce: communicator is closed");
    }
    Ring& ring = this->ring();  // after the lock: "closed" if close() ran first
    c10::cuda::CUDAGuard guard(device_);
    const cudaStream_t cur = c10::cuda::getCurrentCUDAStream(device_).stream();
    // Inside a CUDA graph capture: refused before our stream joins the capture, so that the
    // capture stays valid. An async handle would be waited on from the host (the worker thread),
    // which a graph never signals; the nccl transport is not capture-safe (nccl::Ring::run).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(cur, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      if (async_op)
        throw rr::RingError("ringreduce: async_op=True cannot be captured in a CUDA graph (its "
                            "Work is waited on by the host); use async_op=False inside the capture");
      if constexpr (std::is_same_v<Ring, rc::nccl::Ring>)
        throw rr::RingError("ringreduce: the nccl transport cannot run inside a CUDA graph "
                            "capture; use RINGREDUCE_TRANSPORT=p2p (capture-safe)");
      else if (nranks_ > 1)
        pin_for_graph(ring, cur);
    }
    if (nranks_ == 1) return run_alone(c, async_op);
    // Where the call runs: a synchronous p2p call outside a capture on the caller's stream, else
    // on ours after the caller's work; either way after every earlier call of this communicator.
    const bool captured = capture != cudaStreamCaptureStatusNone;
    const bool on_caller = std::is_same_v<Ring, rc::p2p::Ring> && !async_op && !captured;
    const cudaStream_t s = on_caller ? cur : stream_;
    if (!on_caller) {
      C10_CUDA_CHECK(cudaEventRecord(ready_, cur));
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    }
    if (!captured) follow(s, cur);
    uint64_t seq = 0;
    // p2p: planned once per call, for the recorder, the hold below and run()
    [[maybe_unused]] rc::p2p::Plan plan{};
    if constexpr (std::is_same_v<Ring, rc::p2p::Ring>) plan = ring.plan_of(c);
    if (rec_ && rec_->on()) {  // started = enqueued; the device says when it ended
      const char* algo = "nccl";
      if constexpr (std::is_same_v<Ring, rc::p2p::Ring>) algo = rc::p2p::algo_name(plan.algo);
      const int64_t t = rr::runtime::now_ns();
      seq = rec_->begin(rr::coll_name(c.coll), rr::dtype_name(c.dtype), rr::op_name(c.op), algo, c.numel,
                        static_cast<uint64_t>(c.numel) * rr::dtype_size(c.dtype),
                        rr::runtime::current_source(), t, t);
    }
    try {
      if constexpr (std::is_same_v<Ring, rc::p2p::Ring>) {
        ring.run(c, s, &plan);
      } else {
        py::gil_scoped_release nogil;  // nccl: may poll NCCL until its calls are enqueued
        ring.run(c, s);
      }
    } catch (const rr::RingError& e) {  // broken by an earlier failure, or closed
      if (!seq) throw;
      rec_->failed(seq, e.what());
      const std::string path = rec_->dump_on_failure();
      if (path.empty()) throw;
      throw rr::RingError(std::string(e.what()) + "\nflight recorder: " + path +
                          " (every rank's: python -m ringreduce.trace " +
                          path.substr(0, path.rfind('/')) + ")");
    } catch (const std::exception& e) {
      if (seq) rec_->failed(seq, e.what());
      throw;
    }
    if (seq) {
      if (capture != cudaStreamCaptureStatusNone)
        rec_->finished(seq);  // captured into a graph, not run: the device has nothing to say
      else
        rec_->set_dev_seq(seq, ring.op_seq());
    }
    if (captured) {
      // Captured, not run: the graph's replays own the ordering; torch's graph pool keeps the
      // memory of tensors made in the capture. Our stream rejoins the capture here.
      C10_CUDA_CHECK(cudaEventRecord(ready_, stream_));
      C10_CUDA_CHECK(cudaStreamWaitEvent(cur, ready_, 0));
      return py::none();
    }
    if (on_caller) {
      // The tensors are the caller's stream's, as for any op on it: nothing to hold, except a
      // shared buffer (shared_empty), whose release unmaps the peers' copies the kernel still
      // reads. after_ marks the call's end for the next call on another stream, and for join().
      C10_CUDA_CHECK(cudaEventRecord(after_, cur));
      tail_ = cur;
      if constexpr (std::is_same_v<Ring, rc::p2p::Ring>)
        if (plan.algo == rc::p2p::Algo::Registered) {
          try {
            hold(tensors, cur, &finished);
          } catch (...) {  // not held: the buffer must outlive the kernel before its release
            cudaStreamSynchronize(cur);
            throw;
          }
        }
      return py::none();
    }
    tail_ = nullptr;
    // The caching allocator must not reuse these tensors' memory before our stream is done:
    // held until this event, not record_stream (which would tie our stream to their frees).
    const cudaEvent_t done = hold(tensors, stream_, &finished);
    if (!async_op) {
      C10_CUDA_CHECK(cudaStreamWaitEvent(cur, done, 0));
      return py::none();
    }
    std::unique_ptr<CudaWork> w = marker_locked();
    if (calls.owns_lock()) calls.unlock();  // no Python object is made under call_mu_
    return py::cast(std::move(w));
  }

  // call_mu_ for a caller that holds the GIL: never blocks on it with the GIL (a holder may be
  // waiting for the GIL: run's launch, a tensor destructor; or for the device: close).
  std::unique_lock<std::mutex> lock_calls() {
    std::unique_lock<std::mutex> lk(call_mu_, std::try_to_lock);
    if (!lk.owns_lock()) {
      py::gil_scoped_release nogil;
      lk.lock();
    }
    return lk;
  }

  // Orders stream s after every earlier call of this communicator (they share its workspace and
  // sequence): after_ if the last one ran on a caller's stream other than s, our stream's end if
  // it ran there. Nothing when the last call ran on s, or when s is ours and already waits for
  // cur, where the last one ran.
  void follow(cudaStream_t s, cudaStream_t cur) {
    if (tail_ == nullptr) {
      if (s == stream_) return;
      C10_CUDA_CHECK(cudaEventRecord(link_, stream_));
      C10_CUDA_CHECK(cudaStreamWaitEvent(s, link_, 0));
    } else if (tail_ != s && !(s == stream_ && tail_ == cur)) {
      C10_CUDA_CHECK(cudaStreamWaitEvent(s, after_, 0));
    }
  }

  // Our stream waits for the calls that ran on callers' streams: whoever waits for our stream
  // (synchronize, marker, close) then waits for every call. check=false: no exception (close).
  void join(bool check) {
    if (tail_ == nullptr || stream_ == nullptr) return;
    const cudaError_t e = cudaStreamWaitEvent(stream_, after_, 0);
    if (e != cudaSuccess) {
      cudaGetLastError();
      if (check) C10_CUDA_CHECK(e);
    }
    tail_ = nullptr;
  }

  // The graph being captured on `cur` keeps the ring's memory until CUDA destroys the graph.
  static void pin_for_graph(Ring& ring, cudaStream_t cur) {
    if constexpr (std::is_same_v<Ring, rc::p2p::Ring>) {
      cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
      cudaGraph_t graph = nullptr;
      C10_CUDA_CHECK(cudaStreamGetCaptureInfo(cur, &st, nullptr, &graph));
      void* pin = ring.graph_pin();
      cudaUserObject_t obj = nullptr;
      cudaError_t e = cudaUserObjectCreate(&obj, pin, &rc::p2p::Ring::release_graph_pin, 1,
                                           cudaUserObjectNoDestructorSync);
      if (e != cudaSuccess) {
        rc::p2p::Ring::release_graph_pin(pin);
        C10_CUDA_CHECK(e);
      }
      e = cudaGraphRetainUserObject(graph, obj, 1, cudaGraphUserObjectMove);
      if (e != cudaSuccess) cudaUserObjectRelease(obj, 1);  // runs the release
      C10_CUDA_CHECK(e);
    }
  }

 public:
  // A Work whose event follows every call enqueued so far.
  py::object marker() {
    std::unique_ptr<CudaWork> w;
    {
      std::unique_lock<std::mutex> calls = lock_calls();
      w = marker_locked();
    }
    return py::cast(std::move(w));  // a Python object (maybe a collection) after the unlock
  }

 private:
  std::unique_ptr<CudaWork> marker_locked() {
    // Closed: say so before an event exists (it would leak, recorded on the legacy stream).
    const uint64_t seq = ring().op_seq();
    if (!stream_) throw rr::RingError("ringreduce: communicator is closed");
    c10::cuda::CUDAGuard guard(device_);
    join(true);
    cudaEvent_t done = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    const cudaError_t e = cudaEventRecord(done, stream_);
    if (e != cudaSuccess) cudaEventDestroy(done);
    C10_CUDA_CHECK(e);
    return std::make_unique<CudaWork>(done, device_, shared_, seq);
  }

 private:

  int nranks_ = 1;
  int device_ = 0;
  std::shared_ptr<Shared<Ring>> shared_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t after_ = nullptr;  // recorded on tail_ after the last call that ran there
  cudaEvent_t link_ = nullptr;   // our stream's end, for a caller's stream to wait on
  cudaStream_t tail_ = nullptr;  // the caller's stream of the last call; nullptr: ours
  // p2p calls against close() and the stream bookkeeping (tail_). Nobody blocks on it while
  // holding the GIL (lock_calls; close, unmap_peers and synchronize release the GIL first), so a
  // holder may wait for the GIL (or run Python) without a deadlock.
  std::mutex call_mu_;
  std::atomic<bool> closing_{false};  // close() began: the fast path declines (try_all_reduce)
  std::mutex held_mu_;  // held_ and spare_events_
  std::deque<Held> held_;
  std::vector<cudaEvent_t> spare_events_;
  std::shared_ptr<rr::runtime::Recorder> rec_;
};


}  // namespace ringreduce::binding
#pragma GCC visibility pop
