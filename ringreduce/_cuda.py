"""CUDA transports: p2p (our ring kernel over CUDA IPC) and nccl (our ring over NCCL send/recv).

Python owns policy and lifetime, as in _comm.py: the transport choice (logged with its reason), the
bootstrap through the default store, the cache of communicators, and close(). Stream semantics are
those of torch.distributed with NCCL: a collective runs on the communicator's stream after the work
already on the caller's current stream; a sync call makes the caller's stream wait for it (the host
does not wait); async_op=True returns a Work whose wait() makes the current stream wait.

Failures inside a running collective (a timeout, mismatched calls, an abort) are recorded by the
device (p2p) or the watchdog (nccl) and raised as RingReduceError by the next call on the
communicator, by Work.wait() once known, and by Work.synchronize() / Communicator.synchronize(),
which block the host. After one the communicator is unusable but can be closed.
"""
import atexit
import datetime
import logging
import os
import socket
import sysconfig
import threading
import time

import torch
import torch.distributed as dist

from . import _C
from ._comm import _env_int, default_timeout

log = logging.getLogger("ringreduce")
RingReduceError = _C.RingReduceError

# p2p knobs (see csrc/cuda/p2p.h for where the defaults come from). RINGREDUCE_CUDA_SLICE_BYTES is
# also the test-only knob: a tiny value (e.g. 256) forces many pipeline steps per chunk.
DEFAULT_CHANNELS = 16
DEFAULT_SLICE_BYTES = 128 << 10
# nccl staging buffer (bytes, two of them); see csrc/cuda/nccl_ring.h.
DEFAULT_STAGING_BYTES = 16 << 20
# How long close() waits for the other ranks to stop using this rank's memory.
CLOSE_BARRIER_S = 30.0

_setup_counters = {}
_comms = {}
_comms_lock = threading.Lock()


def _require_cuda():
    if not getattr(_C, "cuda_compiled", False):
        raise RuntimeError("ringreduce: this build has no CUDA support (built against a CPU-only "
                           "torch or without a CUDA toolkit; see RINGREDUCE_CUDA in setup.py)")


def _nccl_lib():
    """Path of the libnccl.so.2 shipped with torch (nvidia-nccl-cu13), tried if none is loaded."""
    path = os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "nccl", "lib", "libnccl.so.2")
    return path if os.path.exists(path) else ""


def _host_id():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class _Setup:
    """Store keys of one communicator's bootstrap, bounded by the timeout."""

    def __init__(self, group, ranks, timeout, what):
        self.store = dist.distributed_c10d._get_default_store()
        n = _setup_counters.get((ranks, what), 0)
        _setup_counters[(ranks, what)] = n + 1
        self.prefix = "ringreduce/%s/%s/%d" % (what, "-".join(map(str, ranks)), n)
        self.timeout = timeout
        self.rank = dist.get_rank(group)

    def set(self, name, value):
        self.store.set(f"{self.prefix}/{name}", value)

    def get(self, name, waiting_for):
        key = f"{self.prefix}/{name}"
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # the store's own timeout error
            raise RingReduceError(
                f"ringreduce: rank {self.rank}: communicator setup timed out after "
                f"{self.timeout:g} s waiting for {waiting_for} ({e})") from None
        return self.store.get(key)

    def count(self, name, world, limit):
        """Adds this rank to a counter and waits (up to limit seconds) for world ranks; True if all."""
        key = f"{self.prefix}/{name}"
        joined = self.store.add(key, 1)
        deadline = time.monotonic() + limit
        while joined < world and time.monotonic() < deadline:
            time.sleep(0.001)
            joined = self.store.add(key, 0)
        return joined >= world


def choose_transport(group, requested):
    """p2p when every rank of group is on this host, else nccl; RINGREDUCE_TRANSPORT overrides."""
    if requested == "shm":
        raise ValueError("RINGREDUCE_TRANSPORT=shm cannot move CUDA tensors; use auto, p2p or nccl")
    if requested in ("p2p", "nccl"):
        log.debug("transport %s: set by RINGREDUCE_TRANSPORT", requested)
        return requested
    ranks = tuple(dist.get_process_group_ranks(group))
    world, rank = len(ranks), dist.get_rank(group)
    setup = _Setup(group, ranks, default_timeout(), "hosts")
    setup.set(f"host/{rank}", _host_id())
    hosts = [setup.get(f"host/{r}", f"rank {r}'s host name").decode() for r in range(world)]
    if len(set(hosts)) == 1:
        log.debug("transport p2p: all %d ranks of group %s are on host %s", world, ranks,
                  hosts[0].split("/")[0])
        return "p2p"
    log.debug("transport nccl: the %d ranks of group %s are on %d hosts", world, ranks,
              len(set(hosts)))
    return "nccl"


class Communicator:
    """A ring over the ranks of one process group, moving tensors on one CUDA device."""

    def __init__(self, group, device, transport, timeout=None):
        _require_cuda()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ringreduce: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group(...) first")
        self.group = group if group is not None else dist.group.WORLD
        self.device = torch.device("cuda", device.index if device.index is not None else
                                   torch.cuda.current_device())
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout = float(timeout) if timeout is not None else default_timeout()
        self.transport = transport
        self._closed = False
        self._lock = threading.Lock()  # calls from several threads enqueue one at a time
        self._setup = _Setup(self.group, tuple(dist.get_process_group_ranks(self.group)),
                             self.timeout, "cuda-" + transport)
        self._native = self._bootstrap_p2p() if transport == "p2p" else self._bootstrap_nccl()
        self._stream = torch.cuda.ExternalStream(self._native.stream_ptr(), device=self.device)

    def _bootstrap_p2p(self):
        channels = _env_int("RINGREDUCE_CUDA_CHANNELS", DEFAULT_CHANNELS)
        slice_bytes = _env_int("RINGREDUCE_CUDA_SLICE_BYTES", DEFAULT_SLICE_BYTES)
        native = _C.P2pComm(self.device.index, self.rank, self.world_size, channels, slice_bytes,
                            self.timeout)
        try:
            config = f"{channels}/{slice_bytes}".encode()
            setup, n, r = self._setup, self.world_size, self.rank
            setup.set(f"config/{r}", config)
            setup.set(f"handle/{r}", native.handle())
            for peer in range(n):
                theirs = setup.get(f"config/{peer}", f"rank {peer} to create its buffers")
                if theirs != config:
                    raise ValueError(
                        f"ringreduce: rank {r} has p2p channels/slice_bytes {config.decode()} but "
                        f"rank {peer} has {theirs.decode()}; set RINGREDUCE_CUDA_CHANNELS and "
                        f"RINGREDUCE_CUDA_SLICE_BYTES alike on every rank")
            up, down = (r - 1) % n, (r + 1) % n
            native.connect(setup.get(f"handle/{up}", f"rank {up}'s IPC handle"),
                           setup.get(f"handle/{down}", f"rank {down}'s IPC handle"))
        except BaseException:
            native.close()
            raise
        log.debug("rank %d/%d: p2p ring ready on %s (%d channels, slice %d B, timeout %g s)",
                  self.rank, self.world_size, self.device, channels, slice_bytes, self.timeout)
        return native

    def _bootstrap_nccl(self):
        lib = _nccl_lib()
        staging = _env_int("RINGREDUCE_NCCL_STAGING_BYTES", DEFAULT_STAGING_BYTES)
        if self.rank == 0:
            self._setup.set("id", _C.nccl_unique_id(lib))
        uid = self._setup.get("id", "rank 0 of the group to create the NCCL id")
        native = _C.NcclComm(self.device.index, self.rank, self.world_size, self.timeout, staging,
                             lib, uid)
        log.debug("rank %d/%d: nccl ring ready on %s (NCCL %d, staging %d B, timeout %g s)",
                  self.rank, self.world_size, self.device, _C.nccl_version(lib), staging,
                  self.timeout)
        return native

    # -- collectives (arguments already checked by ringreduce.collectives) --------------------
    def _check_open(self):
        if self._closed:
            raise RingReduceError("ringreduce: communicator is closed")

    def all_reduce(self, tensor, op_code, async_op):
        with self._lock:
            return self._all_reduce(tensor, op_code, async_op)

    def reduce_scatter(self, output, input, op_code, async_op):
        with self._lock:
            return self._reduce_scatter(output, input, op_code, async_op)

    def all_gather(self, output, input, async_op):
        with self._lock:
            return self._all_gather(output, input, async_op)

    def _all_reduce(self, tensor, op_code, async_op):
        self._check_open()
        if tensor.is_contiguous():
            return self._wrap(self._native.all_reduce(tensor, op_code, async_op), [tensor])
        buf = tensor.contiguous()  # reduce a contiguous copy, then write back through the view
        work = self._native.all_reduce(buf, op_code, async_op)
        return self._copy_back(work, buf, tensor)

    def _reduce_scatter(self, output, input, op_code, async_op):
        self._check_open()
        src = input.contiguous()
        dst = output if output.is_contiguous() else torch.empty_like(
            output, memory_format=torch.contiguous_format)
        work = self._native.reduce_scatter(dst, src, op_code, async_op)
        return self._copy_back(work, dst, output) if dst is not output else self._wrap(work, [output])

    def _all_gather(self, output, input, async_op):
        self._check_open()
        src = input.contiguous()
        dst = output if output.is_contiguous() else torch.empty_like(
            output, memory_format=torch.contiguous_format)
        work = self._native.all_gather(dst, src, async_op)
        return self._copy_back(work, dst, output) if dst is not output else self._wrap(work, [output])

    def _copy_back(self, work, buf, target):
        if work is None:  # the current stream already waits for the collective
            target.copy_(buf)
            return None
        # async: the copy runs on our stream after the collective; the Work waits for the copy.
        with torch.cuda.stream(self._stream):
            target.copy_(buf)
        buf.record_stream(self._stream)
        target.record_stream(self._stream)
        return self._wrap(self._native.marker(), [target])

    def _wrap(self, native_work, result):
        return None if native_work is None else Work(self, native_work, result)

    # -- lifetime ----------------------------------------------------------------------------
    @property
    def broken(self):
        return bool(self._native.failure())

    def synchronize(self):
        """Blocks until every collective enqueued so far is done; raises the first failure."""
        self._check_open()
        self._native.synchronize()

    def abort(self, reason="aborted by the user"):
        """Stops this rank's collectives; the neighbours stop when they next wait on this rank."""
        self._native.abort(f"rank {self.rank}: {reason}")

    def close(self):
        """Waits for the collectives in flight (each ends by its deadline), waits (bounded) until
        every rank has done so, so nobody reads memory being freed, then frees. Idempotent."""
        if getattr(self, "_native", None) is None:
            # __init__ failed before the bootstrap finished (the bootstrap freed what it made):
            # nothing to free, and no barrier, which would stall __del__ for CLOSE_BARRIER_S.
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._native.synchronize()
        except Exception:  # a failure was already raised, or will not matter any more
            pass
        try:
            limit = min(self.timeout, CLOSE_BARRIER_S)
            if not self._setup.count("closed", self.world_size, limit):
                log.debug("rank %d: closing without every rank of the group (%g s)", self.rank,
                          limit)
        except Exception:  # the store is gone (process group destroyed first): just free
            pass
        self._native.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Work:
    """Handle of an async call, shaped like torch.distributed's Work."""

    def __init__(self, comm, native, result):
        self._comm = comm
        self._native = native
        self._result = result
        self._fut = None

    def wait(self, timeout=None):
        """Makes the current stream wait for the collective; raises a failure already known."""
        self._native.wait()
        return True

    def synchronize(self):
        """Blocks the host until the collective is done; raises its failure."""
        self._native.synchronize()

    def is_completed(self):
        return self._native.is_completed()

    def is_success(self):
        return self.is_completed() and not self._comm._native.failure()

    def exception(self):
        why = self._comm._native.failure() if self.is_completed() else ""
        return RingReduceError(why) if why else None

    def get_future(self):
        """A torch.futures.Future on the device: its value is ready for work on the stream that
        waits on it (fut.wait(), .then callbacks), as with ProcessGroupNCCL's futures."""
        if self._fut is None:
            fut = torch.futures.Future(devices=[self._comm.device])
            with torch.cuda.device(self._comm.device), torch.cuda.stream(self._comm._stream):
                fut.set_result(self._result)  # records an event on our stream
            self._fut = fut
        return self._fut


def get_communicator(group, device, transport="auto", **options):
    """The cached communicator of (group, device, transport), created on first use (collective)."""
    _require_cuda()
    g = group if group is not None else dist.group.WORLD
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (id(g), index, transport)
    with _comms_lock:
        entry = _comms.get(key)
        if entry is not None and entry[0] is g and not entry[1]._closed:
            return entry[1]
    chosen = choose_transport(g, transport)
    comm = Communicator(g, torch.device("cuda", index), chosen, **options)
    with _comms_lock:
        _comms[key] = (g, comm)
    return comm


def destroy(group=None):
    """Closes the CUDA communicators of group (None: the default group); idempotent."""
    g = group if group is not None else dist.group.WORLD
    with _comms_lock:
        keys = [k for k, (grp, _) in _comms.items() if grp is g]
        entries = [_comms.pop(k) for k in keys]
    for _, comm in entries:
        comm.close()


def destroy_all():
    with _comms_lock:
        entries = list(_comms.values())
        _comms.clear()
    for _, comm in entries:
        comm.close()


atexit.register(destroy_all)
