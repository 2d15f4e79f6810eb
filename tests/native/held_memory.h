// Imported memory's holds (p2p::Endpoint::Hold) in torch-free tests, with memory as torch's caching
// allocator hands it out: an allocation made by alloc() is freed when the last of its owners lets
// go, the test's handle or an endpoint's hold on it, as a tensor's block is when the last
// reference to its storage goes. Memory the test allocated elsewhere gets a hold that is always in
// use (the test frees it after closing the group).
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda/host.h"
#include "cuda/p2p/endpoint.h"

class HeldMemory {
 public:
  // A new allocation on the current device: the test's handle.
  std::shared_ptr<char> alloc(size_t bytes) {
    void* p = nullptr;
    RR_CUDA_CHECK(cudaMalloc(&p, bytes));
    int dev = 0;
    RR_CUDA_CHECK(cudaGetDevice(&dev));
    std::shared_ptr<std::atomic<int>> freed = freed_;
    std::shared_ptr<char> mem(static_cast<char*>(p), [dev, freed](char* q) {
      ringreduce::cuda::DeviceScope scope(dev);
      cudaFree(q);
      freed->fetch_add(1);
    });
    std::lock_guard<std::mutex> lk(s_->mu);
    s_->entries.push_back(Entry{reinterpret_cast<uintptr_t>(p), bytes, mem});
    return mem;
  }
  // Allocations alloc() made that have been freed so far.
  int freed() const { return freed_->load(); }
  ringreduce::cuda::p2p::Endpoint::Holder holder() const {
    std::shared_ptr<State> s = s_;
    return [s](const ringreduce::Call& c, std::string*) -> std::unique_ptr<ringreduce::cuda::p2p::Endpoint::Hold> {
      const uintptr_t p = reinterpret_cast<uintptr_t>(c.in);
      std::lock_guard<std::mutex> lk(s->mu);
      for (const Entry& e : s->entries)
        if (p >= e.base && p < e.base + e.bytes)
          if (std::shared_ptr<char> m = e.mem.lock()) return std::make_unique<Owned>(std::move(m));
      return std::make_unique<Pinned>(c.in);
    };
  }

 private:
  struct Owned : ringreduce::cuda::p2p::Endpoint::Hold {
    explicit Owned(std::shared_ptr<char> m) : mem(std::move(m)) {}
    bool in_use() const override { return mem.use_count() > 1; }
    const void* key() const override { return mem.get(); }
    std::shared_ptr<char> mem;
  };
  struct Pinned : ringreduce::cuda::p2p::Endpoint::Hold {
    explicit Pinned(const void* p) : at(p) {}
    bool in_use() const override { return true; }
    const void* key() const override { return at; }
    const void* at;
  };
  struct Entry {
    uintptr_t base;
    size_t bytes;
    std::weak_ptr<char> mem;
  };
  struct State {
    std::mutex mu;
    std::vector<Entry> entries;
  };
  std::shared_ptr<State> s_ = std::make_shared<State>();
  std::shared_ptr<std::atomic<int>> freed_ = std::make_shared<std::atomic<int>>(0);
};
