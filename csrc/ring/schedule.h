// Ring schedule: which chunk and slice each rank moves in each step. Pure arithmetic, header-only:
// no memory, threads or torch. Shared by the CPU shared-memory and the CUDA transports.
#pragma once
#include <algorithm>
#include <cstdint>

// Callable from CUDA kernels too (csrc/cuda/); plain inline functions elsewhere.
#ifdef __CUDACC__
#define RR_HOST_DEVICE __host__ __device__
#else
#define RR_HOST_DEVICE
#endif

namespace ringreduce::ring {

RR_HOST_DEVICE inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

struct Span {
  int64_t begin = 0;
  int64_t count = 0;
};

RR_HOST_DEVICE inline int mod(int64_t a, int n) { return static_cast<int>(((a % n) + n) % n); }

// Chunk c of numel elements cut into n chunks whose sizes differ by at most one element
// (the first numel % n chunks get the extra one). Any numel, including 0 and numel < n.
RR_HOST_DEVICE inline Span chunk(int64_t numel, int n, int c) {
  const int64_t base = numel / n, rem = numel % n;
  return {c * base + min64(c, rem), base + (c < rem ? 1 : 0)};
}

// Reduce-scatter: in step s (0..n-2) rank r sends chunk rs_send(r,s) to r+1 and reduces the chunk
// rs_recv(r,s) arriving from r-1. After n-1 steps rank r owns the reduced chunk r (so the output of
// reduce_scatter on rank r is chunk r, as torch.distributed defines it).
RR_HOST_DEVICE inline int rs_send_chunk(int r, int s, int n) { return mod(r - 1 - s, n); }
RR_HOST_DEVICE inline int rs_recv_chunk(int r, int s, int n) { return mod(r - 2 - s, n); }
// All-gather: in step t (0..n-2) rank r forwards chunk ag_send(r,t) and receives ag_recv(r,t).
RR_HOST_DEVICE inline int ag_send_chunk(int r, int t, int n) { return mod(r - t, n); }
RR_HOST_DEVICE inline int ag_recv_chunk(int r, int t, int n) { return mod(r - t - 1, n); }

// Chunks are cut into slices of at most slice_elems elements so that consecutive steps pipeline.
// Every chunk uses the same slice count (that of the largest chunk), so every rank sends the same
// number of messages per step; trailing slices of smaller chunks may be empty.
RR_HOST_DEVICE inline int64_t num_slices(int64_t max_chunk, int64_t slice_elems) {
  return max_chunk > slice_elems ? (max_chunk + slice_elems - 1) / slice_elems : 1;
}
RR_HOST_DEVICE inline Span slice(Span c, int64_t j, int64_t slice_elems) {
  const int64_t b = min64(c.count, j * slice_elems);
  const int64_t e = min64(c.count, (j + 1) * slice_elems);
  return {c.begin + b, e - b};
}

// Parallel rings (channels): channel k of nch works on part k of every chunk.
RR_HOST_DEVICE inline Span channel_part(Span c, int nch, int k) {
  const Span p = chunk(c.count, nch, k);
  return {c.begin + p.begin, p.count};
}

}  // namespace ringreduce::ring
