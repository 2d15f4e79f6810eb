// The CUDA communicator (cuda_comm.h): one class over any device transport, its policy decided by
// the transport's capabilities.
#include "binding/cuda_comm.h"

#include <ATen/record_function.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <nvtx3/nvToolsExt.h>
#include <torch/csrc/autograd/python_variable.h>

#include <map>

#include "binding/torch_types.h"
#include "cuda/host.h"

namespace ringreduce::binding {

namespace rc = ringreduce::cuda;

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

namespace {

std::mutex g_streams_mu;
std::map<int, std::vector<cudaStream_t>>& free_streams() {
  static auto* m = new std::map<int, std::vector<cudaStream_t>>();
  return *m;
}

void raise_if(Shared& s) {
  const std::string why = s.failure();
  if (!why.empty()) throw RingError(why);
}

}  // namespace

cudaStream_t take_stream(int device) {
  {
    std::lock_guard<std::mutex> lk(g_streams_mu);
    auto& v = free_streams()[device];
    if (!v.empty()) {
      cudaStream_t s = v.back();
      v.pop_back();
      return s;
    }
  }
  cudaStream_t s = nullptr;
  C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

void give_back_stream(int device, cudaStream_t s) {
  std::lock_guard<std::mutex> lk(g_streams_mu);
  free_streams()[device].push_back(s);
}

size_t free_stream_count(int device) {
  std::lock_guard<std::mutex> lk(g_streams_mu);
  auto it = free_streams().find(device);
  return it == free_streams().end() ? 0 : it->second.size();
}

// ---- CudaWork ----

CudaWork::~CudaWork() {
  if (done_ && !finalizing()) cudaEventDestroy(done_);
}

bool CudaWork::is_completed() {
  if (!done_) return true;
  c10::cuda::CUDAGuard guard(device_);
  rc::RelaxedCapture relaxed;  // another thread may be capturing a graph
  const cudaError_t e = cudaEventQuery(done_);
  if (e == cudaErrorNotReady) return false;
  C10_CUDA_CHECK(e);
  return true;
}

void CudaWork::synchronize() {
  if (!done_) return;
  c10::cuda::CUDAGuard guard(device_);
  {
    py::gil_scoped_release nogil;
    rc::RelaxedCapture relaxed;
    const cudaError_t e = cudaEventSynchronize(done_);
    comm_->poll();
    if (e != cudaSuccess) {
      cudaGetLastError();
      const std::string why = comm_->failure();
      throw RingError(!why.empty() ? why : std::string("ringreduce: CUDA error while waiting for a "
                                                       "collective: ") + cudaGetErrorString(e));
    }
  }
  const uint64_t first = comm_->failed_seq();
  if (first != 0 && first <= seq_) raise_if(*comm_);
}

// ---- CudaComm: construction, close, the public calls ----

CudaComm::CudaComm(std::unique_ptr<runtime::Transport> t) {
  TORCH_CHECK(t && t->caps().device, "ringreduce: CudaComm takes a device transport");
  C10_CUDA_CHECK(cudaGetDevice(&device_));
  nranks_ = t->nranks();
  shared_ = std::make_shared<Shared>();
  shared_->caps = t->caps();
  shared_->t = std::move(t);
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&after_, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&link_, cudaEventDisableTiming));
  stream_ = take_stream(device_);
}

CudaComm::~CudaComm() {
  if (finalizing()) {  // no CUDA call, no GIL: the process frees it all at exit
    if (shared_->t) shared_->t->stop_threads();  // host threads only
    (void)shared_->t.release();
    for (Held& h : held_) (void)h.tensors.release();
    return;
  }
  close(false);  // not closed by Python: a neighbour may still read our memory
}

runtime::Transport& CudaComm::transport() {
  if (!shared_->t || shared_->t->closed()) throw closed_error();
  return *shared_->t;
}

void CudaComm::check(const at::Tensor& t, const char* arg, Coll coll) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.get_device() == device_, who(api_name(coll)), arg, " is on ",
                    t.device(), "; this communicator moves tensors on cuda:", device_);
  TORCH_CHECK_VALUE(t.is_contiguous(), who(api_name(coll)), arg, " must be contiguous");
}

Wire CudaComm::wire_of(Coll coll, int wire, const at::Tensor& t, int op, const char* arg) {
  const Wire w = to_wire(wire, t, op, arg, api_name(coll));
  const std::string why = runtime::wire_refusal(shared_->caps, shared_->t ? shared_->t->name() : "closed",
                                                coll, w);
  TORCH_CHECK_NOT_IMPLEMENTED(why.empty(), who(api_name(coll)), why);
  return w;
}

py::object CudaComm::all_reduce(at::Tensor t, int op, bool async_op, int wire) {
  check(t, "tensor", Coll::AllReduce);
  return run({Coll::AllReduce, to_dtype(t, "tensor", api_name(Coll::AllReduce)), to_op(op), t.numel(), t.data_ptr(), t.data_ptr(),
              wire_of(Coll::AllReduce, wire, t, op, "tensor"), t.storage().unsafeGetStorageImpl()}, {t}, async_op);
}

py::object CudaComm::reduce_scatter(at::Tensor out, at::Tensor in, int op, bool async_op, int wire) {
  check(out, "output", Coll::ReduceScatter);
  check(in, "input", Coll::ReduceScatter);
  const char* api = api_name(Coll::ReduceScatter);
  check_same_dtype(api, "output", out, "input", in);
  check_sizes(api, "input", in, "output", out, nranks_);
  return run({Coll::ReduceScatter, to_dtype(in, "input", api), to_op(op), in.numel(), in.data_ptr(),
              out.data_ptr(), wire_of(Coll::ReduceScatter, wire, in, op, "input")}, {out, in}, async_op);
}

py::object CudaComm::all_gather(at::Tensor out, at::Tensor in, bool async_op) {
  check(out, "output_tensor", Coll::AllGather);
  check(in, "input_tensor", Coll::AllGather);
  const char* api = api_name(Coll::AllGather);
  check_same_dtype(api, "output_tensor", out, "input_tensor", in);
  check_sizes(api, "output_tensor", out, "input_tensor", in, nranks_);
  return run({Coll::AllGather, to_dtype(in, "input_tensor", api), RedOp::Sum, out.numel(), in.data_ptr(),
              out.data_ptr()}, {out, in}, async_op);
}

bool CudaComm::fast_all_reduce(PyObject* obj, int op, int wire) {
  // Closing or closed: the full path (a new communicator, or its error); run() checks again
  // under its lock. A wire: the full path.
  if (wire != 0 || !THPVariable_CheckExact(obj) || closing_.load(std::memory_order_relaxed)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  DType dt;
  if (t.layout() != at::kStrided || !t.is_cuda() || t.get_device() != device_ || !t.is_contiguous() ||
      !try_dtype(t.scalar_type(), dt))
    return false;
  // Ranges for torch.profiler and NVTX as the full path's (_cuda.Communicator._enqueue).
  RECORD_FUNCTION("ringreduce::all_reduce", std::vector<c10::IValue>({t}));
  nvtxRangePushA("ringreduce::all_reduce");
  struct Pop {
    ~Pop() { nvtxRangePop(); }
  } pop;
  run({Coll::AllReduce, dt, to_op(op), t.numel(), t.data_ptr(), t.data_ptr(), Wire::None,
       t.storage().unsafeGetStorageImpl()}, {t}, false);
  return true;
}

void CudaComm::attach_recorder(std::shared_ptr<runtime::Recorder> rec) {
  std::weak_ptr<Shared> weak = shared_;
  rec->set_device_probe([weak](uint64_t dev_seq, int64_t* done_ns, std::string* error) {
    auto s = weak.lock();
    if (!s || !s->t || s->t->closed()) return 0;
    const uint64_t failed = s->t->failed_seq();
    if (failed != 0 && dev_seq >= failed) {
      *error = s->t->failure();
      return 3;
    }
    return s->t->call_state(dev_seq, done_ns);
  });
  transport().log_calls(rec->on());
  rec_ = std::move(rec);
}

void CudaComm::abort(const std::string& why) {
  if (shared_->t && !shared_->t->closed()) shared_->t->abort(why);
}

void CudaComm::watch_peers(const std::vector<std::pair<int, int>>& peers) {
  std::vector<runtime::Peer> p;
  for (const auto& [rank, pid] : peers) p.push_back({rank, pid});
  transport().watch_peers(std::move(p));
}

void CudaComm::synchronize() {
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

bool CudaComm::unmap_peers() {
  if (!stream_ || !shared_->t || !shared_->caps.two_phase_close) return true;
  c10::cuda::CUDAGuard guard(device_);
  py::gil_scoped_release nogil;
  std::lock_guard<std::mutex> calls(call_mu_);  // a call being enqueued finishes first
  join(false);
  cudaStreamSynchronize(stream_);
  return shared_->t->unmap_peers();
}

void CudaComm::close(bool peers_done) {
  closing_.store(true, std::memory_order_relaxed);
  if (!stream_) return;
  if (rec_) rec_->set_device_probe(nullptr);  // waits for a dump reading the transport
  c10::cuda::CUDAGuard guard(device_);
  {
    // A destructor called by the garbage collector holds the GIL; one called elsewhere may not.
    std::unique_ptr<py::gil_scoped_release> nogil;
    if (PyGILState_Check()) nogil = std::make_unique<py::gil_scoped_release>();
    // Taken without the GIL, released before it is taken back (see run): a call another thread
    // is enqueueing finishes first, and a later one finds the transport closed.
    std::lock_guard<std::mutex> calls(call_mu_);
    join(false);  // the calls that ran on the callers' streams too
    cudaStreamSynchronize(stream_);
    if (shared_->t) shared_->t->close(peers_done);
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

size_t CudaComm::held_calls() {
  std::lock_guard<std::mutex> lk(held_mu_);
  return held_.size();
}

void CudaComm::release_finished() {
  if (!stream_) return;
  c10::cuda::CUDAGuard guard(device_);
  release_held(false);
}

py::object CudaComm::marker() {
  std::unique_ptr<CudaWork> w;
  {
    std::unique_lock<std::mutex> calls = lock_calls();
    w = marker_locked();
  }
  return py::cast(std::move(w));  // a Python object (maybe a collection) after the unlock
}

// ---- one call ----

py::object CudaComm::run(const Call& call, const std::vector<at::Tensor>& tensors, bool async_op) {
  // The whole call under call_mu_, so that close() on another thread waits for it (the fast path
  // does not take the Python lock that orders the full path with close). Tensors of finished calls
  // are destroyed after the unlock (their destructors may run Python): declared before the lock.
  std::vector<Tensors> finished;
  std::unique_lock<std::mutex> calls = lock_calls();
  // Closed, or a close in progress: refused before the recorder sees the call.
  if (shared_->t && !shared_->t->open()) throw closed_error();
  runtime::Transport& t = transport();  // after the lock: "closed" if close() ran first
  const runtime::Caps& caps = shared_->caps;
  c10::cuda::CUDAGuard guard(device_);
  const cudaStream_t cur = c10::cuda::getCurrentCUDAStream(device_).stream();
  // Inside a CUDA graph capture: refused before our stream joins the capture, so that the capture
  // stays valid. An async handle would be waited on from the host (the worker thread), which a
  // graph never signals.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(cur, &capture));
  const bool captured = capture != cudaStreamCaptureStatusNone;
  Call c = call;  // what the transports read of the capture: asked here only
  c.captured = captured;
  if (captured) {
    if (async_op)
      throw RingError("ringreduce: async_op=True cannot be captured in a CUDA graph (its Work is "
                      "waited on by the host); use async_op=False inside the capture");
    if (!caps.capture_safe) throw RingError(runtime::capture_refusal(t.name()));
    if (nranks_ > 1) pin_for_graph(cur);
  }
  if (nranks_ == 1) return run_alone(c, async_op);
  // Where the call runs: a synchronous call outside a capture on the caller's stream where the
  // transport can, else on ours after the caller's work; either way after every earlier call.
  const bool on_caller = caps.on_caller_stream && !async_op && !captured;
  const cudaStream_t s = on_caller ? cur : stream_;
  if (!on_caller) {
    C10_CUDA_CHECK(cudaEventRecord(ready_, cur));
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
  }
  if (!captured) follow(s, cur);
  const Plan plan = t.plan(c);  // planned once: the recorder, the hold below, and run()
  uint64_t seq = 0;
  if (rec_ && rec_->on()) {  // started = enqueued; the device says when it ended
    const int64_t now = runtime::now_ns();
    seq = rec_->begin(coll_name(c.coll), dtype_name(c.dtype), op_name(c.op), algo_name(plan.algo), c.numel,
                      static_cast<uint64_t>(c.numel) * dtype_size(c.dtype), runtime::current_source(),
                      now, now);
  }
  try {
    if (caps.run_waits) {
      py::gil_scoped_release nogil;  // may wait on the host until its work is enqueued
      t.run(c, plan, s);
    } else {
      t.run(c, plan, s);
    }
  } catch (...) {
    if (!rec_) throw;
    rec_->rethrow_failed(seq);
  }
  if (plan.in_place) {
    const std::string note = t.take_note();
    if (!note.empty())
      TORCH_WARN("ringreduce: ", note, " (said once per communicator)");
  }
  if (seq) {
    if (captured)
      rec_->finished(seq);  // captured into a graph, not run: the device has nothing to say
    else
      rec_->set_dev_seq(seq, t.op_seq());
  }
  if (captured) {
    // Captured, not run: the graph's replays own the ordering; torch's graph pool keeps the memory
    // of tensors made in the capture. Our stream rejoins the capture here.
    C10_CUDA_CHECK(cudaEventRecord(ready_, stream_));
    C10_CUDA_CHECK(cudaStreamWaitEvent(cur, ready_, 0));
    return py::none();
  }
  if (on_caller) {
    // The tensors are the caller's stream's, as for any op on it: nothing to hold, except a
    // registered buffer's or an imported tensor's, whose release unmaps the peers' mappings the
    // kernel still reads (held until it ends: the allocator cannot free them before). after_
    // marks the call's end for the next call on another stream, and for join().
    C10_CUDA_CHECK(cudaEventRecord(after_, cur));
    tail_ = cur;
    if (plan.in_place) {
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
  // The caching allocator must not reuse these tensors' memory before our stream is done: held
  // until this event, not record_stream (which would tie our stream to their frees).
  const cudaEvent_t done = hold(tensors, stream_, &finished);
  if (!async_op) {
    C10_CUDA_CHECK(cudaStreamWaitEvent(cur, done, 0));
    return py::none();
  }
  std::unique_ptr<CudaWork> w = marker_locked();
  calls.unlock();  // no Python object is made under call_mu_
  return py::cast(std::move(w));
}

// World 1: all_reduce is the identity (every op, AVG divides by 1); reduce_scatter and all_gather
// copy input to output on the caller's stream. No event, no stream of ours. A narrow wire rounds
// as a group of one would: the transport's kernel on the caller's stream.
py::object CudaComm::run_alone(const Call& c, bool async_op) {
  const std::string failed = shared_->failure();  // aborted: refused, as at any world size
  if (!failed.empty()) throw RingError(runtime::broken_message(failed));
  const size_t bytes = static_cast<size_t>(c.numel) * dtype_size(c.dtype);
  const cudaStream_t cur = c10::cuda::getCurrentCUDAStream(device_).stream();
  if (c.wire != Wire::None) transport().run(c, cur);
  if (c.wire == Wire::None && c.coll != Coll::AllReduce && c.in != c.out && bytes > 0)
    C10_CUDA_CHECK(cudaMemcpyAsync(c.out, c.in, bytes, cudaMemcpyDeviceToDevice, cur));
  if (rec_ && rec_->on()) {
    const int64_t t = runtime::now_ns();
    const uint64_t seq = rec_->begin(coll_name(c.coll), dtype_name(c.dtype), op_name(c.op), "local",
                                     c.numel, bytes, runtime::current_source(), t, t);
    rec_->finished(seq);
  }
  if (!async_op) return py::none();
  return py::cast(std::make_unique<CudaWork>(nullptr, device_, shared_, 0));
}

// ---- streams, ordering and held tensors ----

// call_mu_ for a caller that may hold the GIL: never blocks on it with the GIL (a holder may be
// waiting for the GIL: a launch, a tensor destructor; or for the device: close).
std::unique_lock<std::mutex> CudaComm::lock_calls() {
  std::unique_lock<std::mutex> lk(call_mu_, std::try_to_lock);
  if (!lk.owns_lock()) {
    py::gil_scoped_release nogil;
    lk.lock();
  }
  return lk;
}

// Orders stream s after every earlier call of this communicator (they share its workspace and
// sequence): after_ if the last one ran on a caller's stream other than s, our stream's end if it
// ran there. Nothing when the last call ran on s, or when s is ours and already waits for cur,
// where the last one ran.
void CudaComm::follow(cudaStream_t s, cudaStream_t cur) {
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
void CudaComm::join(bool check) {
  if (tail_ == nullptr || stream_ == nullptr) return;
  const cudaError_t e = cudaStreamWaitEvent(stream_, after_, 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (check) C10_CUDA_CHECK(e);
  }
  tail_ = nullptr;
}

// The graph being captured on `cur` keeps the transport's memory until CUDA destroys the graph.
void CudaComm::pin_for_graph(cudaStream_t cur) {
  const runtime::Transport::Pin pin = transport().capture_pin();
  if (!pin.release) return;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  cudaError_t e = cudaStreamGetCaptureInfo(cur, &st, nullptr, &graph);
  if (e != cudaSuccess) {
    pin.release(pin.arg);
    C10_CUDA_CHECK(e);
  }
  cudaUserObject_t obj = nullptr;
  e = cudaUserObjectCreate(&obj, pin.arg, pin.release, 1, cudaUserObjectNoDestructorSync);
  if (e != cudaSuccess) {
    pin.release(pin.arg);
    C10_CUDA_CHECK(e);
  }
  e = cudaGraphRetainUserObject(graph, obj, 1, cudaGraphUserObjectMove);
  if (e != cudaSuccess) cudaUserObjectRelease(obj, 1);  // runs the release
  C10_CUDA_CHECK(e);
}

std::unique_ptr<CudaWork> CudaComm::marker_locked() {
  // Closed: say so before an event exists (it would leak, recorded on the legacy stream).
  const uint64_t seq = transport().op_seq();
  if (!stream_) throw closed_error();
  c10::cuda::CUDAGuard guard(device_);
  join(true);
  cudaEvent_t done = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  const cudaError_t e = cudaEventRecord(done, stream_);
  if (e != cudaSuccess) cudaEventDestroy(done);
  C10_CUDA_CHECK(e);
  return std::make_unique<CudaWork>(done, device_, shared_, seq);
}

cudaEvent_t CudaComm::spare_event() {
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
// caller's thread and the worker's: held_ under held_mu_, and the tensors are destroyed after it
// is released (their destructors may run Python code).
void CudaComm::release_held(bool all) {
  std::vector<Tensors> done;
  collect_held(all, &done);
}

void CudaComm::collect_held(bool all, std::vector<Tensors>* out) {
  std::lock_guard<std::mutex> lk(held_mu_);
  rc::RelaxedCapture relaxed;  // a query must not invalidate a graph another thread captures
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
    out->push_back(std::move(h.tensors));
    held_.pop_front();
  }
}

// Holds `tensors` until the work enqueued on `stream` so far is done; the event of that. The
// tensors of calls found finished go to *finished, for the caller to destroy after its locks.
cudaEvent_t CudaComm::hold(const std::vector<at::Tensor>& tensors, cudaStream_t stream,
                           std::vector<Tensors>* finished) {
  collect_held(false, finished);
  std::lock_guard<std::mutex> lk(held_mu_);
  cudaEvent_t e = spare_event();
  const cudaError_t err = cudaEventRecord(e, stream);
  if (err != cudaSuccess) spare_events_.push_back(e);
  C10_CUDA_CHECK(err);
  held_.push_back({e, std::make_unique<std::vector<at::Tensor>>(tensors)});
  return e;
}

}  // namespace ringreduce::binding
