// csrc/cuda/reduce.cu compiled by the host compiler for the emulated device (tests only).
#include "cuda/reduce.cu"
