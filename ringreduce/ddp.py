"""DDP communication hooks that reduce gradient buckets over the ringreduce ring.

    import ringreduce as rr
    ddp_model.register_comm_hook(None, rr.ddp.allreduce_hook)       # or a process group as state

Shaped like torch.distributed.algorithms.ddp_comm_hooks.default_hooks: the state is the process
group (None: the default group); each hook averages the bucket over the group and returns a
torch.futures.Future whose value is a tensor with the bucket's shape. The collective is launched
asynchronously (it runs on the communicator's worker thread, or the CUDA path's stream), so it
overlaps the rest of backward. The same hooks serve CPU and CUDA buckets.

Copies: DDP's bucket is DDP's own tensor, which no peer maps, so its all-reduce moves through the
transport's staging slots (on CUDA p2p: one copy of the data into the peers' direct buffers or ring
FIFOs, one-shot, two-shot or ring). ringreduce.GradientBucketer's buckets are shared_empty tensors
where the transport allows (CPU on one host; CUDA p2p with every rank mapping every other), whose
all-reduce reads and writes the peers' buckets directly: the copy that remains there is gradients
into the bucket and back, as with DDP without gradient_as_bucket_view.
"""
import torch
import torch.distributed as dist

from ._lifecycle import traced_source
from .collectives import all_reduce


def _group_size(process_group):
    group = process_group if process_group is not None else dist.group.WORLD
    return dist.get_world_size(group)


def _done_future(value):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def allreduce_hook(process_group, bucket):
    """Averages the bucket with a ring all-reduce: DDP's own results, up to float rounding."""
    buffer = bucket.buffer()
    if buffer.dtype == torch.float16:
        # Divide first (as DDP does): a float16 partial sum can overflow where the average does not.
        buffer.div_(_group_size(process_group))
        op = dist.ReduceOp.SUM
    else:
        # AVG: the ring divides each finished chunk while it is still in cache, which saves a pass
        # over the bucket (float32, float64 and bfloat16 have range enough for the sum).
        op = dist.ReduceOp.AVG
    with traced_source("ddp_hook"):
        work = all_reduce(buffer, op=op, group=process_group, async_op=True)
    if work is None:  # this rank is not in process_group
        return _done_future(buffer)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compress_hook(dtype, process_group, bucket):
    buffer = bucket.buffer()
    # Divide before the sum (as torch's hooks do) so that partial sums stay in float16's range;
    # one pass that divides in the bucket's precision and rounds once to the wire dtype.
    compressed = torch.empty(buffer.shape, dtype=dtype, device=buffer.device)
    torch.div(buffer, _group_size(process_group), out=compressed)
    with traced_source("ddp_hook"):
        work = all_reduce(compressed, group=process_group, async_op=True)
    if work is None:
        return _done_future(buffer)

    def decompress(fut):
        # Back into the bucket's own buffer: no second full-precision copy of the bucket.
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def fp16_compress_hook(process_group, bucket):
    """Averages the bucket as float16 on the wire (the ring accumulates each step in float32)
    and writes the result back into the bucket in its own dtype. Gradients whose average
    exceeds the float16 range (65504) become inf; use bf16_compress_hook for those."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket):
    """Like fp16_compress_hook with bfloat16 on the wire: float32's range, 8 bits of mantissa."""
    return _compress_hook(torch.bfloat16, process_group, bucket)


__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]
