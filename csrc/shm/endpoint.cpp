#include "shm/endpoint.h"

#include <atomic>
#include <map>
#include <mutex>

#include "runtime/shm_map.h"

namespace ringreduce::shm {

Endpoint::Endpoint(const std::string& name, bool create, const Options& opt, size_t slice_bytes) {
  uint64_t bytes = create ? segment_bytes(opt.nranks, slice_bytes) : 0;
  base_ = create ? runtime::shm_create(name, bytes) : runtime::shm_map(name, &bytes);
  bytes_ = bytes;
  try {
    if (create) init_segment(base_, opt.nranks, slice_bytes);
    ring_ = std::make_unique<Protocol>(base_, bytes_, opt);
  } catch (...) {
    close();
    throw;
  }
}

Endpoint::~Endpoint() { close(); }

Protocol& Endpoint::protocol() {
  if (!ring_) throw closed_error();
  return *ring_;
}

void Endpoint::close() {
  ring_.reset();
  runtime::shm_unmap(static_cast<char*>(base_), bytes_);
  base_ = nullptr;
}


namespace {
// Never destroyed: a tensor freed during exit, after static destructors, still finds them.
std::mutex& pool_mu = *new std::mutex;
std::map<uintptr_t, std::shared_ptr<PoolBuffer>>& pool_bufs =  // by the owner's copy
    *new std::map<uintptr_t, std::shared_ptr<PoolBuffer>>;
std::atomic<int> pool_live{0};
}  // namespace

PoolBuffer::~PoolBuffer() {
  for (char* b : bases) runtime::shm_unmap(b, bytes);
}

void pool_register(const std::shared_ptr<PoolBuffer>& b) {
  std::lock_guard<std::mutex> lk(pool_mu);
  pool_bufs[reinterpret_cast<uintptr_t>(b->bases[b->rank])] = b;
  pool_live.store(static_cast<int>(pool_bufs.size()));
}

void pool_unregister(const PoolBuffer* b) {
  std::lock_guard<std::mutex> lk(pool_mu);
  auto it = pool_bufs.find(reinterpret_cast<uintptr_t>(b->bases[b->rank]));
  if (it != pool_bufs.end() && it->second.get() == b) pool_bufs.erase(it);
  pool_live.store(static_cast<int>(pool_bufs.size()));
}

std::shared_ptr<PoolBuffer> pool_find(uint64_t owner, const void* p, uint64_t bytes) {
  if (pool_live.load(std::memory_order_relaxed) == 0) return nullptr;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> lk(pool_mu);
  auto it = pool_bufs.upper_bound(a);
  if (it == pool_bufs.begin()) return nullptr;
  --it;
  const PoolBuffer& b = *it->second;
  if (b.owner != owner || a - it->first > b.bytes || bytes > b.bytes - (a - it->first)) return nullptr;
  return it->second;
}

}  // namespace ringreduce::shm
