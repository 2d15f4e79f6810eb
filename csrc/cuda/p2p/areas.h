// The areas, a part of the p2p endpoint: this rank's area (cudaMalloc; where each part lies:
// area_layout.h) and every peer's mapped through CUDA IPC, and the side stream and pinned word by
// which an abort reaches every mapped area beside a kernel that may be spinning. Its own lock (a
// watcher's abort writes into the mappings while another thread unmaps them); it calls no other
// part.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/p2p/area_layout.h"

namespace ringreduce::cuda::p2p {

// The transport choice: PCI bus id of the current device ("0000:17:00.0"), and whether the current
// device can map memory of the device with that bus id through CUDA IPC (the same device, or a peer
// in cudaDeviceCanAccessPeer's sense); why: the reason when it cannot.
std::string device_bus_id();
bool can_map(const std::string& bus_id, std::string* why);

class Areas {
 public:
  Areas(int rank, int nranks, int device) : rank_(rank), nranks_(nranks), device_(device) {}
  ~Areas() { close(false, false); }
  Areas(const Areas&) = delete;
  Areas& operator=(const Areas&) = delete;

  // Allocates this rank's area (none at world 1) with its header and LL slots zeroed, the side
  // stream and the abort word's source.
  void create(const AreaLayout& l);
  char* own() const { return own_; }
  // Every rank's area by rank (own included; null: not mapped). Read by the thread that runs calls,
  // which no unmap or close runs beside.
  const std::vector<char*>& all() const { return at_; }
  cudaStream_t side() const { return side_; }
  // This rank's area as cudaIpcMemHandle_t bytes ("" at world 1).
  std::string handle() const;
  // Maps the other ranks' areas: the neighbours' (up, down) are required; with every=true every
  // rank's. direct() afterwards: every rank's is mapped.
  void connect(const std::vector<std::string>& handles, int up, int down, bool every);
  // Native tests only: ranks as streams of one process, the others' areas used directly.
  void connect_local(const std::vector<const Areas*>& others, bool every);
  bool direct() const { return direct_; }
  // The abort word into every mapped area (its own included), once, on the side stream.
  void post_abort(uint32_t word);
  // The first half of a two-phase close: the abort words landed, the peers' areas unmapped.
  void unmap();
  // Unmaps the peers (unless replayable) and frees this rank's area, or keeps it until exit where
  // a peer (keep) or a graph's replay (replayable) may still touch it.
  void close(bool keep, bool replayable);

 private:
  const int rank_, nranks_, device_;
  size_t bytes_ = 0;
  std::mutex mu_;
  char* own_ = nullptr;             // own area (cudaMalloc)
  std::vector<char*> at_;           // every rank's area by rank
  bool ipc_ = false;                // at_ are IPC mappings (closed at unmap)
  bool direct_ = false;
  cudaStream_t side_ = nullptr;     // for the abort words, beside a kernel that may be spinning
  uint32_t* abort_src_ = nullptr;   // pinned source of the abort word copied into the areas
};

}  // namespace ringreduce::cuda::p2p
