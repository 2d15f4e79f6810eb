// csrc/cuda/p2p/sym_wire.cu compiled by the host compiler for the emulated device (tests only).
#include "cuda/p2p/sym_wire.cu"
