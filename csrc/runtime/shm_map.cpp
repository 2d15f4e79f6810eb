#include "runtime/shm_map.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "ring/call.h"  // RingError

namespace ringreduce::runtime {
namespace {

std::string sys_error(const std::string& what, const std::string& name) {
  return "ringreduce: " + what + " of shared memory '" + name + "' failed: " + std::strerror(errno);
}

// Maps fd and closes it (the mapping keeps the memory).
char* map_fd(int fd, const std::string& name, uint64_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int err = errno;
  ::close(fd);
  errno = err;
  if (p == MAP_FAILED) throw RingError(sys_error("map", name));
  return static_cast<char*>(p);
}

}  // namespace

char* shm_create(const std::string& name, uint64_t bytes) {
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

char* shm_map(const std::string& name, uint64_t* bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) throw RingError(sys_error("open", name));
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    const std::string err = sys_error("stat", name);
    ::close(fd);
    throw RingError(err);
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (*bytes != 0 && size != *bytes) {
    ::close(fd);
    throw RingError("ringreduce: shared buffer '" + name + "' holds " + std::to_string(size) +
                    " bytes; expected " + std::to_string(*bytes));
  }
  *bytes = size;
  return map_fd(fd, name, size);
}

void shm_unmap(char* base, uint64_t bytes) {
  if (base) ::munmap(base, bytes);
}

void shm_unlink(const std::string& name) { ::shm_unlink(name.c_str()); }

}  // namespace ringreduce::runtime
