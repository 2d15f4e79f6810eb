// csrc/cuda/hier/divide.cu compiled by the host compiler for the emulated device (tests only).
#include "cuda/hier/divide.cu"
