// A POSIX shared-memory mapping that holds one ring, and the ring running on it. Torch-free.
#pragma once
#include <memory>
#include <string>

#include "shm/protocol.h"

namespace ringreduce::shm {

class Comm {
 public:
  // create=true: make the named segment (it must not exist), size and initialise it.
  // create=false: map the segment another rank made.
  Comm(const std::string& name, bool create, const Options& opt, size_t slice_bytes);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  Ring& ring();
  // Unmaps; idempotent. The ring must not be running.
  void close();
  bool closed() const { return base_ == nullptr; }

  // Removes the name (the memory lives on while mapped). Missing names are fine.
  static void unlink(const std::string& name);

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
  std::unique_ptr<Ring> ring_;
};

}  // namespace ringreduce::shm
