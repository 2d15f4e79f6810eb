// Named POSIX shared memory mapped into this process: the shared-memory transport's segments and
// shared buffers, and the CUDA copy algorithm's counters. Torch-free; errors are RingError.
#pragma once
#include <cstdint>
#include <string>

namespace ringreduce::runtime {

// Creates (O_EXCL), sizes and maps a segment of bytes; on failure nothing is left behind. The
// caller unlinks the name once the peers mapped it.
char* shm_create(const std::string& name, uint64_t bytes);
// Maps a segment another process made. *bytes != 0: it must be that long; 0: any length, which is
// returned in *bytes. No descriptor stays open.
char* shm_map(const std::string& name, uint64_t* bytes);
void shm_unmap(char* base, uint64_t bytes);  // null: nothing
void shm_unlink(const std::string& name);   // a missing name is fine

}  // namespace ringreduce::runtime
