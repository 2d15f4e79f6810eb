"""The shared-memory transport: a ring over POSIX shared memory between the CPU processes of one host.

The group is used only to bootstrap (rank 0 creates the segment and publishes its name through the
group's store); then data moves through the native ring. Caching, the worker thread that runs async
calls in order, and close() are the lifecycle every transport shares (_lifecycle.py). Which CPU
communicator a group gets (this ring on one host, _hier/'s across hosts) is chosen a layer up
(collectives.cpu_communicator).
"""
import logging
import os
import time
import uuid

import torch

from . import _C, _lifecycle
from ._lifecycle import Bootstrap, RingReduceError, Work, env_int

log = logging.getLogger("ringreduce")

# Slice size of the shared-memory ring (bytes). Test-only knob: a tiny value (e.g. 64) forces many
# pipeline steps per chunk. See csrc/shm/protocol.h for where the default comes from.
DEFAULT_SLICE_BYTES = 128 << 10
# Busy-poll before sleeping on a futex. With more ranks than cores a spinning waiter steals the
# core from the rank it waits for, so it goes straight to yielding then (one 64-pause poll first):
# world 4 on 2 cores, 4 KiB all-reduce, 12.5-17 us a call against 15-25 with a 2 us spin, and no
# worse at 256 KiB-4 MiB.
SPIN_NS_DEDICATED = 50_000
SPIN_NS_OVERSUBSCRIBED = 0
# Then, with more ranks than cores, poll with sched_yield this long before the futex sleep: the
# yield hands the core to the rank being waited for at once, where a futex sleep and wake-up costs
# two system calls and a scheduler round trip per ring step.
YIELD_NS_OVERSUBSCRIBED = 1_000_000
# Auto algorithm: one-shot for all-reduces up to this many bytes, the ring above. Measured on the
# 2-core dev machine: at world 4 (oversubscribed) one-shot wins at 4-16 KiB, wins or ties at
# 32 KiB, and loses at 64 KiB (four runs). At world 2 one-shot wins up to 1 KiB and the ring from
# 2 KiB (4 runs, one-shot 3-31% slower at 2-32 KiB in all 24 cells, faster at 512 B-1 KiB in 7 of
# 8); earlier runs, before the ring's later changes, had them tied up to 16 KiB.
# Noisy machine; not measured with more ranks or on dedicated cores at world > 2.
ONESHOT_MAX_BYTES = 32 << 10
ONESHOT_MAX_BYTES_WORLD2 = 1 << 10
ALGOS = ("auto", "ring", "oneshot", "twoshot", "cma")


def algo_from_env():
    algo = (os.environ.get("RINGREDUCE_ALGO") or "auto").strip().lower() or "auto"
    if algo not in ALGOS:
        raise ValueError(f"RINGREDUCE_ALGO must be one of {', '.join(ALGOS)}, got {algo!r}")
    return algo


class Communicator(_lifecycle.Communicator):
    """A shared-memory ring over the ranks of one process group on one host."""

    transport = "shm"

    def __init__(self, group=None, timeout=None, slice_bytes=None, member=None, algo=None,
                 machine_ranks=None):
        _lifecycle.require_initialized()
        super().__init__(member or _lifecycle.Member.of_group(group), timeout)
        self.slice_bytes = int(slice_bytes or env_int("RINGREDUCE_SLICE_BYTES", DEFAULT_SLICE_BYTES))
        ncpu = len(os.sched_getaffinity(0))
        # machine_ranks: the processes of the job on this machine, when more than this ring's own
        # (simulated hosts); they compete for the same cores.
        oversubscribed = max(self.world_size, machine_ranks or 0) > ncpu
        self.spin_ns = env_int("RINGREDUCE_SPIN_NS",
                               SPIN_NS_OVERSUBSCRIBED if oversubscribed else SPIN_NS_DEDICATED)
        self.yield_ns = env_int("RINGREDUCE_YIELD_NS", YIELD_NS_OVERSUBSCRIBED if oversubscribed else 0)
        self.algo = algo if algo is not None else algo_from_env()
        if self.algo not in ALGOS:
            raise ValueError(f"ringreduce: algo must be one of {', '.join(ALGOS)}, got {self.algo!r}")
        self.stream = (os.environ.get("RINGREDUCE_STREAM") or "auto").strip().lower()
        if self.stream not in ("auto", "0", "1"):
            raise ValueError(f"RINGREDUCE_STREAM must be auto, 0 or 1, got {self.stream!r}")
        self.oneshot_max_bytes = env_int(
            "RINGREDUCE_ONESHOT_MAX_BYTES",
            ONESHOT_MAX_BYTES_WORLD2 if self.world_size == 2 else ONESHOT_MAX_BYTES)
        self._native = self._bootstrap()
        self._setup_trace(self._trace_prefix, self._native.recorder())
        log.debug("rank %d/%d: shm ring ready (slice %d B, timeout %g s, spin %d ns, yield %d ns, "
                  "algo %s, one-shot up to %d B)", self.rank, self.world_size, self.slice_bytes,
                  self.timeout, self.spin_ns, self.yield_ns, self.algo, self.oneshot_max_bytes)

    # -- setup -------------------------------------------------------------------------------
    def _bootstrap(self):
        setup = Bootstrap(self.member, "shm", self.timeout)
        self._trace_prefix = setup.prefix
        deadline = time.monotonic() + self.timeout
        name = None
        try:
            if self.rank == 0:
                name = "/ringreduce-%d-%s" % (os.getpid(), uuid.uuid4().hex[:12])
                native = _C.ShmComm(name, True, 0, self.world_size, self.slice_bytes, self.timeout,
                                    **self._tuning())
                setup.set("name", name)
            else:
                name = setup.get("name", "rank 0 of the group to create the shared memory").decode()
                native = _C.ShmComm(name, False, self.rank, self.world_size, self.slice_bytes,
                                    self.timeout, **self._tuning())
            # The last rank to map the segment removes its name: from then on nothing is left in
            # /dev/shm, even if every process is killed.
            joined = setup.add("mapped", 1)
            if joined == self.world_size:
                _C.shm_unlink(name)
            while joined < self.world_size:
                if time.monotonic() > deadline:
                    native.close()
                    raise RingReduceError(
                        f"ringreduce: rank {self.rank}: communicator setup timed out after "
                        f"{self.timeout:g} s: only {joined} of {self.world_size} ranks joined "
                        f"({_lifecycle.SETUP_HINT})")
                time.sleep(0.001)
                joined = setup.add("mapped", 0)
            return native
        except BaseException:
            if self.rank == 0 and name is not None:
                _C.shm_unlink(name)
            raise

    def _tuning(self):
        return dict(spin_ns=self.spin_ns, yield_ns=self.yield_ns, algo=self.algo,
                    oneshot_max_bytes=self.oneshot_max_bytes, trace_buffer=self.trace_buffer,
                    stream=self.stream)

    def _pids(self):
        return self._native.pids()

    def algo_for(self, numel, dtype):
        """The algorithm ("ring", "oneshot", "twoshot" or "cma") an all_reduce of numel elements of dtype runs."""
        return self._native.algo(numel, torch.empty(0, dtype=dtype))

    def shared_empty(self, shape, dtype):
        """A tensor in a new buffer that every rank maps (ringreduce.shared_empty). Collective."""
        numel = 1
        for d in shape:
            numel *= d
        es = torch.empty(0, dtype=dtype).element_size()
        nbytes = max(numel * es, 1)
        setup = Bootstrap(self.member, "pool", self.timeout)
        name = "/ringreduce-pool-%d-%s" % (os.getpid(), uuid.uuid4().hex[:12])
        self._native.pool_create(name, nbytes)
        try:  # the name goes as soon as every rank mapped it (or on any failure): no leftovers
            setup.set(f"buf/{self.rank}", f"{name} {nbytes}")
            entries = [v.decode().split() for v in
                       setup.all("buf", self.world_size, "shared buffer (ringreduce.shared_empty)")]
            sizes = [int(b) for _, b in entries]
            if len(set(sizes)) != 1:
                self._native.pool_drop()
                raise ValueError(f"ringreduce.shared_empty: every rank must ask for the same size "
                                 f"and dtype; bytes asked by rank: {sizes}")
            raw = self._native.pool_attach([n for n, _ in entries])
            if not setup.count("mapped", self.world_size, self.timeout):
                raise RingReduceError(
                    f"ringreduce: rank {self.rank}: shared_empty timed out after "
                    f"{self.timeout:g} s waiting for every rank to map the buffers "
                    f"({_lifecycle.SETUP_HINT})")
        finally:
            _C.shm_unlink(name)
        return raw[:numel * es].view(dtype).view(shape)

    # -- collectives (arguments already checked by ringreduce.collectives) --------------------
    # The native communicator runs every call in order on its own executor (csrc/runtime/executor.h):
    # a sync call on this thread, an async one on its worker or on the thread that waits for it.
    # Non-contiguous tensors run through contiguous copies, copied back when the call is done.
    def all_reduce(self, tensor, op_code, async_op, wire=0):
        return self._wrap(self._native.all_reduce(tensor, op_code, async_op, wire))

    def reduce_scatter(self, output, input, op_code, async_op, wire=0):
        return self._wrap(self._native.reduce_scatter(output, input, op_code, async_op, wire))

    def all_gather(self, output, input, async_op):
        return self._wrap(self._native.all_gather(output, input, async_op))

    def _wrap(self, work):
        return None if work is None else Work(None, self._interrupted, work)

    @property
    def _inflight(self):
        return self._native.inflight()

    def synchronize(self):
        """Waits until every call made so far has finished."""
        self._native.synchronize()

    # -- lifetime ----------------------------------------------------------------------------
    @property
    def broken(self):
        return self._native.broken()

    def abort(self, reason="aborted by the user"):
        """Marks the group's ring broken: every rank's current and later calls raise."""
        self._native.abort(f"rank {self.rank}: {reason}")

    def _stop_calls(self, busy):
        if busy:  # a call still waiting on its peers would otherwise keep close() until its deadline
            self._native.abort(f"rank {self.rank}: communicator closed with calls in flight")

    def _close_native(self):
        self._native.close()  # lets queued calls end (aborted first if busy), joins the worker
