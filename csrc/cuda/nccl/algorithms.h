// The schedules the nccl transport runs, as groups of NCCL sends and receives and our reduce
// kernels on the call's stream: the ring (ring/loop.h's primitives), and the direct halves that
// one-shot and two-shot are made of. They know nothing of NCCL's library, failures or calls in
// flight: the endpoint posts their groups.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <functional>
#include <vector>

#include "ring/call.h"

namespace ringreduce::cuda::nccl {

struct P2p {  // one ncclSend (send) or ncclRecv of a group
  bool send;
  const void* buf;
  size_t bytes;
  int peer;
};

// What a schedule needs of the endpoint: the rank's place, the staging (one allocation: the ring
// alternates the two buffers, the direct algorithms use the first 2 x staging_bytes as one region)
// and a way to post one group on the stream, settled before it returns.
struct Groups {
  int rank = 0, nranks = 1;
  char* staging[2] = {nullptr, nullptr};
  size_t staging_bytes = 0;
  std::function<void(const std::vector<P2p>&, cudaStream_t)> post;
  std::vector<P2p> ops;  // the group being built, kept to avoid an allocation per group
};

// Enqueues call c by algo (Ring, OneShot or TwoShot, as plan() chose) on stream; n >= 2, numel > 0.
void run_algo(Groups& g, const Call& c, Algo algo, cudaStream_t stream);

}  // namespace ringreduce::cuda::nccl
