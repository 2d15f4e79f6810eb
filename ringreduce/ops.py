"""Kernels of the registered operators torch.ops.ringreduce.* (schemas: csrc/binding/ops.cpp).

CPU and CUDA kernels run the collective on the calling thread, as a synchronous rr.* call does;
fake kernels give torch.compile / torch.export the outputs' shapes. rr.all_reduce and friends
call these operators whenever they are being traced (torch.compile, torch.export, a fake or
functional tensor) and call the same implementation directly in eager mode, where the dispatcher
would add ~12 us per call (world 1, 4 KiB: 17 us direct, 30 us through torch.ops). ringreduce.functional holds the out-of-place forms.
"""
import torch
import torch.distributed as dist

from ._lifecycle import traced_source
from .collectives import _comm_for, group_name, traced  # noqa: F401  (ops.group_name, ops.traced)

_lib = torch.library.Library("ringreduce", "IMPL")
_groups = {}


def resolve(name):
    """The process group of a name (cached: the name of a live group does not change)."""
    g = _groups.get(name)
    if g is None:
        g = _groups[name] = dist.distributed_c10d._resolve_process_group(name)
    return g


def world_size(name):
    return resolve(name).size()


def _comm(group, device, fn):
    return _comm_for(resolve(group), device, fn)


# -- real kernels (CPU and CUDA) -------------------------------------------------------------
def _all_reduce_(tensor, op, group, wire=0):
    comm = _comm(group, tensor.device, "all_reduce")
    if comm is not None:
        with traced_source("op"):
            comm.all_reduce(tensor, op, False, wire)


def _all_reduce(tensor, op, group):
    out = tensor.clone(memory_format=torch.contiguous_format)
    _all_reduce_(out, op, group)
    return out


def _reduce_scatter_tensor_(output, input, op, group, wire=0):
    comm = _comm(group, input.device, "reduce_scatter_tensor")
    if comm is not None:
        with traced_source("op"):
            comm.reduce_scatter(output, input, op, False, wire)


def _reduce_scatter_tensor(input, op, group):
    output = input.new_empty(_scattered_shape(input, world_size(group)))
    _reduce_scatter_tensor_(output, input, op, group)
    return output


def _all_gather_into_tensor_(output, input, group):
    comm = _comm(group, input.device, "all_gather_into_tensor")
    if comm is not None:
        with traced_source("op"):
            comm.all_gather(output, input, False)


def _all_gather_into_tensor(input, group):
    output = input.new_empty(_gathered_shape(input, world_size(group)))
    _all_gather_into_tensor_(output, input, group)
    return output


# -- shapes (as torch's functional collectives: along dim 0) ---------------------------------------
def _scattered_shape(input, n):
    if input.dim() == 0 or input.shape[0] % n:
        raise ValueError(f"ringreduce.functional.reduce_scatter_tensor: input's first dimension "
                         f"({tuple(input.shape)}) must be a multiple of the world size {n}")
    return (input.shape[0] // n, *input.shape[1:])


def _gathered_shape(input, n):
    return (n,) if input.dim() == 0 else (input.shape[0] * n, *input.shape[1:])


for _key in ("CPU", "CUDA"):
    _lib.impl("all_reduce_", _all_reduce_, _key)
    _lib.impl("all_reduce", _all_reduce, _key)
    _lib.impl("reduce_scatter_tensor_", _reduce_scatter_tensor_, _key)
    _lib.impl("reduce_scatter_tensor", _reduce_scatter_tensor, _key)
    _lib.impl("all_gather_into_tensor_", _all_gather_into_tensor_, _key)
    _lib.impl("all_gather_into_tensor", _all_gather_into_tensor, _key)


# -- fake kernels --------------------------------------------------------------------------------
@torch.library.register_fake("ringreduce::all_reduce_", lib=_lib)
def _(tensor, op, group, wire=0):
    return None


@torch.library.register_fake("ringreduce::all_reduce", lib=_lib)
def _(tensor, op, group):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


@torch.library.register_fake("ringreduce::reduce_scatter_tensor_", lib=_lib)
def _(output, input, op, group, wire=0):
    return None


@torch.library.register_fake("ringreduce::reduce_scatter_tensor", lib=_lib)
def _(input, op, group):
    return input.new_empty(_scattered_shape(input, world_size(group)))


@torch.library.register_fake("ringreduce::all_gather_into_tensor_", lib=_lib)
def _(output, input, group):
    return None


@torch.library.register_fake("ringreduce::all_gather_into_tensor", lib=_lib)
def _(input, group):
    return input.new_empty(_gathered_shape(input, world_size(group)))
