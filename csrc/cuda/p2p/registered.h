// Registered buffers (ringreduce.shared_empty on CUDA), a part of the p2p endpoint: every rank
// allocates the same buffers in the same order and maps every other rank's copy through CUDA IPC,
// so an all_reduce of a tensor in one reads the peers' copies in place. Its own state and lock (a
// buffer may be registered on one thread while another runs calls); it calls no other part.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/p2p/plan.h"

namespace ringreduce::cuda::p2p {

class Registered {
 public:
  Registered(int rank, int nranks, int device) : rank_(rank), nranks_(nranks), device_(device) {}
  Registered(const Registered&) = delete;
  Registered& operator=(const Registered&) = delete;

  // A new buffer of `bytes` on this device: its index, and (handle) its IPC handle.
  int alloc(size_t bytes, std::string* handle);
  // Maps every other rank's copy of buffer id (handles by rank, this rank's ignored).
  void connect(int id, const std::vector<std::string>& handles);
  // Native tests only: ranks as streams of one process, the others' buffers used directly.
  void connect_local(int id, const std::vector<const Registered*>& others);
  std::shared_ptr<char> memory(int id) const;
  int count() const;
  // This rank's tensor of buffer id is gone: no plan picks it again; the peers' copies are unmapped
  // unless a CUDA graph may replay a launch on them (replayable); this rank's copy is kept until
  // exit where a graph or a broken ring's peer may still write into it (keep).
  void release(int id, bool replayable, bool keep);
  // Where a tensor of `bytes` at p lies: in which mapped buffer, at which offset (Memory::reg -1:
  // in none).
  Memory find(const void* p, size_t bytes) const;
  // Every rank's address of byte `offset` of buffer id, by rank.
  void addresses(int id, uint64_t offset, char** out) const;
  // The first half of a two-phase close: every peer's copy unmapped; calls use none any more.
  void unmap();
  // Unmaps (unless replayable) and lets go of every buffer; this rank's copies then live as long as
  // a tensor holds them, or until exit where kept (keep: a peer or a graph may still touch them).
  void close(bool replayable, bool keep);

 private:
  struct Buffer {
    size_t bytes = 0;
    std::shared_ptr<char> own;  // cudaFree when the last owner (this part, a tensor) lets go
    std::vector<char*> at;      // every rank's copy by rank (own included); null: not mapped yet
    bool mapped = false;        // every at[] is set: calls may use it
    bool ipc = false;           // at[] are IPC mappings (closed at unmap)
    bool kept = false;          // own is kept until exit (counted once)
  };
  void keep_locked(Buffer& g);
  void unmap_locked(Buffer& g);

  const int rank_, nranks_, device_;
  mutable std::mutex mu_;
  std::vector<Buffer> bufs_;
};

}  // namespace ringreduce::cuda::p2p
