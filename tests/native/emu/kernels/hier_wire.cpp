// csrc/cuda/hier/wire.cu compiled by the host compiler for the emulated device (tests only).
#include "cuda/hier/wire.cu"
