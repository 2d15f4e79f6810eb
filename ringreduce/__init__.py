"""ringreduce: ring all-reduce collectives for PyTorch.

    import torch.distributed as dist, ringreduce as rr
    rr.all_reduce(tensor)                       # in place, like dist.all_reduce
"""
import os as _os

import torch  # noqa: F401  (loads libtorch before the extension)
import torch.distributed as _dist

# The CUDA ring kernels spin until the other ranks' kernels run. Streams beyond
# CUDA_DEVICE_MAX_CONNECTIONS (CUDA's default: 8) share hardware queues, where a spinning kernel
# holds up the kernels queued behind it: two communicators in one process could then wait on each
# other until their timeout. CUDA reads the variable when it starts, so raise it to CUDA's maximum
# now if CUDA has not started and the user has not chosen (ringreduce._cuda warns otherwise).
if "CUDA_DEVICE_MAX_CONNECTIONS" not in _os.environ and not torch.cuda.is_initialized():
    _os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "32"

from . import _C
from ._shm import Communicator
from ._lifecycle import RingReduceError, Work, dump_trace
from .collectives import (SUPPORTED_DTYPES, all_gather_into_tensor, all_reduce, destroy,
                          get_communicator, is_deterministic, reduce_scatter_tensor,
                          set_deterministic, shared_empty)
from . import _lifecycle
from . import backend as _backend
from . import ddp, functional, nn, ops
from .bucketing import GradientBucketer
from ._shrink import lost_ranks, shrink_group

_backend.register()  # dist.init_process_group("ringreduce") from now on


def _read_environment():
    """Reads again what the import read from the environment (RINGREDUCE_DETERMINISTIC,
    RINGREDUCE_DEBUG): for a process forked after the import with another environment, as the
    tests' prefork server does."""
    from .collectives import _deterministic_from_env
    set_deterministic(_deterministic_from_env())
    _lifecycle.debug_log_from_env()
_lifecycle.install_trace_signal()  # RINGREDUCE_TRACE_SIGNAL=1: SIGUSR1 dumps the flight recorders

ReduceOp = _dist.ReduceOp
__version__ = "0.1.0"

__all__ = [
    "all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "ReduceOp", "RingReduceError",
    "Communicator", "Work", "get_communicator", "destroy", "SUPPORTED_DTYPES",
    "ddp", "GradientBucketer", "functional", "nn", "dump_trace", "set_deterministic",
    "is_deterministic", "shared_empty", "lost_ranks", "shrink_group",
]
