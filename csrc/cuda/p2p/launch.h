// The p2p transport's kernel launchers (ring_kernel.cu, sym_kernel.cu, sym_wire.cu), torch-free.
#pragma once
#include <cuda_runtime.h>

#include "cuda/p2p/layout.h"

namespace ringreduce::cuda::p2p {

// Launches the ring kernel with a.blocks blocks; torch-free (csrc/cuda/p2p/ring_kernel.cu).
void launch(const Args& a, cudaStream_t stream);
// Launches the symmetric workspace kernel of a.algo (OneShot, TwoShot, Registered, Imported; LL:
// launch_ll); torch-free (csrc/cuda/p2p/sym_kernel.cu).
void launch_sym(const SymArgs& a, cudaStream_t stream);
// The LL one-shot (a.algo LL; csrc/cuda/p2p/ll_kernel.cu): no barrier, flag-carrying words.
void launch_ll(const SymArgs& a, cudaStream_t stream);
// The narrow wire (a.wire set): the symmetric workspace kernel that rounds every rank's input
// onto the wire and folds in fp32 (csrc/cuda/p2p/sym_wire.cu); launch_sym calls it. At world 1 no
// workspace: launch_wire_local rounds the tensor as a group of one would (all_reduce twice,
// reduce_scatter once) into c.out; an fp16 overflow writes op_seq into *overflow_seq (memory the
// device writes and the host reads: HostCtl::wire_overflow).
void launch_sym_wire(const SymArgs& a, cudaStream_t stream);
void launch_wire_local(const Call& c, uint64_t* overflow_seq, uint64_t op_seq, cudaStream_t stream);
// The copy algorithm's kernel for one piece (checks the headers, then folds or copies), with
// `blocks` blocks that never wait.
void launch_copy(const Args& a, int blocks, cudaStream_t stream);

}  // namespace ringreduce::cuda::p2p
