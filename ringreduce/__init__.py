"""ringreduce: ring all-reduce collectives for PyTorch.

    import torch.distributed as dist, ringreduce as rr
    rr.all_reduce(tensor)                       # in place, like dist.all_reduce
"""
import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed as _dist

from . import _C
from ._comm import Communicator, RingReduceError, Work, destroy, get_communicator
from .collectives import (SUPPORTED_DTYPES, all_gather_into_tensor, all_reduce,
                          reduce_scatter_tensor)
from . import ddp
from .bucketing import GradientBucketer

ReduceOp = _dist.ReduceOp
__version__ = "0.1.0"

__all__ = [
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "ReduceOp", "RingReduceError",
    "Communicator", "Work", "get_communicator", "destroy", "SUPPORTED_DTYPES",
    "ddp", "GradientBucketer",
]
