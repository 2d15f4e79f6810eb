// csrc/cuda/sym_wire.cu compiled by the host compiler for the emulated device (tests only).
#include "cuda/sym_wire.cu"
