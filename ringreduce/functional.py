"""Out-of-place collectives that return new tensors, for compiled code and functional style:
shaped like torch.distributed._functional_collectives (gathers and scatters along dim 0).

    y = ringreduce.functional.all_reduce(x, op=ReduceOp.AVG)   # x untouched
"""
import torch
import torch.distributed as dist

from . import ops
from .collectives import _check_tensor, _op_code

ReduceOp = dist.ReduceOp


def all_reduce(tensor, op=ReduceOp.SUM, group=None):
    _check_tensor(tensor, "tensor", "functional.all_reduce")
    return torch.ops.ringreduce.all_reduce(tensor, _op_code(op, "functional.all_reduce"),
                                           ops.group_name(group))


def reduce_scatter_tensor(input, op=ReduceOp.SUM, group=None):
    """Rank r gets rows [r * d / N, (r + 1) * d / N) of the reduced input (d = input.shape[0])."""
    _check_tensor(input, "input", "functional.reduce_scatter_tensor")
    return torch.ops.ringreduce.reduce_scatter_tensor(
        input, _op_code(op, "functional.reduce_scatter_tensor"), ops.group_name(group))


def all_gather_into_tensor(input, group=None):
    """Every rank's input, concatenated along dim 0 in rank order."""
    _check_tensor(input, "input", "functional.all_gather_into_tensor")
    return torch.ops.ringreduce.all_gather_into_tensor(input, ops.group_name(group))
