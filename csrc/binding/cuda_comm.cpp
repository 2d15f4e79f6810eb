// The CUDA communicator's non-template parts (cuda_comm.h): the stream free list, failures.
#include "binding/cuda_comm.h"

namespace ringreduce::binding {

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

void raise_if(Failure& f) {
  const std::string why = f.failure();
  if (!why.empty()) throw rr::RingError(why);
}

}  // namespace ringreduce::binding
