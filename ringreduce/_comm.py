"""Communicators: one per process group and transport, created on first use and cached.

Python owns policy and lifetime: the group is used only to bootstrap (exchange the shared-memory name
through its store); then data moves through the native ring. Every communicator has one worker
thread for async_op=True; calls run in order of submission.
"""
import atexit
import datetime
import logging
import os
import queue
import sys
import threading
import time
import uuid

import torch
import torch.distributed as dist

from . import _C

RingReduceError = _C.RingReduceError
log = logging.getLogger("ringreduce")

if os.environ.get("RINGREDUCE_DEBUG") == "1" and not log.handlers:
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("ringreduce[%(process)d] %(message)s"))
    log.addHandler(_h)
    log.setLevel(logging.DEBUG)

# Slice size of the shared-memory ring (bytes). Test-only knob: a tiny value (e.g. 64) forces many
# pipeline steps per chunk. See csrc/shm/protocol.h for where the default comes from.
DEFAULT_SLICE_BYTES = 128 << 10
# Busy-poll before sleeping on a futex. With more ranks than cores a spinning waiter steals the
# core from the rank it waits for, so it spins far shorter then (measured in BENCHMARKS.md).
SPIN_NS_DEDICATED = 50_000
SPIN_NS_OVERSUBSCRIBED = 2_000


def default_timeout():
    raw = os.environ.get("RINGREDUCE_TIMEOUT", "300")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"RINGREDUCE_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"RINGREDUCE_TIMEOUT must be > 0 seconds, got {raw!r}")
    return value


def _env_int(name, default):
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


_setup_counters = {}
_comms = {}
_comms_lock = threading.Lock()
_create_lock = threading.Lock()  # held across a (collective) creation; _comms_lock only briefly


class Communicator:
    """A shared-memory ring over the ranks of one process group on one host."""

    transport = "shm"

    def __init__(self, group=None, timeout=None, slice_bytes=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ringreduce: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group(...) first")
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.timeout = float(timeout) if timeout is not None else default_timeout()
        self.slice_bytes = int(slice_bytes or _env_int("RINGREDUCE_SLICE_BYTES", DEFAULT_SLICE_BYTES))
        ncpu = len(os.sched_getaffinity(0))
        spin = SPIN_NS_DEDICATED if self.world_size <= ncpu else SPIN_NS_OVERSUBSCRIBED
        self.spin_ns = _env_int("RINGREDUCE_SPIN_NS", spin)
        self._native = self._bootstrap()
        self._run_lock = threading.Lock()
        self._state = threading.Condition()
        self._inflight = 0
        self._queue = queue.SimpleQueue()
        self._worker = None
        self._closed = False
        log.debug("rank %d/%d: shm ring ready (slice %d B, timeout %g s, spin %d ns)", self.rank,
                  self.world_size, self.slice_bytes, self.timeout, self.spin_ns)

    # -- setup -------------------------------------------------------------------------------
    def _bootstrap(self):
        store = dist.distributed_c10d._get_default_store()
        ranks = tuple(dist.get_process_group_ranks(self.group))
        n = _setup_counters.get(ranks, 0)
        _setup_counters[ranks] = n + 1
        key = "ringreduce/shm/%s/%d" % ("-".join(map(str, ranks)), n)
        deadline = time.monotonic() + self.timeout
        name = None
        try:
            if self.rank == 0:
                name = "/ringreduce-%d-%s" % (os.getpid(), uuid.uuid4().hex[:12])
                native = _C.ShmComm(name, True, 0, self.world_size, self.slice_bytes, self.timeout,
                                    self.spin_ns)
                store.set(key + "/name", name)
            else:
                try:
                    store.wait([key + "/name"], datetime.timedelta(seconds=self.timeout))
                except Exception as e:  # the store's own timeout error
                    raise RingReduceError(
                        f"ringreduce: rank {self.rank}: communicator setup timed out after "
                        f"{self.timeout:g} s waiting for rank 0 of the group to create the shared "
                        f"memory ({e})") from None
                name = store.get(key + "/name").decode()
                native = _C.ShmComm(name, False, self.rank, self.world_size, self.slice_bytes,
                                    self.timeout, self.spin_ns)
            # The last rank to map the segment removes its name: from then on nothing is left in
            # /dev/shm, even if every process is killed.
            joined = store.add(key + "/mapped", 1)
            if joined == self.world_size:
                _C.shm_unlink(name)
            while joined < self.world_size:
                if time.monotonic() > deadline:
                    native.close()
                    raise RingReduceError(
                        f"ringreduce: rank {self.rank}: communicator setup timed out after "
                        f"{self.timeout:g} s: only {joined} of {self.world_size} ranks joined")
                time.sleep(0.001)
                joined = store.add(key + "/mapped", 0)
            return native
        except BaseException:
            if self.rank == 0 and name is not None:
                _C.shm_unlink(name)
            raise

    # -- collectives (arguments already checked by ringreduce.collectives) --------------------
    def all_reduce(self, tensor, op_code, async_op):
        if tensor.is_contiguous():
            def run():
                self._native.all_reduce(tensor, op_code)
        else:  # reduce a contiguous copy, then write back through the view
            buf = tensor.contiguous()

            def run():
                self._native.all_reduce(buf, op_code)
                tensor.copy_(buf)
        return self.submit(run, [tensor], async_op)

    def reduce_scatter(self, output, input, op_code, async_op):
        src = input.contiguous()
        dst = output if output.is_contiguous() else torch.empty_like(
            output, memory_format=torch.contiguous_format)

        def run():
            self._native.reduce_scatter(dst, src, op_code)
            if dst is not output:
                output.copy_(dst)
        return self.submit(run, [output], async_op)

    def all_gather(self, output, input, async_op):
        src = input.contiguous()
        dst = output if output.is_contiguous() else torch.empty_like(
            output, memory_format=torch.contiguous_format)

        def run():
            self._native.all_gather(dst, src)
            if dst is not output:
                output.copy_(dst)
        return self.submit(run, [output], async_op)

    # -- running -----------------------------------------------------------------------------
    def submit(self, fn, result, async_op):
        """Runs fn() (a native call) in order with earlier calls; returns a Work if async_op."""
        if self._closed:
            raise RingReduceError("ringreduce: communicator is closed")
        with self._state:
            inline = not async_op and self._inflight == 0
            self._inflight += 1
            if not inline:
                fut = torch.futures.Future()
                self._ensure_worker()
                self._queue.put((fn, result, fut))
        if inline:
            try:
                with self._run_lock:
                    fn()
            finally:
                self._done()
            return None
        if async_op:
            return Work(fut)
        fut.wait()
        return None

    def _done(self):
        with self._state:
            self._inflight -= 1
            self._state.notify_all()

    def _ensure_worker(self):
        if self._worker is None:
            self._worker = threading.Thread(target=self._work_loop, name="ringreduce-worker",
                                            daemon=True)
            self._worker.start()

    def _work_loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, result, fut = item
            try:
                with self._run_lock:
                    fn()
            except BaseException as e:  # delivered to whoever waits on the future
                self._done()
                fut.set_exception(e)
            else:
                self._done()
                fut.set_result(result)

    def synchronize(self):
        """Waits until every submitted call has finished."""
        with self._state:
            while self._inflight:
                self._state.wait()

    # -- lifetime ----------------------------------------------------------------------------
    @property
    def broken(self):
        return self._native.broken()

    def abort(self, reason="aborted by the user"):
        """Marks the group's ring broken: every rank's current and later calls raise."""
        self._native.abort(f"rank {self.rank}: {reason}")

    def close(self):
        """Stops the worker and unmaps the ring. Idempotent. Calls still running are aborted."""
        if self._closed:
            return
        self._closed = True
        with self._state:
            busy = self._inflight > 0
        if busy:
            self._native.abort(f"rank {self.rank}: communicator closed with calls in flight")
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=self.timeout)
        with self._run_lock:
            self._native.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Work:
    """Handle of an async call, shaped like torch.distributed's Work."""

    def __init__(self, fut):
        self._fut = fut

    def wait(self, timeout=None):
        """Blocks until the call finished and raises its error, if any. timeout (seconds or a
        datetime.timedelta, as torch's Work.wait takes) bounds the wait: RingReduceError if the call
        is still running then (the call itself goes on and is bounded by the communicator's own
        timeout)."""
        if timeout is not None and not self._fut.done():
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            done = threading.Event()
            self._fut.add_done_callback(lambda _: done.set())
            if not done.wait(max(seconds, 0.0)):
                raise RingReduceError(f"Work.wait: the collective did not finish within "
                                      f"timeout={seconds:g} s; it is still running")
        self._fut.wait()  # raises the call's exception, if any
        return True

    def is_completed(self):
        return self._fut.done()

    def is_success(self):
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:
            return False
        return True

    def exception(self):
        if not self._fut.done():
            return None
        try:
            self._fut.value()
        except Exception as e:
            return e
        return None

    def get_future(self):
        return self._fut


def get_communicator(group=None, **options):
    """The cached communicator of group (None: the default group), created on first use.

    Creation is collective: every rank of the group must reach it. options (timeout, slice_bytes)
    apply only when this call creates it.
    """
    g = group if group is not None else dist.group.WORLD
    entry = _comms.get(id(g))  # a dict read is atomic; creation below takes the lock
    if entry is not None and entry[0] is g and not entry[1]._closed:
        return entry[1]
    with _create_lock:  # two threads meeting a group first must not create two communicators
        entry = _comms.get(id(g))
        if entry is not None and entry[0] is g and not entry[1]._closed:
            return entry[1]
        comm = Communicator(g, **options)
        with _comms_lock:
            _comms[id(g)] = (g, comm)
    return comm


def destroy(group=None):
    """Closes the communicators of group (None: the default group), CPU and CUDA; idempotent."""
    g = group if group is not None else dist.group.WORLD
    with _comms_lock:
        entry = _comms.pop(id(g), None)
    if entry is not None:
        entry[1].close()
    cuda = sys.modules.get("ringreduce._cuda")  # loaded only once a CUDA tensor was seen
    if cuda is not None and getattr(_C, "cuda_compiled", False):
        cuda.destroy(group)


def destroy_all():
    with _comms_lock:
        entries = list(_comms.values())
        _comms.clear()
    for _, comm in entries:
        comm.close()


atexit.register(destroy_all)
