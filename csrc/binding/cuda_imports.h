// Imported memory's link to torch (p2p::Endpoint::set_finder, forget): which allocation of the
// caching allocator holds a tensor, and the allocator's frees reported to every p2p communicator
// on the device before its memory goes.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

namespace ringreduce::binding {

struct Shared;

// The caching allocator's segment holding p (base, bytes), or false and why it cannot be shared:
// not the caching allocator's memory, or an expandable segment (no CUDA IPC handle).
bool caching_allocator_segment(const void* p, uintptr_t* base, size_t* bytes, std::string* why);
// From now on the allocator's segment frees on `device` reach this communicator's p2p endpoint
// (Endpoint::forget) while it lives. The allocator's trace tracker is attached once per process.
void report_frees(const std::weak_ptr<Shared>& shared, int device);

}  // namespace ringreduce::binding
