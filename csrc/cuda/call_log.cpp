#include "cuda/call_log.h"

#include "runtime/recorder.h"  // now_ns

namespace ringreduce::cuda {

CallLog::~CallLog() { close(); }

bool CallLog::start(cudaStream_t stream) {
  if (ref_) return true;
  // A reference point: an event recorded on an idle private stream completes at once; the host
  // reads the clock when it has. Later events' times are this plus their elapsed time.
  cudaStream_t s = nullptr;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) return false;
  bool ok = cudaEventCreate(&ref_) == cudaSuccess && cudaEventRecord(ref_, s) == cudaSuccess &&
            cudaEventSynchronize(ref_) == cudaSuccess;
  ref_ns_ = runtime::now_ns();
  cudaStreamDestroy(s);
  (void)stream;
  if (!ok && ref_) {
    cudaEventDestroy(ref_);
    ref_ = nullptr;
  }
  return ok;
}

namespace {
// The device and capture mode of a query from any thread (the signal's dump thread, a worker): on
// the events' device, so that no context is made on device 0, and relaxed, so that a query does not
// invalidate a CUDA graph another thread is capturing. Restored on exit.
struct QueryScope {
  int prev = -1;
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  explicit QueryScope(int device) {
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    if (prev != device) cudaSetDevice(device);
    cudaThreadExchangeStreamCaptureMode(&mode);
  }
  ~QueryScope() {
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (prev >= 0) cudaSetDevice(prev);
    cudaGetLastError();
  }
};
}  // namespace

void CallLog::record(uint64_t seq, cudaStream_t stream, bool captured) {
  if (captured || !enabled_.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lk(mu_);
  if (failed_) return;
  if (!ref_ && cudaGetDevice(&device_) != cudaSuccess) device_ = 0;
  if (!start(stream)) {
    failed_ = true;
    cudaGetLastError();
    return;
  }
  Slot& s = slots_[seq % kWindow];
  if (!s.ev && cudaEventCreate(&s.ev) != cudaSuccess) {
    s.ev = nullptr;
    failed_ = true;
    cudaGetLastError();
    return;
  }
  if (cudaEventRecord(s.ev, stream) != cudaSuccess) {
    s.seq = 0;
    failed_ = true;
    cudaGetLastError();
    return;
  }
  s.seq = seq;
}

CallLog::State CallLog::state(uint64_t seq, int64_t* done_ns) {
  std::lock_guard<std::mutex> lk(mu_);
  const Slot& s = slots_[seq % kWindow];
  if (seq == 0 || !s.ev || s.seq < seq) return State::Unknown;
  QueryScope scope(device_);
  if (s.seq > seq) {  // out of the window: done if the newer call in its slot is (stream order)
    const cudaError_t q = cudaEventQuery(s.ev);
    if (q != cudaSuccess && q != cudaErrorNotReady) cudaGetLastError();
    if (q != cudaSuccess) return State::Unknown;
    if (done_ns) *done_ns = 0;  // when is no longer known
    return State::Done;
  }
  const cudaError_t q = cudaEventQuery(s.ev);
  if (q == cudaErrorNotReady) return State::Pending;
  if (q != cudaSuccess) {
    cudaGetLastError();
    return State::Unknown;
  }
  float ms = 0;
  if (done_ns) {
    if (cudaEventElapsedTime(&ms, ref_, s.ev) == cudaSuccess)
      *done_ns = ref_ns_ + static_cast<int64_t>(static_cast<double>(ms) * 1e6);
    else
      *done_ns = 0, cudaGetLastError();
  }
  return State::Done;
}

void CallLog::close() {
  std::lock_guard<std::mutex> lk(mu_);
  for (Slot& s : slots_) {
    if (s.ev) cudaEventDestroy(s.ev);
    s = Slot();
  }
  if (ref_) cudaEventDestroy(ref_);
  ref_ = nullptr;
  failed_ = true;
}

}  // namespace ringreduce::cuda
