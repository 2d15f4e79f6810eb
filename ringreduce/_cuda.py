"""CUDA transports (p2p over CUDA IPC, nccl send/recv). Placeholder until the CUDA path lands."""
from . import _C


def get_communicator(group, device, transport):
    if not getattr(_C, "cuda_compiled", False):
        raise RuntimeError("ringreduce: this build has no CUDA support (built against a CPU-only "
                           "torch or without a CUDA toolkit; see RINGREDUCE_CUDA in setup.py)")
    raise RuntimeError("ringreduce: CUDA tensors are not supported yet")
