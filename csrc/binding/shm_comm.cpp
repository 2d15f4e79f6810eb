#include "binding/shm_comm.h"

#include <optional>

#include <ATen/record_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include "binding/torch_types.h"
#include "runtime/shm_map.h"

namespace ringreduce::binding {

unsigned long& main_thread_ident() {
  static unsigned long ident = 0;
  return ident;
}

PyObject*& ring_error_type() {
  static PyObject* type = nullptr;
  return type;
}

namespace {

// The type of every Work's future value (a list of tensors); made once, not per call.
const c10::TypePtr& tensor_list_type() {
  static const c10::TypePtr type = c10::ListType::create(c10::TensorType::get());
  return type;
}

bool python_alive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

std::vector<shm::Step> parse_steps(const std::vector<AutoStep>& steps) {
  std::vector<shm::Step> out;
  for (const auto& [from, name] : steps) {
    TORCH_CHECK_VALUE(from >= 0, "ringreduce: an auto step's size must be >= 0 bytes, got ", from);
    if (name == shm::kCmaWholeStep)
      out.push_back({static_cast<uint64_t>(from), Algo::Cma, true});
    else
      out.push_back({static_cast<uint64_t>(from), parse_algo(name, shm::kStepAlgos, "an auto step's algorithm")});
  }
  return out;
}

void check_cpu(const at::Tensor& t, const char* arg, const char* api) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), who(api), arg, " is on ", t.device(),
                    "; the shared-memory transport takes CPU tensors");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, who(api), arg, " must be a dense (strided) tensor");
}

// A contiguous tensor to run on in place of t (t itself when it is contiguous), and whether the
// result must be copied back into t.
at::Tensor contiguous_out(const at::Tensor& t, bool& copy_back) {
  copy_back = !t.is_contiguous();
  return copy_back ? at::empty_like(t, at::MemoryFormat::Contiguous) : t;
}

}  // namespace

// -- RingWork ---------------------------------------------------------------------------------------

RingWork::RingWork(c10d::OpType op, std::vector<at::Tensor> outputs, const char* profiling_title)
    : Work(-1, op, profiling_title,
           profiling_title ? std::optional<std::vector<at::Tensor>>(outputs) : std::nullopt),
      outputs_(std::move(outputs)) {
  for (const at::Tensor& t : outputs_)
    if (!t.device().is_cpu()) {
      future_ = c10::make_intrusive<c10::ivalue::Future>(tensor_list_type(),
                                                         std::vector<c10::Device>{t.device()});
      break;
    }
}

void RingWork::settle(const c10::intrusive_ptr<c10::ivalue::Future>& f) {
  if (error_.empty())
    f->markCompleted(c10::IValue(outputs_));
  else
    f->setError(std::make_exception_ptr(RingError(error_)));
}

c10::intrusive_ptr<c10::ivalue::Future> RingWork::getFuture() {
  std::lock_guard<std::mutex> lk(future_mu_);
  if (!future_) {
    future_ = c10::make_intrusive<c10::ivalue::Future>(tensor_list_type());
    if (outcome_known_) settle(future_);
  }
  return future_;
}

void RingWork::complete(const std::string& error) {
  c10::intrusive_ptr<c10::ivalue::Future> f;
  {
    std::lock_guard<std::mutex> lk(future_mu_);
    outcome_known_ = true;
    error_ = error;
    f = future_;
  }
  // Work first: a waiter woken by the future (DDP's callbacks) may ask the Work.
  if (error.empty()) {
    finish();
  } else {
    // RingError: reaches Python (future.wait, Work.wait) as ringreduce.RingReduceError.
    finish(std::make_exception_ptr(RingError(error)));
  }
  if (f) settle(f);
}

void RingWork::help() {
  auto exec = exec_.lock();
  if (!exec || !job_) return;
  const bool gil = python_alive() && PyGILState_Check();
  std::optional<py::gil_scoped_release> nogil;
  if (gil) nogil.emplace();
  with_interrupts([&](const Executor::Interrupted* i) { return exec->wait(job_, i); },
                  on_interrupt);
}

bool RingWork::wait(std::chrono::milliseconds timeout) {
  if (timeout == kNoTimeout) help();  // torch's "no timeout" (Work.hpp)
  return Work::wait(timeout);
}

c10::intrusive_ptr<c10::ivalue::Future> DoneWork::getFuture() {
  auto f = c10::make_intrusive<c10::ivalue::Future>(tensor_list_type());
  f->markCompleted(c10::IValue(outputs_));
  return f;
}

void Prepared::append(Prepared q) {
  more.push_back(q.call);
  more.insert(more.end(), q.more.begin(), q.more.end());
  keep.insert(keep.end(), q.keep.begin(), q.keep.end());
  outputs.insert(outputs.end(), q.outputs.begin(), q.outputs.end());
  if (q.after) {
    if (after) {
      after = [a = std::move(after), b = std::move(q.after)] {
        a();
        b();
      };
    } else {
      after = std::move(q.after);
    }
  }
}

c10d::OpType op_type(const std::string& op) {
  if (op == "allreduce") return c10d::OpType::ALLREDUCE;
  if (op == "allreduce_coalesced") return c10d::OpType::ALLREDUCE_COALESCED;
  if (op == "allgather") return c10d::OpType::ALLGATHER;
  if (op == "_allgather_base") return c10d::OpType::_ALLGATHER_BASE;
  if (op == "reduce_scatter") return c10d::OpType::REDUCE_SCATTER;
  if (op == "_reduce_scatter_base") return c10d::OpType::_REDUCE_SCATTER_BASE;
  return c10d::OpType::UNKNOWN;
}

// -- interrupts -------------------------------------------------------------------------------------

// fn(interrupted) -> false when a wait for its turn was interrupted. On the main thread, a pending
// signal's handler runs (with the GIL) every 50 ms of waiting; if it raises, the group is aborted
// and its exception (KeyboardInterrupt) is raised here instead of the ring's error.
void with_interrupts(const std::function<bool(const Executor::Interrupted*)>& fn,
                     const std::function<void()>& abort_fn) {
  if (PyThread_get_thread_ident() != main_thread_ident() || !python_alive()) {
    fn(nullptr);
    return;
  }
  std::unique_ptr<py::error_already_set> pending;
  const Executor::Interrupted check = [&pending] {
    py::gil_scoped_acquire acquire;
    if (PyErr_CheckSignals() == 0) return false;
    pending = std::make_unique<py::error_already_set>();
    return true;
  };
  bool finished = false;
  try {
    finished = fn(&check);
  } catch (...) {
    if (pending) throw py::error_already_set(*pending);
    throw;
  }
  if (!finished && abort_fn) abort_fn();
  if (pending) throw py::error_already_set(*pending);
}

// -- ShmComm ----------------------------------------------------------------------------------------

ShmComm::ShmComm(const std::string& name, bool create, int rank, int nranks, size_t slice_bytes,
                 double timeout_s, int64_t spin_ns, int64_t yield_ns, const std::string& algo,
                 int64_t oneshot_max_bytes, size_t trace_buffer, const std::string& stream,
                 const std::vector<AutoStep>& auto_steps, uint64_t cma_block_bytes) {
  shm::Options opt;
  opt.rank = rank;
  opt.nranks = nranks;
  opt.timeout_s = timeout_s;
  opt.spin_ns = spin_ns;
  opt.yield_ns = yield_ns;
  opt.algo = parse_algo(algo, shm::kForcedAlgos, "RINGREDUCE_ALGO");
  TORCH_CHECK_VALUE(oneshot_max_bytes >= 0, "ringreduce: oneshot_max_bytes must be >= 0, got ",
                    oneshot_max_bytes);
  opt.oneshot_max_bytes = static_cast<size_t>(oneshot_max_bytes);
  opt.steps = parse_steps(auto_steps);
  opt.cma_block_bytes = cma_block_bytes;  // checked by the caller (ringreduce/_shm.py)
  using Stream = shm::Options::Stream;
  TORCH_CHECK_VALUE(stream == "auto" || stream == "0" || stream == "1",
                    "ringreduce: RINGREDUCE_STREAM must be auto, 0 or 1, got '", stream, "'");
  opt.stream = stream == "auto" ? Stream::Auto : stream == "1" ? Stream::Always : Stream::Never;
  nranks_ = nranks;
  rank_ = rank;
  TORCH_CHECK_VALUE(slice_bytes >= 64, "ringreduce: slice_bytes must be >= 64, got ", slice_bytes);
  comm_ = std::make_unique<shm::Endpoint>(name, create, opt, slice_bytes);
  exec_ = std::make_shared<Executor>();
  rec_ = std::make_shared<runtime::Recorder>(trace_buffer);
  rec_->set_probe([this] { return comm_->closed() ? std::string() : comm_->protocol().waiting(); });
  runtime::Recorder::add(rec_);
}

ShmComm::~ShmComm() {
  // The worker may complete futures whose Python callbacks take the GIL: never join holding it.
  if (python_alive() && PyGILState_Check()) {
    py::gil_scoped_release nogil;
    close();
  } else {
    close();
  }
}

Prepared ShmComm::all_reduce(const at::Tensor& t, int op, int wire) {
  const char* api = api_name(Coll::AllReduce);
  check_cpu(t, "tensor", api);
  const DType dt = to_dtype(t, "tensor", api);
  const Wire w = to_wire(wire, t, op, "tensor", api);
  Prepared p;
  bool copy_back = false;
  at::Tensor buf = t;
  if (!t.is_contiguous()) {
    buf = t.contiguous();
    copy_back = true;
  }
  p.call = {Coll::AllReduce, dt, to_op(op), t.numel(), buf.data_ptr(), buf.data_ptr(), w};
  p.keep = {t, buf};
  if (copy_back) p.after = [t, buf]() mutable { t.copy_(buf); };
  p.outputs = {t};
  return p;
}

Prepared ShmComm::all_reduce_flat(const std::vector<at::Tensor>& ts, int op) {
  TORCH_CHECK_VALUE(!ts.empty(), "ringreduce: no tensors to all-reduce");
  std::vector<at::Tensor> flat_parts;
  for (size_t i = 0; i < ts.size(); ++i) {
    check_cpu(ts[i], "tensors", api_name(Coll::AllReduce));
    TORCH_CHECK_TYPE(ts[i].scalar_type() == ts[0].scalar_type(), "ringreduce: coalesced tensors ",
                     "must share one dtype; tensor ", i, " is ", ts[i].scalar_type(), ", tensor 0 ",
                     ts[0].scalar_type());
    flat_parts.push_back(ts[i].reshape(-1));
  }
  at::Tensor flat = at::cat(flat_parts);
  Prepared p;
  p.call = {Coll::AllReduce, to_dtype(flat, "tensors", api_name(Coll::AllReduce)), to_op(op), flat.numel(), flat.data_ptr(),
            flat.data_ptr()};
  p.keep = {flat};
  std::vector<at::Tensor> outs = ts;
  p.after = [outs, flat]() mutable {
    int64_t offset = 0;
    for (at::Tensor& t : outs) {
      t.copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  };
  p.outputs = ts;
  return p;
}

Prepared ShmComm::reduce_scatter(const at::Tensor& out, const at::Tensor& in, int op, int wire) {
  const char* api = api_name(Coll::ReduceScatter);
  check_cpu(out, "output", api);
  check_cpu(in, "input", api);
  const DType dt = to_dtype(in, "input", api);
  const Wire w = to_wire(wire, in, op, "input", api);
  check_same_dtype(api, "output", out, "input", in);
  check_sizes(api, "input", in, "output", out, nranks_);
  at::Tensor src = in.contiguous();
  bool copy_back = false;
  at::Tensor dst = contiguous_out(out, copy_back);
  Prepared p;
  p.call = {Coll::ReduceScatter, dt, to_op(op), in.numel(), src.data_ptr(),
            dst.data_ptr(), w};
  p.keep = {src, dst, out};
  if (copy_back) p.after = [out, dst]() mutable { out.copy_(dst); };
  p.outputs = {out};
  return p;
}

Prepared ShmComm::all_gather(const at::Tensor& out, const at::Tensor& in) {
  const char* api = api_name(Coll::AllGather);
  check_cpu(out, "output_tensor", api);
  check_cpu(in, "input_tensor", api);
  const DType dt = to_dtype(in, "input_tensor", api);
  check_same_dtype(api, "output_tensor", out, "input_tensor", in);
  check_sizes(api, "output_tensor", out, "input_tensor", in, nranks_);
  at::Tensor src = in.contiguous();
  bool copy_back = false;
  at::Tensor dst = contiguous_out(out, copy_back);
  Prepared p;
  p.call = {Coll::AllGather, dt, RedOp::Sum, out.numel(), src.data_ptr(),
            dst.data_ptr()};
  p.keep = {src, dst, out};
  if (copy_back) p.after = [out, dst]() mutable { out.copy_(dst); };
  p.outputs = {out};
  return p;
}

void ShmComm::run_ring(const Call& c, const Executor::Interrupted* interrupted, runtime::Source source,
                       int64_t t_queued) {
  if (comm_->closed()) throw closed_error();
  shm::Protocol& ring = comm_->protocol();
  // A tensor in a pool buffer of this communicator: the buffer stays mapped for the call.
  const uint64_t nbytes = static_cast<uint64_t>(c.numel) * dtype_size(c.dtype);
  std::shared_ptr<shm::PoolBuffer> buf;
  shm::Pool pool;
  if (c.coll == Coll::AllReduce && c.in == c.out && (buf = shm::pool_find(uid_, c.in, nbytes)))
    pool = {&buf->bases, buf->bytes,
            static_cast<uint64_t>(static_cast<const char*>(c.in) - buf->bases[buf->rank])};
  const shm::Pool* pp = buf ? &pool : nullptr;
  const Algo algo = ring.choose(c, pp);  // planned once: the recorder and the run share it
  uint64_t seq = 0;
  if (rec_->on()) {
    const int64_t t = runtime::now_ns();
    seq = rec_->begin(coll_name(c.coll), dtype_name(c.dtype), op_name(c.op),
                      shm::algo_name(algo), c.numel,
                      static_cast<uint64_t>(c.numel) * dtype_size(c.dtype), source,
                      t_queued ? t_queued : t, t);
  }
  try {
    ring.run(c, algo, interrupted, pp);
  } catch (...) {
    rec_->rethrow_failed(seq);
  }
  rec_->finished(seq);
}

namespace {
// The range a call shows as in torch.profiler traces.
const char* profile_name(Coll c) {
  switch (c) {
    case Coll::AllReduce: return "ringreduce::all_reduce";
    case Coll::ReduceScatter: return "ringreduce::reduce_scatter";
    case Coll::AllGather: return "ringreduce::all_gather";
  }
  return "ringreduce::collective";
}
}  // namespace

WorkPtr ShmComm::start(Prepared p, bool async_op, c10d::OpType op, bool gil) {
  if (closed()) throw closed_error();
  auto abort_fn = [this] { abort("rank " + std::to_string(rank_) + ": interrupted by a signal"); };
  if (!async_op) {
    // torch.profiler: one range around the call on this thread, with its tensors' shapes and
    // dtypes (inputs are built only while a profiler listens).
    RECORD_FUNCTION(profile_name(p.call.coll), std::vector<c10::IValue>(p.outputs.begin(), p.outputs.end()));
    const runtime::Source source = runtime::current_source();
    std::optional<py::gil_scoped_release> nogil;
    if (gil) nogil.emplace();
    with_interrupts([&](const Executor::Interrupted* i) {
      return exec_->run([&](const Executor::Interrupted* ii) {
        run_ring(p.call, ii, source, 0);
        for (const Call& c : p.more) run_ring(c, ii, source, 0);
        if (p.after) p.after();
      }, i);
    }, abort_fn);
    return WorkPtr();
  }
  // torch.profiler: c10d's Work records a range from here to the call's end, on whichever thread
  // ends it (as Gloo's and NCCL's Work do); only while a profiler listens.
  const char* title = at::hasCallbacks() ? profile_name(p.call.coll) : nullptr;
  auto work = c10::make_intrusive<RingWork>(op, p.outputs, title);
  auto shared = std::make_shared<Prepared>(std::move(p));
  const runtime::Source source = runtime::current_source();
  const int64_t queued = rec_->on() ? runtime::now_ns() : 0;
  auto job = exec_->submit(
      [this, shared, source, queued](const Executor::Interrupted* i) {
        run_ring(shared->call, i, source, queued);
        for (const Call& c : shared->more) run_ring(c, i, source, queued);
        if (shared->after) shared->after();
      },
      [work, shared](const std::string& error) mutable {
        work->complete(error);
        shared.reset();  // the tensors, once the Work holds its result
      });
  work->attach(exec_, job);
  std::weak_ptr<Executor> alive = exec_;
  work->on_interrupt = [this, alive, abort_fn] {
    if (alive.lock()) abort_fn();
  };
  return work;
}

namespace {
// A plain (not a subclass), contiguous CPU tensor of a ring dtype: the fast paths' condition.
bool fast_tensor(PyObject* obj, DType& dt) {
  if (!THPVariable_CheckExact(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.layout() != at::kStrided || !t.device().is_cpu() || !t.is_contiguous()) return false;
  return try_dtype(t.scalar_type(), dt);
}
}  // namespace

WorkPtr ShmComm::try_all_reduce_async(PyObject* obj, int op) {
  DType dt;
  if (!fast_tensor(obj, dt) || comm_->closed()) return WorkPtr();
  const at::Tensor& t = THPVariable_Unpack(obj);
  Prepared p;
  p.call = {Coll::AllReduce, dt, to_op(op), t.numel(), t.data_ptr(), t.data_ptr()};
  p.outputs = {t};
  return start(std::move(p), /*async_op=*/true, c10d::OpType::ALLREDUCE, /*gil=*/true);
}

bool ShmComm::try_all_reduce(PyObject* obj, int op, int wire) {
  DType dt;
  if (!fast_tensor(obj, dt)) return false;
  if (!wire_fits(wire, dt, op)) return false;  // the full path raises the API's error
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (comm_->closed() || !exec_->try_claim()) return false;
  struct Release {
    Executor* e;
    ~Release() { e->release(); }
  } release{exec_.get()};
  const Call c{Coll::AllReduce, dt, to_op(op), t.numel(), t.data_ptr(), t.data_ptr(), static_cast<Wire>(wire)};
  RECORD_FUNCTION("ringreduce::all_reduce", std::vector<c10::IValue>({t}));
  py::gil_scoped_release nogil;
  with_interrupts([&](const Executor::Interrupted* i) {
    run_ring(c, i, runtime::current_source(), 0);
    return true;
  }, nullptr);
  return true;
}

void ShmComm::abort(const std::string& why) {
  if (!comm_->closed()) comm_->protocol().abort(why);
}
bool ShmComm::broken() { return !comm_->closed() && comm_->protocol().broken(); }
std::string ShmComm::reason() { return comm_->closed() ? "" : comm_->protocol().abort_reason(); }
int64_t ShmComm::slice_bytes() { return static_cast<int64_t>(comm_->protocol().slice_bytes()); }
int64_t ShmComm::op_seq() { return static_cast<int64_t>(comm_->protocol().op_seq()); }

void ShmComm::set_auto_steps(const std::vector<AutoStep>& steps) {
  if (comm_->closed()) throw closed_error();
  comm_->protocol().set_steps(parse_steps(steps));
}

void ShmComm::drop_cma_scratch() {
  if (comm_->closed()) throw closed_error();
  synchronize(/*gil=*/true);  // between calls
  comm_->protocol().drop_cma_scratch();
}

std::string ShmComm::cma_probe() {
  if (comm_->closed()) throw closed_error();
  return comm_->protocol().cma_probe();
}

std::string ShmComm::algo(int64_t numel, const at::Tensor& like) {
  const Call c{Coll::AllReduce, to_dtype(like, "like"), RedOp::Sum, numel, nullptr, nullptr};
  const shm::Protocol& p = comm_->protocol();
  const Algo a = p.choose(c);
  return a == Algo::Cma && p.cma_block(c) == 0 ? shm::kCmaWholeStep : shm::algo_name(a);
}

void ShmComm::synchronize(bool gil) {
  std::optional<py::gil_scoped_release> nogil;
  if (gil) nogil.emplace();
  with_interrupts([&](const Executor::Interrupted* i) { return exec_->synchronize(i); },
                  [this] { abort("rank " + std::to_string(rank_) + ": interrupted by a signal"); });
}

void ShmComm::close() {
  std::lock_guard<std::mutex> lk(close_mu_);
  if (rec_) rec_->set_probe(nullptr);  // waits for a dump reading the ring
  if (exec_) exec_->stop();
  // A fast-path call may still hold the executor (it never queues): wait for it to release.
  if (exec_) exec_->synchronize(nullptr);
  if (comm_) comm_->close();
}

bool ShmComm::closed() { return comm_->closed(); }

std::vector<int> ShmComm::pids() {
  std::lock_guard<std::mutex> lk(close_mu_);
  std::vector<int> out(nranks_, 0);
  if (!comm_->closed())
    for (int r = 0; r < nranks_; ++r) out[r] = comm_->protocol().pid_of(r);
  return out;
}

void ShmComm::pool_create(const std::string& name, int64_t bytes) {
  TORCH_CHECK_VALUE(bytes > 0, "ringreduce: a shared buffer needs at least 1 byte, got ", bytes);
  auto b = std::make_shared<shm::PoolBuffer>();
  b->owner = uid_;
  b->rank = rank_;
  b->bytes = static_cast<uint64_t>(bytes);
  b->bases.assign(nranks_, nullptr);
  b->bases[rank_] = runtime::shm_create(name, b->bytes);
  pending_pool_ = std::move(b);
}

at::Tensor ShmComm::pool_attach(const std::vector<std::string>& names) {
  TORCH_CHECK(pending_pool_, "ringreduce: pool_attach without pool_create");
  TORCH_CHECK_VALUE(static_cast<int>(names.size()) == nranks_, "ringreduce: ", names.size(),
                    " buffer names for ", nranks_, " ranks");
  std::shared_ptr<shm::PoolBuffer> b = std::move(pending_pool_);
  for (int q = 0; q < nranks_; ++q)
    if (q != rank_) {
      uint64_t bytes = b->bytes;
      b->bases[q] = runtime::shm_map(names[q], &bytes);
    }
  shm::pool_register(b);
  // The tensor's deleter drops the registration; the mappings go with the last reference.
  return at::from_blob(
      b->bases[rank_], {static_cast<int64_t>(b->bytes)},
      [b](void*) mutable {
        shm::pool_unregister(b.get());
        b.reset();
      },
      at::TensorOptions().dtype(at::kByte));
}

}  // namespace ringreduce::binding
