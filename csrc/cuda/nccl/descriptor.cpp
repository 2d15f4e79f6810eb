#include "cuda/nccl/descriptor.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>

#include "cuda/host.h"

namespace ringreduce::cuda::nccl {
namespace {

constexpr uint32_t kDescMagic = 0x52524443;  // "RRDC"

std::string text(const Desc& x) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "%s(numel=%lld, dtype=%s, op=%s; %s)", coll_name(Coll(x.coll)),
                static_cast<long long>(x.numel), dtype_name(DType(x.dtype)), op_name(RedOp(x.op)),
                algo_name(Algo(x.algo)));
  return buf;
}

}  // namespace

Desc describe(const Call& c, uint64_t seq, Algo algo) {
  return Desc{seq, c.numel, static_cast<uint8_t>(c.coll), static_cast<uint8_t>(c.dtype),
              static_cast<uint8_t>(c.op), static_cast<uint8_t>(algo), kDescMagic, 0};
}

std::string mismatch(const Desc* d, int rank, const std::vector<int>& from) {
  const Desc& mine = d[rank];
  for (int q : from) {
    const Desc& o = d[q];
    if (o.magic == kDescMagic && o.op_seq == mine.op_seq && o.numel == mine.numel &&
        o.coll == mine.coll && o.dtype == mine.dtype && o.op == mine.op && o.algo == mine.algo)
      continue;
    if (o.magic != kDescMagic)
      return "ringreduce: rank " + std::to_string(rank) + ": call #" + std::to_string(mine.op_seq) +
             " on the nccl transport, " + text(mine) + ": rank " + std::to_string(q) +
             " sent data where its call descriptor was due (mismatched calls or algorithms; did "
             "every rank make the same call?)";
    return "ringreduce: mismatched collective calls: rank " + std::to_string(q) + " called " + text(o) +
           " as its call #" + std::to_string(o.op_seq) + " on this communicator, while rank " +
           std::to_string(rank) + " called " + text(mine) + " as its call #" +
           std::to_string(mine.op_seq);
  }
  return "";
}

int DescSlots::take() {
  if (free_.empty()) {
    const size_t per = static_cast<size_t>(nranks_) * sizeof(Desc);
    const size_t bytes = kPerChunk * per;
    void* dev = nullptr;
    void* host = nullptr;
    RR_CUDA_CHECK(cudaMalloc(&dev, bytes));
    const cudaError_t e = cudaHostAlloc(&host, bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) cudaFree(dev);
    RR_CUDA_CHECK(e);
    std::memset(host, 0, bytes);
    chunks_.push_back({dev, host});
    for (int i = 0; i < kPerChunk; ++i) {
      free_.push_back(static_cast<int>(slots_.size()));
      slots_.push_back({static_cast<char*>(dev) + i * per,
                        reinterpret_cast<Desc*>(static_cast<char*>(host) + i * per)});
    }
  }
  const int slot = free_.back();
  free_.pop_back();
  return slot;
}

void DescSlots::free_all() {
  for (auto& [dev, host] : chunks_) {
    cudaFree(dev);
    cudaFreeHost(host);
  }
  chunks_.clear();
  slots_.clear();
  free_.clear();
}

}  // namespace ringreduce::cuda::nccl
