// csrc/cuda/sym_kernel.cu compiled by the host compiler for the emulated device (tests only).
#include "cuda/sym_kernel.cu"
