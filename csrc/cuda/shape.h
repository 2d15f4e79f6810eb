// The shape every kernel of ours is launched with (threads per block, loads in flight): shared by
// the nccl transport's reduce kernels, the p2p kernels and the cost model. Torch-free, CUDA-free.
#pragma once

namespace ringreduce::cuda {

// Threads per block of every kernel of ours: 512 is what NCCL's simple protocol uses per channel and
// keeps 16-byte loads of a whole block in flight (512 x 16 B x unroll 4 = 32 KiB per round).
constexpr int kThreads = 512;
// 16-byte loads each thread has in flight in the data loops (cuda/reduce.cuh), for elements of 4 bytes:
// the ring's span_op loads kUnroll of both its inputs, span_fold (direct algorithms) kUnroll of two
// sources at a time (of one where it copies). By Little's law a block moves at most kThreads x
// loads x 16 B per load latency.
constexpr int kUnroll = 4;
constexpr int kRingLoadsInFlight = 2 * kUnroll;
constexpr int kFoldLoadsInFlight = 2 * kUnroll;

}  // namespace ringreduce::cuda
