// Imported memory's link to torch (p2p::Endpoint::Hold): a reference to a tensor's storage keeps
// torch's caching allocator from freeing its block, and so the segment around it (the cudaMalloc
// allocation the peers map), until the endpoint drops it once every peer closed its mapping.
#pragma once
#include <memory>
#include <string>

#include "cuda/p2p/endpoint.h"

namespace ringreduce::binding {

// "" when torch's CUDA allocator is its native caching allocator, whose cudaMalloc'd segments
// CUDA IPC can share; else why imports are off (cudaMallocAsync's pools, a pluggable allocator).
std::string allocator_why_not();
// The hold on call c's input (Call::owner: the tensor's StorageImpl), or null and why it cannot
// be shared (not memory of torch's caching allocator). Endpoint::Holder.
std::unique_ptr<cuda::p2p::Endpoint::Hold> hold_storage(const Call& c, std::string* why);

}  // namespace ringreduce::binding
