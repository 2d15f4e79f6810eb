// csrc/cuda/nccl/reduce.cu compiled by the host compiler for the emulated device (tests only).
#include "cuda/nccl/reduce.cu"
