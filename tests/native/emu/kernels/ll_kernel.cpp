// csrc/cuda/p2p/ll_kernel.cu compiled by the host compiler for the emulated device (tests only).
#include "cuda/p2p/ll_kernel.cu"
