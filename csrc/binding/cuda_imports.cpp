// See cuda_imports.h. Nothing here waits or takes a lock: in_use() is an atomic load, and the
// endpoint drops a hold (maybe freeing torch's block) outside its own locks.
#include "binding/cuda_imports.h"

#include <c10/core/Storage.h>
#include <c10/cuda/CUDACachingAllocator.h>

#include <utility>

namespace ringreduce::binding {
namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;

class StorageHold final : public cuda::p2p::Endpoint::Hold {
 public:
  explicit StorageHold(c10::Storage s) : s_(std::move(s)) {}
  // Ours is one reference; a tensor (or a view, or a Python storage object) is another.
  bool in_use() const override { return s_.use_count() > 1; }
  const void* key() const override { return s_.unsafeGetStorageImpl(); }

 private:
  c10::Storage s_;
};

}  // namespace

std::string allocator_why_not() {
  alloc::CUDAAllocator* a = alloc::get();
  const std::string name = a ? a->name() : "none";
  if (name == "native") return "";
  return "torch's CUDA allocator is " + name + " (PYTORCH_CUDA_ALLOC_CONF backend or a pluggable "
         "allocator), not the native caching allocator whose cudaMalloc'd segments CUDA IPC shares";
}

std::unique_ptr<cuda::p2p::Endpoint::Hold> hold_storage(const Call& c, std::string* why) {
  auto* impl = static_cast<c10::StorageImpl*>(const_cast<void*>(c.owner));
  if (!impl) {
    *why = "the call names no tensor storage";
    return nullptr;
  }
  c10::Storage s(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(impl));
  if (s.allocator() != alloc::get()) {
    *why = "it is not memory of torch's caching allocator (from_blob, DLPack or another allocator), "
           "which ringreduce cannot keep allocated while the peers map it";
    return nullptr;
  }
  return std::make_unique<StorageHold>(std::move(s));
}

}  // namespace ringreduce::binding
