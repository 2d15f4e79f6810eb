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

from . import _C
from ._lifecycle import traced_source
from .collectives import _WIRE_CODES, all_reduce


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


class WireState:
    """State for the wire hooks: the process group and, with error_feedback, what rounding lost.

    With error feedback each rank adds to a gradient, before sending it, what rounding onto the
    wire took from the same parameter's gradient at the previous step (as 1-bit Adam and PowerSGD
    do): nothing a rank contributes is lost for good, only delayed. The residuals are this rank's
    own and are kept per parameter (DDP reorders its buckets after the first step, and again in a
    restarted job): pass params (the model's parameters, in a fixed order) and save state_dict()
    per rank with the checkpoint; load_state_dict() on resume."""

    def __init__(self, process_group=None, error_feedback=False, params=None):
        self.process_group = process_group
        self.error_feedback = bool(error_feedback)
        self.params = list(params) if params is not None else None
        self.residuals = {}  # id(parameter) -> tensor shaped like its gradient

    def _index(self):
        if self.params is None:
            raise ValueError("WireState.state_dict/load_state_dict: pass params= (the model's "
                             "parameters) so that residuals are saved by position")
        return self.params

    def state_dict(self):
        params = self._index()
        return {"error_feedback": self.error_feedback,
                "residuals": {i: self.residuals[id(p)].detach().clone()
                              for i, p in enumerate(params) if id(p) in self.residuals}}

    def load_state_dict(self, state):
        params = self._index()
        self.error_feedback = bool(state["error_feedback"])
        self.residuals = {id(params[int(i)]): v.clone() for i, v in state["residuals"].items()}


def _feed_back(ef, wire, bucket, buffer):
    """Adds each parameter's residual to its slice of the bucket, then keeps what the wire will
    lose of the result (the rounding of exactly the bytes the call sends: blocks from the bucket's
    start, as all_reduce cuts them)."""
    offset = 0
    for p in bucket.parameters():
        n = p.numel()
        res = ef.residuals.get(id(p))
        if res is not None and res.numel() == n and res.dtype == buffer.dtype:
            buffer[offset:offset + n].add_(res.view(-1))
        offset += n
    code = next(c for d, c in _WIRE_CODES if d == wire)
    sent = torch.empty_like(buffer)
    _C.wire_round(sent, buffer, code)
    lost = buffer - sent
    offset = 0
    for p in bucket.parameters():
        n = p.numel()
        ef.residuals[id(p)] = lost[offset:offset + n].view(p.shape)
        offset += n


def _wire_hook(wire, state, bucket):
    group, ef = (state.process_group, state) if isinstance(state, WireState) else (state, None)
    buffer = bucket.buffer()
    if ef is not None and ef.error_feedback:
        _feed_back(ef, wire, bucket, buffer)
    with traced_source("ddp_hook"):
        # AVG: the float32 sum in rank order, divided once, rounded once for the gather.
        work = all_reduce(buffer, op=dist.ReduceOp.AVG, group=group, async_op=True, wire_dtype=wire)
    if work is None:
        return _done_future(buffer)
    return work.get_future().then(lambda fut: fut.value()[0])


def bf16_wire_hook(state, bucket):
    """Averages the bucket with bfloat16 on the wire and an exact float32 sum: each rank's gradient
    rounded to bfloat16 once, summed in float32 in rank order, the average rounded once more (two
    roundings at any world size; torch's bf16_compress_hook rounds at every step of the ring).
    state: a process group (or None), or a WireState for error feedback. CPU tensors on one host."""
    return _wire_hook(torch.bfloat16, state, bucket)


def fp8_wire_hook(state, bucket):
    """Like bf16_wire_hook with float8_e4m3fn on the wire (one float32 scale per 128 elements): a
    quarter of the float32 bytes. Pass WireState(group, error_feedback=True) to carry what each
    rank's rounding lost into its next step."""
    return _wire_hook(torch.float8_e4m3fn, state, bucket)


__all__ = ["allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "bf16_wire_hook",
           "fp8_wire_hook", "WireState"]
