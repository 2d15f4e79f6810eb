#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>

namespace ringreduce::shm {
namespace {

std::string sys_error(const std::string& what, const std::string& name) {
  return "ringreduce: " + what + " of shared memory '" + name + "' failed: " + std::strerror(errno);
}

}  // namespace

Comm::Comm(const std::string& name, bool create, const Options& opt, size_t slice_bytes) {
  const int fd = create ? ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                        : ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw RingError(sys_error(create ? "create" : "open", name));
  if (create) {
    bytes_ = segment_bytes(opt.nranks, slice_bytes);
    if (::ftruncate(fd, static_cast<off_t>(bytes_)) != 0) {
      const std::string err = sys_error("resize", name);
      ::close(fd);
      ::shm_unlink(name.c_str());
      throw RingError(err);
    }
  } else {
    struct stat st{};
    if (::fstat(fd, &st) != 0) {
      const std::string err = sys_error("stat", name);
      ::close(fd);
      throw RingError(err);
    }
    bytes_ = static_cast<size_t>(st.st_size);
  }
  base_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the memory; no descriptor stays open
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    const std::string err = sys_error("map", name);
    if (create) ::shm_unlink(name.c_str());
    throw RingError(err);
  }
  try {
    if (create) init_segment(base_, opt.nranks, slice_bytes);
    ring_ = std::make_unique<Ring>(base_, bytes_, opt);
  } catch (...) {
    close();
    throw;
  }
}

Comm::~Comm() { close(); }

Ring& Comm::ring() {
  if (!ring_) throw RingError("ringreduce: communicator is closed");
  return *ring_;
}

void Comm::close() {
  ring_.reset();
  if (base_) ::munmap(base_, bytes_);
  base_ = nullptr;
}

void Comm::unlink(const std::string& name) { ::shm_unlink(name.c_str()); }

namespace {
char* map_fd(int fd, const std::string& name, uint64_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  errno = err;
  if (p == MAP_FAILED) throw RingError(sys_error("map", name));
  return static_cast<char*>(p);
}

// Never destroyed: a tensor freed during exit, after static destructors, still finds them.
std::mutex& pool_mu = *new std::mutex;
std::map<uintptr_t, std::shared_ptr<PoolBuffer>>& pool_bufs =  // by the owner's copy
    *new std::map<uintptr_t, std::shared_ptr<PoolBuffer>>;
std::atomic<int> pool_live{0};
}  // namespace

char* pool_create(const std::string& name, uint64_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw RingError(sys_error("create", name));
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    const std::string err = sys_error("resize", name);
    ::close(fd);
    ::shm_unlink(name.c_str());
    throw RingError(err);
  }
  try {
    return map_fd(fd, name, bytes);
  } catch (...) {
    ::shm_unlink(name.c_str());
    throw;
  }
}

char* pool_map(const std::string& name, uint64_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw RingError(sys_error("open", name));
  struct stat st{};
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != bytes) {
    const std::string got = std::to_string(static_cast<long long>(st.st_size));
    ::close(fd);
    throw RingError("ringreduce: shared buffer '" + name + "' holds " + got + " bytes; expected " +
                    std::to_string(bytes));
  }
  return map_fd(fd, name, bytes);
}

void pool_unmap(char* base, uint64_t bytes) {
  if (base) ::munmap(base, bytes);
}

PoolBuffer::~PoolBuffer() {
  for (char* b : bases) pool_unmap(b, bytes);
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
