#include "shm/segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

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

}  // namespace ringreduce::shm
