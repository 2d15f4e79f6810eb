"""One communicator lifecycle for every transport (shared memory, p2p, nccl).

- Created collectively, once per (group, key), and cached: `REGISTRY.get(group, key, create)`. Two
  threads that meet a group first (a DDP hook on the autograd thread and the main thread) get one
  communicator: a creation runs under a lock of its own key, so the setup's store keys stay in step.
- Bootstrapped through the group's store with `Bootstrap` (keys under a prefix, waits bounded by the
  timeout, counters for barriers).
- A worker thread per communicator finishes async calls in the order they were made: it runs each
  call's `job` (the collective itself on the CPU; waiting for the device on CUDA) and completes the
  call's future with its result or its error. Work wraps that future.
- close(): idempotent; stops the worker, then the transport frees what it holds; destroy(group) and,
  at exit, destroy_all() close every communicator, CPU and CUDA alike. A CPU communicator whose
  process group torch.distributed destroyed is closed at the next creation.

The bottom layer of the package (docs/development.md "Architecture", tests/test_layers.py): it imports no
transport, API or backend module; the backend registers its own rings here (Registry.add_owner).
"""
import atexit
import datetime
import json
import logging
import os
import queue
import re
import shutil
import socket
import tempfile
import threading
import time
import uuid

import torch
import torch.distributed as dist

from . import _C, _env

RingReduceError = _C.RingReduceError
log = logging.getLogger("ringreduce")



def debug_log_from_env():
    """RINGREDUCE_DEBUG=1: ringreduce's log (transport and algorithm choices) on stderr."""
    if _env.get("RINGREDUCE_DEBUG", False) and not log.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("ringreduce[%(process)d] %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.DEBUG)


debug_log_from_env()


# What a timeout in setup usually means: a rank never made the call (it failed before its first
# collective, or called something else). The same words as the native rings' call timeouts.
SETUP_HINT = ("RINGREDUCE_TIMEOUT; did every rank make the same call? A rank that failed before "
              "its first collective never joins")


def default_timeout():
    return _env.get("RINGREDUCE_TIMEOUT", 300.0)


def trace_buffer():
    """Calls each communicator's flight recorder keeps (RINGREDUCE_TRACE_BUFFER; 0: off)."""
    return _env.get("RINGREDUCE_TRACE_BUFFER", _C.TRACE_BUFFER)  # the one check of the setting


def trace_root():
    """Where flight recorder dumps go: RINGREDUCE_TRACE_DIR, else ringreduce-trace in the temp dir."""
    return _env.get("RINGREDUCE_TRACE_DIR") or default_trace_root()


def default_trace_root():
    return os.path.join(tempfile.gettempdir(), "ringreduce-trace")


# Runs (one folder per communicator, <name>.<job>) the default trace folder keeps: failed runs
# piled up there, one folder each. A RINGREDUCE_TRACE_DIR folder is the user's: never pruned.
TRACE_KEEP = 20
_RUN_FOLDER = re.compile(r".+\.\d{8}-\d{6}-[0-9a-f]{6}")  # the names _setup_trace gives


def prune_traces(root, keep=TRACE_KEEP, exclude=None):
    """Removes all but the `keep` most recently written run folders under root (only folders
    named as ours; not `exclude`, the caller's own, which another rank may have written already);
    returns the removed paths. Ranks may prune at once: what vanished is skipped."""
    runs = []
    try:
        with os.scandir(root) as entries:
            for e in entries:
                if _RUN_FOLDER.fullmatch(e.name) and e.name != exclude and \
                        e.is_dir(follow_symlinks=False):
                    try:
                        runs.append((e.stat(follow_symlinks=False).st_mtime, e.path))
                    except OSError:
                        pass
    except OSError:  # no folder yet
        return []
    removed = [path for _, path in sorted(runs, reverse=True)[keep:]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if removed:
        log.info("ringreduce: removed %d old flight recorder runs from %s (it keeps the %d most "
                 "recent; RINGREDUCE_TRACE_DIR keeps every run)", len(removed), root, keep)
    return removed


def machine_id():
    """The real machine: host name and boot id (two containers on one machine share a boot id but
    not always a host name)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def host_id():
    """This process's host: RINGREDUCE_HOST_ID if set (tests, simulated hosts), else the machine.
    Ranks with the same host id may map each other's memory (every transport plans by it)."""
    return _env.get("RINGREDUCE_HOST_ID") or machine_id()


# The file SIGUSR1 writes this process's Python stacks to (RINGREDUCE_TRACE_SIGNAL=1), or None.
STACK_FILE = None
# Operation codes (ringreduce.collectives) by name, as the recorder writes them.
OP_NAMES = tuple(sorted(_C.OP_CODES, key=_C.OP_CODES.get))  # by code (csrc/ring/types.h)


class traced_source:
    """Calls made inside `with traced_source("ddp_hook"):` on this thread are recorded as coming
    from there (the flight recorder's "source"; the direct API is "api")."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        self.prev = _C.trace_source(self.name)

    def __exit__(self, *exc):
        _C.trace_source(self.prev)


def require_initialized():
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ringreduce: torch.distributed is not initialized; call "
                           "torch.distributed.init_process_group(...) first")


_prefix_counters = {}
_prefix_lock = threading.Lock()


class Member:
    """A communicator's ranks as its setup sees them: the store they meet on, this rank, their
    number, and a name for the store keys. From a torch.distributed group (the direct API), or from
    what torch hands a backend while it builds a group (ringreduce/backend.py)."""

    def __init__(self, store, rank, size, name, group=None):
        self.store, self.rank, self.size, self.name, self.group = store, rank, size, name, group

    @classmethod
    def of_group(cls, group):
        g = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(g)
        return cls(dist.distributed_c10d._get_default_store(), dist.get_rank(g), len(ranks),
                   "-".join(map(str, ranks)), g)


# Groups shrink_group replaced, by torch's group name: what a call on the stale group object says.
_SHRUNK = {}


def note_shrunk(group_name, excluded):
    _SHRUNK[group_name] = sorted(excluded)


def group_named(name):
    """The live process group torch knows by name, or None."""
    for pg, n in list(dist.distributed_c10d._world.pg_names.items()):
        if n == name:
            return pg
    return None


def check_not_shrunk(group, fn):
    """A call on a group object that shrink_group replaced raises, naming the shrink."""
    if not _SHRUNK or group in dist.distributed_c10d._world.pg_map:
        return
    excluded = _SHRUNK.get(getattr(group, "group_name", None))
    if excluded is not None:
        raise RingReduceError(
            f"ringreduce.{fn}: this process group was shrunk (shrink_group excluding ranks "
            f"{excluded}) and is gone; use the group shrink_group returned (after shrinking the "
            f"default group, group=None is the new one)")


class Bootstrap:
    """Store keys of one communicator's setup, under a prefix unique to (what, member, n-th time)."""

    def __init__(self, member, what, timeout):
        with _prefix_lock:
            n = _prefix_counters.get((member.name, what), 0)
            _prefix_counters[(member.name, what)] = n + 1
        self.store = member.store
        self.prefix = "ringreduce/%s/%s/%d" % (what, member.name, n)
        self.timeout = timeout
        self.rank = member.rank

    def set(self, name, value):
        self.store.set(f"{self.prefix}/{name}", value)

    def add(self, name, amount):
        return self.store.add(f"{self.prefix}/{name}", amount)

    def get(self, name, waiting_for):
        key = f"{self.prefix}/{name}"
        try:
            self.store.wait([key], datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # the store's own timeout error
            raise RingReduceError(
                f"ringreduce: rank {self.rank}: communicator setup timed out after "
                f"{self.timeout:g} s waiting for {waiting_for} ({SETUP_HINT}) ({e})") from None
        return self.store.get(key)

    def all(self, name, world, what):
        """Every rank's value of name (each rank sets its own as f"{name}/{rank}")."""
        return [self.get(f"{name}/{r}", f"rank {r}'s {what}") for r in range(world)]

    def count(self, name, world, limit):
        """Adds this rank to a counter; waits up to limit seconds for world ranks. True if all came."""
        key = f"{self.prefix}/{name}"
        joined = self.store.add(key, 1)
        deadline = time.monotonic() + limit
        while joined < world and time.monotonic() < deadline:
            time.sleep(0.001)
            joined = self.store.add(key, 0)
        return joined >= world


def wait_interruptibly(fut, on_interrupt=None, timeout=None):
    """Waits for fut where Ctrl-C reaches the waiter (torch's Future.wait returns to Python only
    when done). True if done within timeout (None: no limit). On KeyboardInterrupt calls
    on_interrupt (the communicator aborts its group, as an interrupted native wait does), then
    re-raises."""
    if fut.done():
        return True
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    try:
        return done.wait(timeout)
    except KeyboardInterrupt:
        if on_interrupt is not None:
            on_interrupt()
        raise


class Work:
    """Handle of an async call, shaped like torch.distributed's Work. Its future completes once the
    call has finished (on the device, for CUDA tensors) and carries the call's error, if any.
    native: the shared-memory call's c10d Work (its future is made only when asked for)."""

    def __init__(self, fut, on_interrupt=None, native=None):
        self._f = fut
        self._on_interrupt = on_interrupt
        self._native = native

    @property
    def _fut(self):
        if self._f is None:
            self._f = self._native.get_future()
        return self._f

    def wait(self, timeout=None):
        """Blocks until the call finished and raises its error, if any. timeout (seconds or a
        datetime.timedelta, as torch's Work.wait takes) bounds the wait: RingReduceError if the call
        is still running then (the call itself goes on, bounded by the communicator's timeout).
        Ctrl-C ends the wait and aborts the group."""
        if timeout is None and self._native is not None:
            # runs the call here if it is still queued (no thread hand-off), else waits for it;
            # raises its error (RingReduceError) or Ctrl-C's KeyboardInterrupt
            _C.ring_work_wait(self._native)
            return True
        seconds = None
        if timeout is not None:
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            seconds = max(seconds, 0.0)
        if not wait_interruptibly(self._fut, self._on_interrupt, seconds):
            raise RingReduceError(f"Work.wait: the collective did not finish within "
                                  f"timeout={seconds:g} s; it is still running")
        self._fut.wait()  # raises the call's error; CUDA: the current stream waits for the result
        return True

    synchronize = wait

    def is_completed(self):
        return self._fut.done()

    def is_success(self):
        return self._fut.done() and self.exception() is None

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


# The fast path of a synchronous all_reduce (collectives.all_reduce): group (None for the default
# group) -> (process group, shm or p2p communicator, its fast function). A communicator drops its entries when it closes, so
# that this cache never keeps a destroyed process group (its Gloo threads and sockets) alive.
FAST = {}


class Communicator:
    """What every transport's communicator shares: its place in the group, the worker thread that
    finishes async calls in order, and close()."""

    transport = None

    def __init__(self, member, timeout):
        self.member = member
        self.group = member.group  # None for a backend's communicator
        self.rank = member.rank
        self.world_size = member.size
        self.timeout = float(timeout) if timeout is not None else default_timeout()
        self.trace_buffer = trace_buffer()  # checked on every rank before any setup
        self._state = threading.Condition()
        if not isinstance(getattr(type(self), "_inflight", None), property):  # native count
            self._inflight = 0
        self._queue = queue.SimpleQueue()
        self._worker = None
        self._closed = False

    @property
    def closed(self):
        return self._closed

    # -- the flight recorder ---------------------------------------------------------------------
    recorder = None
    trace_dir = None

    def _pids(self):
        """Process ids of the communicator's ranks, None where unknown (the dump's "pids")."""
        return None

    def _setup_trace(self, prefix, recorder=None):
        """Configures this communicator's flight recorder (a new one unless the transport's native
        one is given): dumps go to trace_root()/<prefix>/rank<R>.json, the same folder on every rank
        of the communicator, with this rank's identity at the top."""
        install_trace_signal()  # if RINGREDUCE_TRACE_SIGNAL was set after import
        self.recorder = recorder if recorder is not None else _C.Recorder(self.trace_buffer)
        # The store prefix names the communicator within its job; rank 0's time and a random
        # suffix tell this job's dumps from an earlier job's with the same group.
        key = f"{prefix}/trace-id"
        if self.rank == 0:
            job = time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]
            self.member.store.set(key, job)
        else:
            try:
                self.member.store.wait([key], datetime.timedelta(seconds=self.timeout))
            except Exception as e:  # the store's own timeout error
                raise RingReduceError(f"ringreduce: rank {self.rank}: communicator setup timed out "
                                      f"after {self.timeout:g} s waiting for rank 0 ({SETUP_HINT}) "
                                      f"({e})") from None
            job = self.member.store.get(key).decode()
        name = re.sub(r"[^A-Za-z0-9_.@-]+", "-", prefix).strip("-")
        root = trace_root()
        if not _env.is_set("RINGREDUCE_TRACE_DIR"):  # room for this run's folder
            prune_traces(root, TRACE_KEEP - 1, exclude=f"{name}.{job}")
        self.trace_dir = os.path.join(root, f"{name}.{job}")
        members = None
        if self.member.group is not None:
            try:
                members = dist.get_process_group_ranks(self.member.group)
            except Exception:
                members = None
        header = {"rank": self.rank, "world_size": self.world_size,
                  "global_rank": dist.get_rank() if dist.is_initialized() else None,
                  "host": host_id(), "hostname": socket.gethostname(), "transport": self.transport,
                  "communicator": prefix, "job": job, "group": self.member.name, "members": members,
                  "timeout_s": self.timeout, "pids": self._pids(), "stacks": STACK_FILE or None}
        self.recorder.configure(self.trace_dir, f"rank{self.rank}.json", json.dumps(header)[1:-1])

    def dump_trace(self, path=None):
        """Writes the flight recorder (path: a file; None: the communicator's trace folder) and
        returns the file's path."""
        return self.recorder.dump(path or "")

    def _traced(self, fn, coll, numel, dtype, op_code, nbytes, algo):
        """fn wrapped to record its call (made now, started when fn runs, then finished or failed)
        and to show as the range ringreduce::<coll> in torch.profiler traces; a RingReduceError is
        raised again naming the dump the first failure writes."""
        rec = self.recorder
        dtype = str(dtype).replace("torch.", "")
        seq = rec.begin(coll, numel, dtype, OP_NAMES[op_code], algo, nbytes, False) if (
            rec is not None and rec.on) else 0
        # Opened here, on the caller's thread (where the profiler listens), closed when the call
        # ends on whichever thread runs it: as c10d's Work does for Gloo's and NCCL's calls.
        span = None
        if torch._C._autograd._profiler_enabled():
            span = torch.ops.profiler._record_function_enter_new(
                f"ringreduce::{coll}", f"numel={numel}, dtype={dtype}, bytes={nbytes}")

        def run():
            if seq:
                rec.started(seq)
            try:
                try:
                    fn()
                finally:
                    if span is not None:
                        torch.ops.profiler._record_function_exit._RecordFunction(span)
            except BaseException as e:
                if not seq:
                    raise
                what = str(e) or type(e).__name__
                text = rec.fail_and_dump(seq, what)  # the one failure wrapper (runtime/recorder.cpp)
                if text != what and isinstance(e, RingReduceError):  # ours, not an inner ring's
                    raise RingReduceError(text) from e
                raise
            if seq:
                rec.finished(seq)
        return run

    def _check_open(self):
        if self._closed:
            raise RingReduceError(_C.CLOSED_MESSAGE)

    # -- the worker ----------------------------------------------------------------------------
    def _submit(self, job, result, make_future, inline):
        """Runs job() in order with earlier calls: inline on this thread if allowed and nothing is in
        flight (job's error is raised here; returns None), else on the worker, which completes the
        returned future from make_future() with result or with job's error."""
        self._check_open()
        with self._state:
            inline = inline and self._inflight == 0
            self._inflight += 1
            if not inline:
                fut = make_future()
                self._ensure_worker()
                self._queue.put((job, result, fut))
        if not inline:
            return fut
        try:
            job()
        finally:
            self._done()
        return None

    def _done(self):
        with self._state:
            self._inflight -= 1
            self._state.notify_all()

    def _ensure_worker(self):
        if self._worker is None:
            self._worker = threading.Thread(target=self._work_loop, daemon=True,
                                            name=f"ringreduce-{self.transport}-worker")
            self._worker.start()

    def _work_loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            job, result, fut = item
            try:
                job()
            except BaseException as e:  # delivered to whoever waits on the future
                self._done()
                fut.set_exception(e)
            else:
                self._done()
                self._complete(fut, result)

    def _complete(self, fut, result):
        fut.set_result(result)

    def _interrupted(self):
        """Ctrl-C in a host wait for one of this communicator's calls: the group is aborted."""
        try:
            self.abort("interrupted by a signal")
        except Exception:  # closed meanwhile
            pass

    def synchronize(self):
        """Waits until every call made so far has finished."""
        with self._state:
            while self._inflight:
                self._state.wait()

    # -- lifetime ------------------------------------------------------------------------------
    def close(self):
        """Stops the worker (after the calls in flight end: aborted, or by their deadline) and frees
        the transport. Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            busy = self._inflight > 0
        for g in [g for g, entry in list(FAST.items()) if entry[1] is self]:
            FAST.pop(g, None)  # first: no fast call starts on a closing communicator
        self._stop_calls(busy)
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=self.timeout)
        self._close_native()

    def _stop_calls(self, busy):
        """Transport hook: end the calls still in flight, or let them finish."""

    def _close_native(self):
        """Transport hook: free the native communicator."""
        raise NotImplementedError

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Registry:
    """The communicators of this process by (group, key); see the module's docstring."""

    def __init__(self):
        self._lock = threading.Lock()  # the dicts, briefly
        self._creating = {}  # key -> lock held across that key's (collective) creation
        self._comms = {}  # key -> (group, communicator)
        # Communicators that a layer above keeps itself (the torch.distributed backend's), which
        # the registry reaches only through what that layer registered: add_owner.
        self._owners = []

    def _cached(self, key, group):
        entry = self._comms.get(key)  # a dict read is atomic
        if entry is not None and entry[0] is group and not entry[1].closed:
            return entry[1]
        return None

    def get(self, group, key, create):
        """The open communicator of (group, key), made by create(group) on first use. Creation is
        collective: every rank of the group must get here."""
        require_initialized()
        g = group if group is not None else dist.group.WORLD
        k = (id(g),) + tuple(key)
        comm = self._cached(k, g)
        if comm is not None:
            return comm
        self._close_destroyed()
        with self._lock:
            lock = self._creating.setdefault(k, threading.Lock())
        with lock:
            comm = self._cached(k, g)
            if comm is None:
                comm = create(g)
                with self._lock:
                    self._comms[k] = (g, comm)
        return comm

    def _close_destroyed(self):
        """Closes the CPU communicators of process groups that torch.distributed has destroyed
        (destroy_process_group without rr.destroy, then init again): run before each creation, so
        that such a process does not pile up their memory, worker threads and groups. Closing one is
        local. CUDA communicators wait for the other ranks in close(), through the group's store, so
        they stay until destroy_all at exit."""
        live = dist.distributed_c10d._world.pg_map
        with self._lock:
            stale = [k for k, (g, _) in self._comms.items() if k[1] == "shm" and g not in live]
            entries = [self._comms.pop(k) for k in stale]
            for k in stale:
                self._creating.pop(k, None)
        for _, comm in entries:
            comm.close()

    def destroy(self, group=None):
        """Closes every communicator of group (None: the default group); idempotent."""
        g = group if group is not None else dist.group.WORLD
        with self._lock:
            keys = [k for k, (grp, _) in self._comms.items() if grp is g]
            entries = [self._comms.pop(k) for k in keys]
        for _, comm in entries:
            comm.close()

    def add_owner(self, communicators_of, close_all):
        """Registers a keeper of communicators outside this registry (ringreduce/backend.py):
        communicators_of(group) lists its open ones of a group (for dump_trace); close_all() closes
        them all, run at exit before the registry closes its own."""
        self._owners.append((communicators_of, close_all))

    def of_group(self, group):
        """Every communicator of group: the registry's and its owners'."""
        with self._lock:
            comms = [c for grp, c in self._comms.values() if grp is group]
        for communicators_of, _ in list(self._owners):
            comms.extend(communicators_of(group))
        return comms

    def destroy_all(self):
        for _, close_all in list(self._owners):
            try:
                close_all()
            except Exception:  # noqa: BLE001  (at exit: the registry's own still get closed)
                log.debug("ringreduce: closing an owner's communicators at exit failed", exc_info=True)
        with self._lock:
            entries = list(self._comms.values())
            self._comms.clear()
        for _, comm in entries:
            comm.close()

    def live(self, key_prefix):
        """Open communicators whose key starts with key_prefix."""
        n = len(key_prefix)
        with self._lock:
            return [c for k, (_, c) in self._comms.items() if k[1:1 + n] == tuple(key_prefix)
                    and not c.closed]


REGISTRY = Registry()
atexit.register(REGISTRY.destroy_all)


def dump_trace(path=None, group=None):
    """Writes the flight recorder of every open communicator of group (None: the default group):
    the direct API's and, when group's backend is ringreduce, the backend's. path: a folder to
    write to instead of each communicator's own (RINGREDUCE_TRACE_DIR); each communicator writes
    <folder>/<communicator>/rank<R>.json. Returns the files written (none before the group's first
    collective has made a communicator). Local: the other ranks are not involved."""
    require_initialized()
    g = group if group is not None else dist.group.WORLD
    out = []
    for c in REGISTRY.of_group(g):
        if c.closed or c.recorder is None:
            continue
        target = None
        if path is not None:
            target = os.path.join(os.fspath(path), os.path.basename(c.trace_dir), f"rank{c.rank}.json")
        out.append(c.dump_trace(target))
    return out


def install_trace_signal():
    """RINGREDUCE_TRACE_SIGNAL=1: SIGUSR1 writes every flight recorder of this process (from a
    thread of ours, wherever the main thread is stuck) and this process's Python stacks (to
    STACK_FILE, named in each dump). Called at import and when a communicator is made; once.
    A child forked (not exec'd) after it has no dump thread: its SIGUSR1 makes the parent dump."""
    global STACK_FILE
    if STACK_FILE is not None or not _env.get("RINGREDUCE_TRACE_SIGNAL", False):
        return
    import faulthandler
    import signal
    global _stack_fh
    _C.install_trace_signal(int(signal.SIGUSR1))  # any thread may install it
    folder = os.path.join(trace_root(), "stacks")
    path = os.path.join(folder, f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', host_id())}-{os.getpid()}.txt")
    try:
        os.makedirs(folder, exist_ok=True)
        _stack_fh = open(path, "w")
    except OSError as e:  # the dumps still work; only the Python stacks are lost
        log.warning("ringreduce: RINGREDUCE_TRACE_SIGNAL: cannot write Python stacks to %s (%s)",
                    path, e)
        STACK_FILE = ""
        return
    STACK_FILE = path
    # Chained: faulthandler writes the stacks, then calls ours (installed above).
    faulthandler.register(signal.SIGUSR1, file=_stack_fh, all_threads=True, chain=True)


_stack_fh = None
