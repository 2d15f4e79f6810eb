// Device memory kept until the process exits, because a peer or a CUDA graph may still touch it
// (freeing it could hand it to another allocation they would then write into): counted, for tests
// and logs. Shared by the parts that keep memory (areas, registered buffers).
#pragma once
#include <atomic>
#include <cstddef>

namespace ringreduce::cuda::p2p {

inline std::atomic<size_t>& kept_counter() {
  static std::atomic<size_t> bytes{0};
  return bytes;
}
inline void count_kept(size_t bytes) { kept_counter() += bytes; }

}  // namespace ringreduce::cuda::p2p
