"""Gradient bucketing for hand-written data-parallel loops (DDP's overlap without DDP).

    bucketer = GradientBucketer(model.parameters(), bucket_cap_mb=25.0)
    for x, y in data:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()   # buckets are all-reduced while backward runs
        bucketer.wait()                   # the rest; .grad now holds the average over the group
        optimizer.step()

How it works. Parameters are packed into buckets (one dtype and device per bucket) in the order
backward produces their gradients: at first in reverse registration order, then, after the first
synchronised step, in the order rank 0 observed (shared with every rank, so all ranks cut the same
buckets). The first bucket is capped at 1 MiB, like DDP's, so that communication starts early; the
others at bucket_cap_mb. A post-accumulate-grad hook marks a parameter ready; when every parameter
of a bucket is ready (and every earlier bucket is launched: all ranks must launch buckets in the
same order) the gradients are copied into the bucket's flat buffer and an async ring all-reduce
(AVG) is launched. wait() launches the buckets that are still open, waits for all of them, and
writes the averaged gradients back into each parameter's .grad. The buckets hold one extra copy of
the gradients (DDP's gradient_as_bucket_view avoids that copy; this class leaves .grad as ordinary
tensors). On the CPU with every rank on one host, and on CUDA devices whose p2p communicator maps
every rank's memory, the buffers are ringreduce.shared_empty tensors (allocated the first time each
bucket launches, in bucket order on every rank), whose all-reduce reads the peers' buffers in place
(on CUDA: and writes the result into them) instead of copying through shared or staging slots.

Parameters without a gradient. Each bucket carries one extra element per parameter, set to 1 on the
ranks where that parameter got a gradient in this step (or in a no_sync() step since the last
synchronisation) and averaged along with the gradients: it is > 0 exactly when some rank produced
one, which every rank thus learns at no extra collective:
  - some rank produced one: every rank's .grad becomes the group average, ranks without a gradient
    counting as zeros (a .grad left from earlier steps counts with its value, which keeps gradient
    accumulation across steps exact; call optimizer.zero_grad() between steps as usual). A .grad
    that was None is created. This is what DDP does with find_unused_parameters=True.
  - no rank produced one: .grad is left as it is (None stays None, so optimizers skip the
    parameter), identically on every rank.

no_sync(): within it, backward only accumulates into .grad (no communication) and wait() returns at
once; the first backward after it synchronises the accumulated gradients. A second synchronised
backward after a bucket was launched, without wait() between, raises: that gradient would be lost.
"""
import contextlib
import threading

import torch
import torch.distributed as dist

from ._lifecycle import traced_source
from . import _shm
from .collectives import (SUPPORTED_DTYPES, WIRE_BLOCK, WIRE_DTYPES, WIRE_TENSOR_DTYPES, _comm_for,
                          all_reduce, get_communicator,
                          shared_empty)

# DDP's first bucket size (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES): small, so that the first
# collective starts as soon as the last layer's gradients exist.
FIRST_BUCKET_BYTES = 1 << 20


class _Bucket:
    def __init__(self, device, dtype):
        self.device, self.dtype = device, dtype
        self.indices, self.offsets = [], []
        self.numel = 0
        self.ready = 0
        self.buffer = None  # [gradients..., one flag per parameter], allocated on first launch
        self.work = None

    def add(self, index, numel):
        self.indices.append(index)
        self.offsets.append(self.numel)
        self.numel += numel

    @property
    def nbytes(self):
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class GradientBucketer:
    """All-reduces the gradients of params in buckets while backward runs; wait() averages them
    into .grad. Create it with the same parameters, in the same order, on every rank of group."""

    def __init__(self, params, bucket_cap_mb=25.0, group=None, wire_dtype=None):
        """wire_dtype: as ringreduce.all_reduce's (torch.bfloat16, float16, float8_e4m3fn,
        float8_e5m2): every bucket is averaged with that type on the wire and an exact float32
        sum in rank order (float32, float16 and bfloat16 parameters)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("GradientBucketer: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group(...) first")
        if bucket_cap_mb <= 0:
            raise ValueError(f"GradientBucketer: bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        unique, seen = [], set()
        for p in params:
            if isinstance(p, dict):
                raise TypeError("GradientBucketer: pass tensors (e.g. model.parameters()), not "
                                "optimizer parameter groups")
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                unique.append(p)
        for p in unique:
            if not p.is_leaf:
                raise ValueError("GradientBucketer: every parameter must be a leaf tensor")
            if p.dtype not in SUPPORTED_DTYPES or not p.is_floating_point():
                raise TypeError(f"GradientBucketer: parameter dtype {p.dtype} is not supported; "
                                f"expected a floating dtype ringreduce reduces")
        if wire_dtype is not None:
            if wire_dtype not in WIRE_DTYPES:
                raise ValueError(f"GradientBucketer: wire_dtype must be None or one of "
                                 f"{', '.join(map(str, WIRE_DTYPES))}, got {wire_dtype!r}")
            for p in unique:
                if p.dtype not in WIRE_TENSOR_DTYPES:
                    names = ", ".join(str(d) for d in WIRE_TENSOR_DTYPES)
                    raise TypeError(f"GradientBucketer: wire_dtype={wire_dtype} takes {names} "
                                    f"parameters; one is {p.dtype}")
        self.wire_dtype = wire_dtype
        self.params = unique
        self.group = group
        self._pg = group if group is not None else dist.group.WORLD  # what the buffers belong to
        self.world_size = dist.get_world_size(self._pg)
        self.bucket_cap_bytes = int(bucket_cap_mb * (1 << 20))
        self._lock = threading.Lock()
        self._sync = True
        n = len(unique)
        self._fired = [False] * n      # got a gradient in this synchronised backward
        self._used = [False] * n       # got a gradient in a no_sync() backward since the last sync
        self._order = []               # firing order in the first synchronised step
        self._rebuilt = False
        self._shared = None            # CPU buffers from shared_empty (decided on first launch)
        self._cuda_share = {}          # CUDA device -> its buffers from shared_empty
        self._build(list(reversed(range(n))))
        self._handles = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                         for i, p in enumerate(unique)]

    # -- bucket assignment -------------------------------------------------------------------
    def _build(self, order):
        buckets, open_by_key, closed_by_key = [], {}, {}
        for i in order:
            p = self.params[i]
            key = (p.device, p.dtype)
            bucket = open_by_key.get(key)
            if bucket is None:
                bucket = open_by_key[key] = _Bucket(p.device, p.dtype)
                buckets.append(bucket)
            bucket.add(i, p.numel())
            first = closed_by_key.get(key, 0) == 0
            limit = self.bucket_cap_bytes
            if first:
                limit = min(FIRST_BUCKET_BYTES, limit)
            if bucket.nbytes >= limit:
                del open_by_key[key]
                closed_by_key[key] = closed_by_key.get(key, 0) + 1
        self.buckets = buckets
        self._bucket_of = {}
        for b in buckets:
            for i in b.indices:
                self._bucket_of[i] = b
        self._next = 0  # index of the next bucket to launch

    def _rebuild_from_rank0_order(self):
        """Re-cuts the buckets in the gradient order rank 0 saw (collective, once)."""
        n = len(self.params)
        seen = set(self._order)
        order = self._order + [i for i in reversed(range(n)) if i not in seen]
        device = self.params[0].device
        shared = torch.tensor(order, dtype=torch.int64, device=device)
        if dist.get_rank(self.group if self.group is not None else dist.group.WORLD) != 0:
            shared.zero_()
        with traced_source("bucketer"):
            all_reduce(shared, group=self.group)  # rank 0's order + zeros = rank 0's order
        order = shared.tolist()
        if order != [i for b in self.buckets for i in b.indices]:
            self._build(order)

    # -- hooks -------------------------------------------------------------------------------
    def _make_hook(self, i):
        def hook(param):
            self._on_grad(i)
        return hook

    def _on_grad(self, i):
        with self._lock:
            if not self._sync:
                self._used[i] = True
                return
            bucket = self._bucket_of[i]
            if self._fired[i]:
                if bucket.work is not None:
                    raise RuntimeError(
                        "GradientBucketer: a parameter got a second gradient after its bucket "
                        "was all-reduced; call wait() after each synchronised backward, and run "
                        "the other backward passes of a step inside no_sync()")
                return  # accumulated into .grad; the bucket reads .grad when it launches
            self._fired[i] = True
            if not self._rebuilt:
                self._order.append(i)
            bucket.ready += 1
            while self._next < len(self.buckets):
                b = self.buckets[self._next]
                if b.ready < len(b.indices):
                    break
                self._launch(b)

    def _follow_default_group(self):
        """After dist.shrink_group of the default group (group=None): the next buckets go to the
        new one, in buffers of its own (the old group's shared buffers went with it)."""
        if self.group is None and dist.group.WORLD is not self._pg:
            self._pg = dist.group.WORLD
            self.world_size = dist.get_world_size(self._pg)
            self._shared, self._cuda_share = None, {}
            for b in self.buckets:
                b.buffer = None

    def _launch(self, bucket):
        if self._next == 0:
            self._follow_default_group()
        if bucket.buffer is None:
            # With a wire the used-flags start a block of their own (WIRE_BLOCK elements): an
            # fp8 block's scale comes from its largest value, and a flag of 1 would coarsen the
            # gradients sharing its block.
            bucket.flags_at = bucket.numel if self.wire_dtype is None else \
                -(-bucket.numel // WIRE_BLOCK) * WIRE_BLOCK
            numel = bucket.flags_at + len(bucket.indices)
            if bucket.device.type == "cpu" and self._one_host():
                bucket.buffer = shared_empty(numel, dtype=bucket.dtype, group=self.group)
            elif bucket.device.type == "cuda" and self._cuda_shared(bucket.device):
                bucket.buffer = shared_empty(numel, dtype=bucket.dtype, group=self.group,
                                             device=bucket.device)
            else:
                bucket.buffer = torch.empty(numel, dtype=bucket.dtype, device=bucket.device)
        buf = bucket.buffer
        flags = []
        for i, off in zip(bucket.indices, bucket.offsets):
            p = self.params[i]
            view = buf[off:off + p.numel()].view(p.shape)
            g = p.grad
            if g is None:
                view.zero_()
            elif g.is_sparse:
                raise RuntimeError("GradientBucketer: sparse gradients are not supported")
            else:
                view.copy_(g)
            flags.append(1.0 if (self._fired[i] or self._used[i]) else 0.0)
        buf[bucket.numel:bucket.flags_at].zero_()
        buf[bucket.flags_at:].copy_(torch.tensor(flags, dtype=bucket.dtype))
        with traced_source("bucketer"):
            bucket.work = all_reduce(buf, op=dist.ReduceOp.AVG, group=self.group, async_op=True,
                                     wire_dtype=self.wire_dtype)
        self._next += 1

    def _one_host(self):
        """Whether the group's CPU communicator is the shared-memory ring (the same on every rank:
        the plan is decided collectively)."""
        if self._shared is None:
            g = self.group if self.group is not None else dist.group.WORLD
            comm = get_communicator(g)
            self._shared = isinstance(comm, _shm.Communicator) and comm.transport == "shm"
        return self._shared

    def _cuda_shared(self, device):
        """Whether the group's communicator on this CUDA device can make shared buffers (p2p,
        every rank mapping every other: decided collectively, so the same on every rank)."""
        if device not in self._cuda_share:
            g = self.group if self.group is not None else dist.group.WORLD
            comm = _comm_for(g, device, "GradientBucketer")
            self._cuda_share[device] = bool(comm is not None and getattr(comm, "can_share", None)
                                            and comm.can_share())
        return self._cuda_share[device]

    # -- public ------------------------------------------------------------------------------
    def wait(self):
        """Launches the buckets still open, waits for every bucket, and writes the averaged
        gradients into .grad. Call it on every rank after backward, before optimizer.step().
        Inside no_sync() it does nothing."""
        if not self._sync:
            return
        try:
            with self._lock:
                while self._next < len(self.buckets):
                    self._launch(self.buckets[self._next])
            for b in self.buckets:
                b.work.wait()
            for b in self.buckets:
                self._write_back(b)
        finally:
            with self._lock:
                for b in self.buckets:
                    if b.work is not None and not b.work.is_completed():
                        # After an error: the buffer must not be reused while the ring writes it.
                        with contextlib.suppress(Exception):
                            b.work.wait()
                    b.work, b.ready = None, 0
                self._next = 0
                self._fired = [False] * len(self.params)
                self._used = [False] * len(self.params)
        if not self._rebuilt and self.params:
            self._rebuilt = True
            self._rebuild_from_rank0_order()
            self._order = []

    def _write_back(self, bucket):
        buf = bucket.buffer
        used_anywhere = buf[bucket.flags_at:].tolist()  # fraction of ranks that produced a gradient
        for i, off, used in zip(bucket.indices, bucket.offsets, used_anywhere):
            if used <= 0:
                continue  # no rank produced a gradient: leave .grad as it is
            p = self.params[i]
            avg = buf[off:off + p.numel()].view(p.shape)
            if p.grad is None:
                p.grad = torch.empty_like(p).copy_(avg)
            else:
                p.grad.copy_(avg)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside only accumulate into .grad; the next one outside synchronises."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def remove(self):
        """Unregisters the hooks (waiting for any bucket still in flight). Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles = []
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None


__all__ = ["GradientBucketer", "FIRST_BUCKET_BYTES"]
