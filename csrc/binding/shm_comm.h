// The shared-memory communicator as Python and the torch.distributed backend see it: torch tensors
// in, ring calls out, every call (direct API, backend, sync or async) through one Executor so that
// calls run in the order they were made. The backend (csrc/binding/backend.cpp) calls it from C++ without
// Python; the direct API through pybind11 (csrc/binding/module.cpp).
#pragma once
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "binding/fast_path.h"
#include "runtime/executor.h"
#include "runtime/recorder.h"
#include "shm/endpoint.h"

namespace ringreduce::binding {

using runtime::Executor;

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// Python's thread ident of the main thread (signals are delivered there); set at import.
unsigned long& main_thread_ident();
// ringreduce.RingReduceError, set at import.
PyObject*& ring_error_type();

// A collective the ring runs: done when its call completes; its future holds the output tensors
// (as c10d's own backends' futures do: DDP's reducer reads them). wait() runs the call on the
// waiting thread when the executor has not started it (see Executor).
class RingWork : public c10d::Work {
 public:
  // profiling_title: the torch.profiler range from now to complete() (null: none).
  RingWork(c10d::OpType op, std::vector<at::Tensor> outputs, const char* profiling_title = nullptr);
  // error "": success. Called once.
  void complete(const std::string& error);
  void attach(std::weak_ptr<Executor> exec, Executor::JobPtr job) {
    exec_ = std::move(exec);
    job_ = std::move(job);
  }
  // Runs this call here if it is still queued; then waits for it. Raises KeyboardInterrupt (after
  // aborting the group via on_interrupt) if Ctrl-C arrives while waiting on the main thread.
  void help();
  bool wait(std::chrono::milliseconds timeout) override;
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::function<void()> on_interrupt;  // aborts the group

 private:
  // Marks f with the call's outcome (outcome_known_ and error_ are set).
  void settle(const c10::intrusive_ptr<c10::ivalue::Future>& f);

  std::vector<at::Tensor> outputs_;
  // CPU outputs: made on the first getFuture() (a call waited on at once never needs one);
  // CUDA outputs: made here, so that completion records its events on the streams of the moment.
  std::mutex future_mu_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool outcome_known_ = false;
  std::string error_;
  std::weak_ptr<Executor> exec_;
  Executor::JobPtr job_;
};

// A call that already finished (a synchronous call through the backend): its future is made only
// if asked for.
class DoneWork : public c10d::Work {
 public:
  DoneWork(c10d::OpType op, std::vector<at::Tensor> outputs) : Work(-1, op), outputs_(std::move(outputs)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  void synchronize() override {}
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  std::vector<at::Tensor> outputs_;
};

c10d::OpType op_type(const std::string& name);

// One ring call ready to run: the native call, the tensors it must keep alive, and what to copy
// out once it is done (non-contiguous outputs, coalesced and list forms).
struct Prepared {
  Call call{};
  std::vector<Call> more;  // run after call, in one job (the *_coalesced forms)
  std::vector<at::Tensor> keep;
  std::function<void()> after;
  std::vector<at::Tensor> outputs;  // the Work's result

  // Appends q's calls, tensors, copy-out and outputs to this one's.
  void append(Prepared q);
};

using AutoStep = std::pair<int64_t, std::string>;

class ShmComm : public FastTarget {
 public:
  ShmComm(const std::string& name, bool create, int rank, int nranks, size_t slice_bytes,
          double timeout_s, int64_t spin_ns, int64_t yield_ns, const std::string& algo,
          int64_t oneshot_max_bytes, size_t trace_buffer, const std::string& stream = "auto",
          const std::vector<AutoStep>& auto_steps = {},
          uint64_t cma_block_bytes = shm::kDefaultSliceBytes);
  ~ShmComm() override;
  // Auto's algorithm above the one-shot threshold (shm::Step): (from bytes, "ring" | "twoshot" |
  // "cma" | "cmawhole"); before the first call, the same on every rank.
  void set_auto_steps(const std::vector<AutoStep>& steps);
  std::string cma_probe();  // "" when this rank can read every peer by cross-memory attach
  void drop_cma_scratch();  // after the calibration timed cma in whole chunks (16 MiB tensors)

  int nranks() const { return nranks_; }
  int rank() const { return rank_; }

  // Argument checks as the direct API's, then a ring call. fn: the API's name for messages.
  // wire: a Wire code (cpu/wire.h), 0 for none: float32/float16/bfloat16 tensors, SUM or AVG.
  Prepared all_reduce(const at::Tensor& t, int op, int wire = 0);
  Prepared all_reduce_flat(const std::vector<at::Tensor>& ts, int op);  // one pass, one dtype
  Prepared reduce_scatter(const at::Tensor& out, const at::Tensor& in, int op, int wire = 0);
  Prepared all_gather(const at::Tensor& out, const at::Tensor& in);

  // Runs p: synchronously (returns null, throws the ring's error or KeyboardInterrupt) or queued
  // (returns a RingWork of type op). gil: whether the calling thread holds the GIL.
  WorkPtr start(Prepared p, bool async_op, c10d::OpType op, bool gil);

  // The direct API's fast path: a synchronous all-reduce when obj is a plain contiguous CPU tensor
  // of a supported dtype and the communicator is idle; false (nothing touched) otherwise. wire: a
  // narrow wire's code (a float32/float16/bfloat16 tensor, SUM or AVG; else false).
  bool try_all_reduce(PyObject* obj, int op, int wire = 0);
  // Its async form: the queued call's Work, or null (nothing touched) under the same conditions
  // but for idleness.
  WorkPtr try_all_reduce_async(PyObject* obj, int op);
  // The fast path's calls (binding/fast_path.h): the two above.
  bool fast_all_reduce(PyObject* obj, int op, int wire) override { return try_all_reduce(obj, op, wire); }
  py::object fast_all_reduce_async(PyObject* obj, int op) override {
    WorkPtr w = try_all_reduce_async(obj, op);
    return w ? py::cast(w) : py::object();
  }

  void abort(const std::string& why);
  bool broken();
  std::string reason();
  int64_t slice_bytes();
  int64_t op_seq();
  std::string algo(int64_t numel, const at::Tensor& like);
  uint64_t stream_switches() { return comm_->protocol().stream_switches(); }
  int inflight() { return exec_->inflight(); }
  void synchronize(bool gil);
  // Stops the executor (queued calls run or fail first), then unmaps. Call without the GIL.
  void close();
  bool closed();
  const std::shared_ptr<runtime::Recorder>& recorder() { return rec_; }
  std::vector<int> pids();  // every rank's process id (0: not mapped yet)

  // ringreduce.shared_empty, in two steps around the exchange of names (Python, the store):
  // pool_create makes this rank's copy (bytes) under name; pool_attach maps the peers' copies
  // (every rank's name, in rank order) and returns this rank's copy as a uint8 tensor, whose
  // all-reduces on this communicator then read the peers' copies in place. pool_drop forgets a
  // created copy that will not be attached.
  void pool_create(const std::string& name, int64_t bytes);
  at::Tensor pool_attach(const std::vector<std::string>& names);
  void pool_drop() { pending_pool_.reset(); }

 private:
  // Runs one ring call on this thread (the executor claimed), recorded in the flight recorder as
  // made at t_queued (0: now) from source; a failure dumps the recorder and names the file.
  void run_ring(const Call& c, const Executor::Interrupted* interrupted, runtime::Source source,
                int64_t t_queued);

  std::unique_ptr<shm::Endpoint> comm_;
  std::shared_ptr<Executor> exec_;
  std::shared_ptr<runtime::Recorder> rec_;
  std::mutex close_mu_;
  int nranks_ = 0, rank_ = 0;
  std::shared_ptr<shm::PoolBuffer> pending_pool_;  // made by pool_create, not yet attached
  const uint64_t uid_ = next_uid();                // names this communicator to its pool buffers
  static uint64_t next_uid() {
    static std::atomic<uint64_t> n{0};
    return ++n;
  }
};

// Runs fn with an interrupt check when on the main thread: Ctrl-C aborts the group (the ring's
// own wait does; a wait for the executor calls abort_fn) and is raised (KeyboardInterrupt) after
// fn returns or throws. Call without the GIL.
// fn(interrupted) returns false when its wait was interrupted before the call ran.
void with_interrupts(const std::function<bool(const Executor::Interrupted*)>& fn,
                     const std::function<void()>& abort_fn);

}  // namespace ringreduce::binding
