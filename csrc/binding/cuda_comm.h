// The CUDA communicator of the torch binding: one class over any device transport
// (runtime::Transport: cuda::p2p::Endpoint, cuda::nccl::Endpoint), torch tensors in, calls out,
// with the stream semantics of torch.distributed with NCCL. What differs between transports comes
// from their capabilities (runtime::Caps), never from their type. Policy (cuda_comm.cpp):
// - where a call runs: a synchronous call outside a capture on the caller's current stream when
//   the transport can (Caps::on_caller_stream, as torch's SymmetricMemory ops and vLLM's
//   all-reduce do: no event pair); else on the communicator's own stream, after the caller's work
//   (an event), and the Work waits for it (async) or the caller's stream does (sync). Calls of one
//   communicator run in call order whatever streams they are on (follow()).
// - ownership of what torch sees (a stream or tensor torch still holds must outlive us, or the
//   process crashes at exit): our streams are never destroyed (take_stream/give_back_stream: torch
//   may hold one after close as an ExternalStream, a Future's events, a user's record_stream); the
//   tensors of a call on our stream are held until its event completes, not given to
//   record_stream; a call on the caller's stream uses the caller's tensors as any op does, except a
//   registered buffer's (held: its release unmaps the peers' copies); a graph that captured a
//   launch pins the transport's memory (Transport::capture_pin, a cudaUserObject).
// - destructors that run while the interpreter finalizes make no CUDA call and leave the GIL.
#pragma once
#include <Python.h>
#include <ATen/ATen.h>
#include <cuda_runtime.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "binding/fast_path.h"
#include "runtime/recorder.h"
#include "runtime/transport.h"

// Hidden, as pybind11 wants for the classes it binds (the module exports only its init function).
#pragma GCC visibility push(hidden)
namespace ringreduce::binding {

bool finalizing();  // the interpreter is finalizing: no CUDA call, no GIL
// Our streams (non-blocking, not torch's pool: our kernels spin on other ranks and must not queue
// behind user work), per device, reused from closed communicators and never destroyed.
cudaStream_t take_stream(int device);
void give_back_stream(int device, cudaStream_t s);
size_t free_stream_count(int device);

// What outlives the communicator for its Works and tensors: the transport (null once let go).
struct Shared {
  std::unique_ptr<runtime::Transport> t;
  runtime::Caps caps;
  std::string failure() { return t ? t->failure() : ""; }
  uint64_t failed_seq() { return t ? t->failed_seq() : 0; }
  void poll() {
    if (t && caps.polls && !t->closed()) t->poll();
  }
};

// The handle of the calls enqueued up to op_seq `seq`: an event on the communicator's stream.
class CudaWork {
 public:
  CudaWork(cudaEvent_t done, int device, std::shared_ptr<Shared> comm, uint64_t seq)
      : done_(done), device_(device), comm_(std::move(comm)), seq_(seq) {}
  ~CudaWork();
  bool is_completed();
  // Blocks the host until the calls are done on the device (each ends by its deadline at the
  // latest); raises if one of them failed. A failure of a later call does not count.
  void synchronize();

 private:
  cudaEvent_t done_;  // null: a world-1 call, nothing ran on our stream
  int device_;
  std::shared_ptr<Shared> comm_;
  uint64_t seq_;
};

class CudaComm : public FastTarget {
 public:
  explicit CudaComm(std::unique_ptr<runtime::Transport> t);
  ~CudaComm() override;

  runtime::Transport& transport();  // throws "closed"
  std::weak_ptr<Shared> shared() const { return shared_; }
  // wire: a narrow wire's code (Caps::wire); 0: none.
  py::object all_reduce(at::Tensor t, int op, bool async_op, int wire);
  py::object reduce_scatter(at::Tensor out, at::Tensor in, int op, bool async_op, int wire);
  py::object all_gather(at::Tensor out, at::Tensor in, bool async_op);
  // The fast path (binding/fast_path.h): a synchronous all_reduce of an exact, contiguous tensor
  // on this device in a dtype the core reduces, without a wire; false for anything else.
  bool fast_all_reduce(PyObject* obj, int op, int wire) override;
  py::object marker();  // a Work whose event follows every call enqueued so far
  std::string failure() { return shared_->failure(); }
  int64_t failed_seq() { return static_cast<int64_t>(shared_->failed_seq()); }
  void attach_recorder(std::shared_ptr<runtime::Recorder> rec);
  void abort(const std::string& why);
  void synchronize();  // every call enqueued so far done on the device; raises a failure
  // The first half of a two-phase close (Caps::two_phase_close): once our stream is idle, the
  // peers' memory is unmapped; false: this rank keeps mapping them (a CUDA graph pins them).
  bool unmap_peers();
  // Waits for the stream, then frees everything. peers_done: every rank stopped using ours.
  void close(bool peers_done);
  void watch_peers(const std::vector<std::pair<int, int>>& peers);  // (rank, pid)
  bool closed() const { return stream_ == nullptr; }
  uintptr_t stream_ptr() const { return reinterpret_cast<uintptr_t>(stream_); }
  int64_t op_seq() { return static_cast<int64_t>(transport().op_seq()); }
  int device() const { return device_; }
  size_t held_calls();
  void release_finished();  // drops the tensors of calls the device has finished

 private:
  using Tensors = std::unique_ptr<std::vector<at::Tensor>>;
  struct Held {  // the tensors of one call, held until its event on our stream completes
    cudaEvent_t done;
    Tensors tensors;
  };
  py::object run(const Call& c, const std::vector<at::Tensor>& tensors, bool async_op);
  py::object run_alone(const Call& c, bool async_op);  // world 1
  void check(const at::Tensor& t, const char* arg, Coll coll);  // on our device, contiguous
  Wire wire_of(Coll coll, int wire, const at::Tensor& t, int op, const char* arg);
  std::unique_lock<std::mutex> lock_calls();
  void follow(cudaStream_t s, cudaStream_t cur);
  void join(bool check);
  void pin_for_graph(cudaStream_t cur);
  std::unique_ptr<CudaWork> marker_locked();
  cudaEvent_t spare_event();
  void release_held(bool all);
  void collect_held(bool all, std::vector<Tensors>* out);
  cudaEvent_t hold(const std::vector<at::Tensor>& tensors, cudaStream_t stream, std::vector<Tensors>* finished);

  int nranks_ = 1;
  int device_ = 0;
  std::shared_ptr<Shared> shared_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  cudaEvent_t after_ = nullptr;  // recorded on tail_ after the last call that ran there
  cudaEvent_t link_ = nullptr;   // our stream's end, for a caller's stream to wait on
  cudaStream_t tail_ = nullptr;  // the caller's stream of the last call; nullptr: ours
  // Calls against close() and the stream bookkeeping (tail_). Nobody blocks on it while holding
  // the GIL (lock_calls; close, unmap_peers and synchronize release the GIL first), so a holder may
  // wait for the GIL (or run Python) without a deadlock.
  std::mutex call_mu_;
  std::atomic<bool> closing_{false};  // close() began: the fast path declines
  std::mutex held_mu_;                // held_ and spare_events_
  std::deque<Held> held_;
  std::vector<cudaEvent_t> spare_events_;
  std::shared_ptr<runtime::Recorder> rec_;
};

}  // namespace ringreduce::binding
#pragma GCC visibility pop
