#include "shm/segment.h"

#include <new>

namespace ringreduce {
namespace shm {

void init_segment(void* base, int nranks, size_t slice_bytes) {
  auto* hdr = new (base) GroupHeader();
  hdr->nranks = nranks;
  hdr->slice_bytes = slice_bytes;
  hdr->abort.store(0);
  hdr->reason_ready.store(0);
  RankArea* areas = areas_of(base);
  for (int r = 0; r < nranks; ++r) new (&areas[r]) RankArea();
  std::atomic_thread_fence(std::memory_order_seq_cst);
  hdr->magic = kMagic;
}

}  // namespace shm
}  // namespace ringreduce
