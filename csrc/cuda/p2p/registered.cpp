// Registered buffers (registered.h): allocation, IPC mapping, release and close.
#include "cuda/p2p/registered.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "cuda/host.h"
#include "cuda/p2p/kept.h"

namespace ringreduce::cuda::p2p {

int Registered::alloc(size_t bytes, std::string* handle) {
  DeviceScope scope(device_);
  void* p = nullptr;
  RR_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 1)));
  const int dev = device_;
  Buffer g;
  g.bytes = bytes;
  g.own = std::shared_ptr<char>(static_cast<char*>(p), [dev](char* q) {
    DeviceScope s(dev);
    cudaFree(q);  // at exit the runtime may be gone: nothing to report then
    cudaGetLastError();
  });
  g.at.assign(nranks_, nullptr);
  g.at[rank_] = g.own.get();
  g.mapped = nranks_ == 1;
  cudaIpcMemHandle_t h;
  RR_CUDA_CHECK(cudaIpcGetMemHandle(&h, p));
  handle->assign(reinterpret_cast<const char*>(&h), sizeof h);
  std::lock_guard<std::mutex> lk(mu_);
  bufs_.push_back(std::move(g));
  return static_cast<int>(bufs_.size()) - 1;
}

void Registered::connect(int id, const std::vector<std::string>& handles) {
  std::lock_guard<std::mutex> lk(mu_);
  if (id < 0 || id >= static_cast<int>(bufs_.size()))
    throw std::invalid_argument("ringreduce: no shared buffer " + std::to_string(id));
  Buffer& g = bufs_[id];
  if (static_cast<int>(handles.size()) != nranks_)
    throw RingError("ringreduce: shared buffer: " + std::to_string(handles.size()) +
                    " IPC handles for " + std::to_string(nranks_) + " ranks");
  DeviceScope scope(device_);
  g.ipc = true;  // from here an unmap closes what is mapped
  for (int q = 0; q < nranks_; ++q) {
    if (q == rank_) continue;
    if (handles[q].size() != sizeof(cudaIpcMemHandle_t))
      throw RingError("ringreduce: shared buffer: rank " + std::to_string(q) + "'s IPC handle has the wrong size");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[q].data(), sizeof h);
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw RingError("ringreduce: rank " + std::to_string(rank_) + ": cannot map rank " +
                      std::to_string(q) + "'s shared buffer through CUDA IPC (" + cudaGetErrorString(e) + ")");
    }
    g.at[q] = static_cast<char*>(p);
  }
  g.mapped = true;
}

void Registered::connect_local(int id, const std::vector<const Registered*>& others) {
  std::lock_guard<std::mutex> lk(mu_);
  Buffer& g = bufs_.at(id);
  for (int q = 0; q < nranks_; ++q)
    if (q != rank_) g.at[q] = others[q]->memory(id).get();
  g.mapped = true;
}

std::shared_ptr<char> Registered::memory(int id) const {
  std::lock_guard<std::mutex> lk(mu_);
  return bufs_.at(id).own;
}

int Registered::count() const {
  std::lock_guard<std::mutex> lk(mu_);
  return static_cast<int>(bufs_.size());
}

Memory Registered::find(const void* p, size_t bytes) const {
  const char* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lk(mu_);
  for (size_t k = 0; k < bufs_.size(); ++k) {
    const Buffer& g = bufs_[k];
    const char* base = g.own.get();
    if (g.mapped && c >= base && c + bytes <= base + g.bytes) {
      Memory m;
      m.reg = static_cast<int>(k);
      m.reg_offset = static_cast<uint64_t>(c - base);
      return m;
    }
  }
  return {};
}

void Registered::addresses(int id, uint64_t offset, char** out) const {
  std::lock_guard<std::mutex> lk(mu_);
  const Buffer& g = bufs_.at(id);
  for (int q = 0; q < nranks_; ++q) out[q] = g.at[q] + offset;
}

void Registered::keep_locked(Buffer& g) {
  if (g.kept) return;
  g.kept = true;
  new std::shared_ptr<char>(g.own);  // never deleted: freed by the process's exit
  count_kept(g.bytes);
}

void Registered::unmap_locked(Buffer& g) {
  if (g.ipc)
    for (char* p : g.at)
      if (p && p != g.own.get()) cudaIpcCloseMemHandle(p);
  g.at.clear();
  g.mapped = false;
}

void Registered::release(int id, bool replayable, bool keep) {
  std::lock_guard<std::mutex> lk(mu_);
  if (id < 0 || id >= static_cast<int>(bufs_.size()) || !bufs_[id].own) return;
  Buffer& g = bufs_[id];
  g.mapped = false;  // no plan picks it again
  if (replayable || keep) keep_locked(g);
  // The peers' copies are unmapped here; this rank's own copy is not freed before close: a peer may
  // still map it (its tensor alive), and freeing memory another process maps is undefined in CUDA.
  // The close frees it after every rank unmapped (unmap_peers, a barrier).
  if (!replayable) {
    DeviceScope scope(device_);
    unmap_locked(g);
  }
}

void Registered::unmap() {
  std::lock_guard<std::mutex> lk(mu_);
  DeviceScope scope(device_);
  for (Buffer& g : bufs_) unmap_locked(g);
}

void Registered::close(bool replayable, bool keep) {
  std::lock_guard<std::mutex> lk(mu_);
  DeviceScope scope(device_);
  for (Buffer& g : bufs_) {
    if (!g.own) continue;  // released
    if (keep || replayable) keep_locked(g);  // a release under a graph pin kept it already
    if (!replayable) unmap_locked(g);
  }
  bufs_.clear();
}

}  // namespace ringreduce::cuda::p2p
