// The areas (areas.h): allocation, IPC mapping, abort words, unmap and close.
#include "cuda/p2p/areas.h"

#include <cstddef>
#include <cstring>

#include "cuda/host.h"
#include "cuda/p2p/kept.h"

namespace ringreduce::cuda::p2p {

std::string device_bus_id() {
  int dev = 0;
  RR_CUDA_CHECK(cudaGetDevice(&dev));
  char id[32] = {};
  RR_CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof id, dev));
  return id;
}

bool can_map(const std::string& bus_id, std::string* why) {
  int dev = 0, other = -1, can = 0;
  RR_CUDA_CHECK(cudaGetDevice(&dev));
  if (cudaDeviceGetByPCIBusId(&other, bus_id.c_str()) != cudaSuccess) {
    cudaGetLastError();
    *why = "device " + bus_id + " is not visible to this process";
    return false;
  }
  if (other == dev) return true;
  RR_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, dev, other));
  if (!can) *why = "devices " + std::to_string(dev) + " and " + std::to_string(other) + " (" + bus_id +
                   ") have no peer access (cudaDeviceCanAccessPeer)";
  return can != 0;
}

void Areas::create(const AreaLayout& l) {
  bytes_ = l.bytes();
  RR_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
  at_.assign(nranks_, nullptr);
  void* p = nullptr;
  if (bytes_) {  // world 1: no device memory (a call is a copy at most)
    RR_CUDA_CHECK(cudaMalloc(&p, bytes_));
    own_ = static_cast<char*>(p);
    at_[rank_] = own_;
  }
  RR_CUDA_CHECK(cudaHostAlloc(&p, sizeof(uint32_t), cudaHostAllocPortable));
  abort_src_ = static_cast<uint32_t*>(p);
  *abort_src_ = 0;
  // Counters, flags and abort word start at zero, and so do the LL words (their flags: no call's
  // flag is 0); data needs no initialisation.
  if (own_) RR_CUDA_CHECK(cudaMemsetAsync(own_, 0, data_offset(), side_));
  if (own_ && l.ll_bytes()) RR_CUDA_CHECK(cudaMemsetAsync(own_ + l.ll_at(), 0, l.ll_bytes(), side_));
  RR_CUDA_CHECK(cudaStreamSynchronize(side_));
}

std::string Areas::handle() const {
  if (!own_) return "";  // world 1
  cudaIpcMemHandle_t h;
  RR_CUDA_CHECK(cudaIpcGetMemHandle(&h, own_));
  return std::string(reinterpret_cast<const char*>(&h), sizeof h);
}

void Areas::connect(const std::vector<std::string>& handles, int up, int down, bool every) {
  const int n = nranks_;
  if (static_cast<int>(handles.size()) != n)
    throw RingError("ringreduce: p2p bootstrap: " + std::to_string(handles.size()) +
                    " IPC handles for " + std::to_string(n) + " ranks");
  DeviceScope scope(device_);
  std::lock_guard<std::mutex> lk(mu_);
  ipc_ = true;
  for (int q = 0; q < n; ++q) {
    if (q == rank_) continue;
    const std::string& bytes = handles[q];
    if (bytes.empty()) {
      if (q == up || q == down || every)
        throw RingError("ringreduce: p2p bootstrap: no IPC handle of rank " + std::to_string(q) +
                        (every ? " (every rank's is needed: Options::direct)" : " (a neighbour)"));
      continue;
    }
    if (bytes.size() != sizeof(cudaIpcMemHandle_t))
      throw RingError("ringreduce: p2p bootstrap: IPC handles have the wrong size");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, bytes.data(), sizeof h);
    void* p = nullptr;
    // The lazy flag enables peer access when the peer's memory is on another device.
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw RingError(std::string("ringreduce: rank ") + std::to_string(rank_) +
                      ": cannot map the memory of rank " + std::to_string(q) +
                      " through CUDA IPC (" + cudaGetErrorString(e) +
                      "); the devices may not be peers: use RINGREDUCE_TRANSPORT=nccl");
    }
    at_[q] = static_cast<char*>(p);
  }
  direct_ = every;
}

void Areas::connect_local(const std::vector<const Areas*>& others, bool every) {
  std::lock_guard<std::mutex> lk(mu_);
  for (int q = 0; q < nranks_; ++q)
    if (q != rank_) at_[q] = others[q]->own_;
  direct_ = every;
}

void Areas::post_abort(uint32_t word) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!own_ || nranks_ < 2 || *abort_src_ != 0) return;
  *abort_src_ = word;
  DeviceScope scope(device_);
  for (char* area : at_)  // not awaited here (unmap and close synchronize)
    if (area)
      cudaMemcpyAsync(area + offsetof(Area, abort), abort_src_, sizeof(uint32_t), cudaMemcpyHostToDevice, side_);
  cudaGetLastError();
}

void Areas::unmap() {
  std::lock_guard<std::mutex> lk(mu_);
  DeviceScope scope(device_);
  if (side_) cudaStreamSynchronize(side_);  // abort words on their way into the peers' areas
  for (char*& p : at_) {
    if (ipc_ && p && p != own_) cudaIpcCloseMemHandle(p);
    if (p != own_) p = nullptr;
  }
  cudaGetLastError();
}

void Areas::close(bool keep, bool replayable) {
  std::lock_guard<std::mutex> lk(mu_);
  DeviceScope scope(device_);
  if (side_) cudaStreamSynchronize(side_);
  if (ipc_ && !replayable)
    for (char* p : at_)
      if (p && p != own_) cudaIpcCloseMemHandle(p);
  at_.clear();
  if (own_ && (keep || replayable))
    count_kept(bytes_);  // freed by the process's exit
  else if (own_)
    cudaFree(own_);
  own_ = nullptr;
  if (abort_src_ && !replayable) cudaFreeHost(abort_src_);
  abort_src_ = nullptr;
  if (side_) cudaStreamDestroy(side_);
  side_ = nullptr;
  cudaGetLastError();
}

}  // namespace ringreduce::cuda::p2p
