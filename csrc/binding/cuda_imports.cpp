// See cuda_imports.h. The trace tracker runs under the allocator's lock (and maybe with the GIL
// held by the thread that freed): it takes only our registry's mutex and the endpoint's.
#include "binding/cuda_imports.h"

#include <c10/cuda/CUDACachingAllocator.h>

#include <mutex>
#include <utility>
#include <vector>

#include "binding/cuda_comm.h"
#include "cuda/p2p/endpoint.h"

namespace ringreduce::binding {
namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;

struct Watched {
  std::weak_ptr<Shared> shared;
  int device;
};
std::mutex g_mu;
std::vector<Watched>* g_watched = new std::vector<Watched>;  // never freed: the tracker outlives exit

void on_trace(const alloc::TraceEntry& e) {
  if (e.action_ != alloc::TraceEntry::SEGMENT_FREE) return;  // (before the cudaFree)
  std::lock_guard<std::mutex> lk(g_mu);
  for (auto it = g_watched->begin(); it != g_watched->end();) {
    std::shared_ptr<Shared> s = it->shared.lock();
    if (!s) {
      it = g_watched->erase(it);
      continue;
    }
    if (it->device == e.device_ && s->t)
      if (auto* ep = dynamic_cast<cuda::p2p::Endpoint*>(s->t.get())) ep->forget(e.addr_, e.size_);
    ++it;
  }
}

}  // namespace

bool caching_allocator_segment(const void* p, uintptr_t* base, size_t* bytes, std::string* why) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  try {
    const alloc::SnapshotInfo snap = alloc::snapshot();
    for (const auto& seg : snap.segments) {
      if (a < seg.address || a >= seg.address + seg.total_size) continue;
      if (seg.is_expandable) {
        *why = "it lies in an expandable segment (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), "
               "which CUDA IPC cannot share";
        return false;
      }
      *base = seg.address;
      *bytes = seg.total_size;
      return true;
    }
  } catch (const std::exception& ex) {
    *why = std::string("torch's CUDA allocator gives no segments (") + ex.what() + ")";
    return false;
  }
  *why = "it is not memory of torch's caching allocator (from_blob, DLPack or another allocator), "
         "whose frees ringreduce would not see";
  return false;
}

void report_frees(const std::weak_ptr<Shared>& shared, int device) {
  static std::once_flag attached;
  std::call_once(attached, [] { alloc::attachAllocatorTraceTracker(&on_trace); });
  std::lock_guard<std::mutex> lk(g_mu);
  g_watched->push_back(Watched{shared, device});
}

}  // namespace ringreduce::binding
