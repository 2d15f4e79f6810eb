"""Runs a function on N real processes joined by a Gloo process group (file store, no ports; or a
TCPStore, RR_TEST_TCP_STORE).

The ranks are forked by a server that has imported torch and ringreduce once (tests/prefork.py):
importing torch in a fresh process takes seconds on the CI machine, and every rank of every test
paid it. Each rank still ends with a whole interpreter exit (atexit, finalization); its
environment, working directory and sys.path are the caller's at the call. RR_TEST_SPAWN=1 starts
fresh processes (multiprocessing's "spawn") instead.

Each rank's stderr and stdout go to a file in the run's folder (its tail is part of every failure
the harness reports); SIGUSR2 makes a rank print every thread's Python stack there (the harness
sends it to the ranks still running at a timeout). run_ranks requires every rank to exit with
status 0: a rank killed by a signal at exit (as every CUDA process was, once) is a failure, by name.
"""
import atexit
import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# How long a rank that reported its result may take to exit (destroy, interpreter shutdown).
EXIT_GRACE_S = 60.0


def _stderr_path(tmp, rank):
    return os.path.join(tmp, f"rank{rank}.stderr")


def _result_path(tmp, rank):
    return os.path.join(tmp, f"rank{rank}.result")


def _entry(rank, world, store_path, fn, args, q, env, backend):
    os.environ.update(env or {})
    tmp = os.path.dirname(store_path)
    err = open(_stderr_path(tmp, rank), "a", buffering=1)
    os.dup2(err.fileno(), 2)
    os.dup2(err.fileno(), 1)
    faulthandler.enable(file=err)
    faulthandler.register(signal.SIGUSR2, file=err, all_threads=True)
    import torch.distributed as dist
    import ringreduce
    try:
        # The prefork server imported ringreduce in its own environment: what the import read
        # (RINGREDUCE_DETERMINISTIC, RINGREDUCE_DEBUG) is read again from this rank's.
        ringreduce._read_environment()
        # RR_TEST_TCP_STORE: "host:port" of a TCPStore the test process holds (as torchrun's
        # agent holds one), or "host:port:rank0", one rank 0 holds (its loss takes the store).
        tcp = os.environ.get("RR_TEST_TCP_STORE")
        if tcp:
            host, port, *holder = tcp.split(":")
            store = dist.TCPStore(host, int(port), is_master=bool(holder) and rank == 0,
                                  wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
        else:
            store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        _report(tmp, q, (rank, "ok", fn(rank, world, *args)))
    except BaseException:
        _report(tmp, q, (rank, "error", traceback.format_exc()))
    finally:
        try:
            ringreduce.destroy()
            dist.destroy_process_group()
        except Exception:
            pass
        if q is not None:
            q.close()
            q.join_thread()  # the result reaches the harness before the interpreter shuts down


def _report(tmp, q, out):
    """Before the rank's destroy and exit (a hang there is the harness's to name, not a lost result)."""
    if q is not None:
        q.put(out)
        return
    part = _result_path(tmp, out[0]) + ".part"
    with open(part, "wb") as f:
        pickle.dump(out, f)
    os.rename(part, _result_path(tmp, out[0]))


class _Server:
    """The prefork server of this process (started at the first spawn) and the reader of its
    answers: pids by job id, exit codes by pid. preload: modules the server imports as well
    (tests/test_snippets.py's ranks import lightning, accelerate, torch._dynamo: seconds each), one
    server per tuple."""
    _instances = {}
    _lock = threading.Lock()

    @classmethod
    def get(cls, preload=()):
        with cls._lock:
            server = cls._instances.get(preload)
            if server is None or server.proc.poll() is not None:
                server = cls._instances[preload] = cls(preload)
            return server

    def __init__(self, preload=()):
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prefork.py")
        env = dict(os.environ, RR_PREFORK_PRELOAD=",".join(preload))
        self.proc = subprocess.Popen([sys.executable, path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.cond, self.write_lock = threading.Condition(), threading.Lock()
        self.pids, self.exits, self.next_id, self.dead = {}, {}, 0, False
        from prefork import read_msg, write_msg
        self._write_msg = write_msg
        first = read_msg(self.proc.stdout.fileno())
        if not first or first[0] != "ready":
            raise RuntimeError("tests/prefork.py did not start (its stderr is above)")
        threading.Thread(target=self._read, args=(read_msg,), daemon=True).start()
        atexit.register(self.proc.stdin.close)

    def _read(self, read_msg):
        while True:
            msg = read_msg(self.proc.stdout.fileno())
            with self.cond:
                if msg is None:
                    self.dead = True
                elif msg[0] == "started":
                    # The kernel reuses pids (pid_max 32768; threads take them too): an earlier
                    # child's exit code under this pid is not this one's. The server reports a
                    # child's start before its exit, so dropping it here is safe.
                    self.pids[msg[1]] = msg[2]
                    self.exits.pop(msg[2], None)
                else:
                    self.exits[msg[1]] = msg[2]
                self.cond.notify_all()
            if msg is None:
                return

    def start(self, target, args, output):
        job = {"payload": pickle.dumps((target, args)), "environ": dict(os.environ),
               "cwd": os.getcwd(), "sys_path": list(sys.path), "output": output}
        with self.write_lock:  # the answers are read by _read meanwhile: no deadlock on the pipes
            job["id"], self.next_id = self.next_id, self.next_id + 1
            self._write_msg(self.proc.stdin.fileno(), job)
        with self.cond:
            if not self.cond.wait_for(lambda: job["id"] in self.pids or self.dead, timeout=60):
                raise RuntimeError("tests/prefork.py did not fork within 60 s")
            if job["id"] not in self.pids:
                raise RuntimeError("tests/prefork.py exited")
            return self.pids[job["id"]]


class _Forked:
    """A rank forked by the server, with the part of multiprocessing.Process's interface the tests
    use: pid, exitcode, is_alive(), join(timeout), kill()."""

    def __init__(self, server, target, args, output):
        self.server = server
        self.pid = server.start(target, args, output)

    @property
    def exitcode(self):
        with self.server.cond:
            return self.server.exits.get(self.pid)

    def is_alive(self):
        return self.exitcode is None

    def join(self, timeout=None):
        with self.server.cond:
            self.server.cond.wait_for(lambda: self.pid in self.server.exits or self.server.dead,
                                      timeout=timeout)

    def kill(self):
        if self.is_alive():  # never a reaped (perhaps reused) pid
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class _Results:
    """The results the forked ranks left in their folder, one get() each, as a queue would give."""

    def __init__(self, tmp, world):
        self.tmp, self.world, self.seen = tmp, world, set()

    def get(self, timeout):
        deadline = time.monotonic() + timeout
        while True:
            for r in range(self.world):
                if r not in self.seen and os.path.exists(_result_path(self.tmp, r)):
                    self.seen.add(r)
                    with open(_result_path(self.tmp, r), "rb") as f:
                        return pickle.load(f)
            if time.monotonic() >= deadline:
                raise queue.Empty
            time.sleep(0.02)


def spawn(world, fn, *args, env=None, backend="gloo"):
    """Starts the ranks; returns (processes, result queue, store dir) for tests that kill ranks.
    backend: the default group's (ringreduce registers its own on import)."""
    tmp = tempfile.mkdtemp(prefix="rr-test-")
    store = os.path.join(tmp, "store")
    if os.environ.get("RR_TEST_SPAWN") == "1":
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [ctx.Process(target=_entry, daemon=True,
                             args=(r, world, store, fn, args, q, env, backend))
                 for r in range(world)]
        for p in procs:
            p.start()
    else:
        server = _Server.get()
        q = _Results(tmp, world)
        procs = [_Forked(server, _entry, (r, world, store, fn, args, None, env, backend),
                         _stderr_path(tmp, r)) for r in range(world)]
    for p in procs:
        p.tmp = tmp  # where its stderr goes (collect reads it)
    return procs, q, tmp


def signal_name(code):
    """'SIGSEGV' for a multiprocessing exit code of -11; 'status 3' for 3."""
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


def stderr_tail(procs, rank, lines=25):
    tmp = getattr(procs[rank], "tmp", None)
    try:
        with open(_stderr_path(tmp, rank), errors="replace") as f:
            text = f.read().splitlines()[-lines:]
    except (OSError, TypeError):
        return ""
    return "\n".join(text)


def _with_tail(procs, rank, text):
    tail = stderr_tail(procs, rank)
    return f"{text}\n[rank {rank} stderr, last lines]\n{tail}" if tail.strip() else text


def _note_dead(procs, waiting, dead_since, errors):
    """A rank that exited without a result (crash, segfault) is an error now, not at the timeout.
    It gets 2 s after exit for its queued result to arrive."""
    now = time.monotonic()
    for r in waiting:
        code = procs[r].exitcode
        if code is None:
            continue
        if now - dead_since.setdefault(r, now) > 2.0:
            errors[r] = _with_tail(procs, r, f"rank {r} exited with {signal_name(code)} without "
                                             f"reporting a result")


def _dump_stacks(procs, ranks):
    """Asks the ranks still running to print their threads' stacks into their stderr files."""
    for r in ranks:
        if procs[r].is_alive():
            try:
                os.kill(procs[r].pid, signal.SIGUSR2)
            except OSError:
                pass
    time.sleep(1.0)


def _check_exits(procs, ranks, errors):
    """Every rank in ranks must exit with status 0 within EXIT_GRACE_S."""
    deadline = time.monotonic() + EXIT_GRACE_S
    for r in sorted(ranks):
        procs[r].join(timeout=max(0.0, deadline - time.monotonic()))
        if procs[r].is_alive():
            _dump_stacks(procs, [r])
            errors[r] = _with_tail(procs, r, f"rank {r} reported its result but did not exit "
                                             f"within {EXIT_GRACE_S:.0f} s")
        elif procs[r].exitcode != 0:
            errors[r] = _with_tail(procs, r, f"rank {r} reported its result, then exited with "
                                             f"{signal_name(procs[r].exitcode)}")


def collect(procs, q, timeout, expect=None, check_exit=False):
    """Results by rank of the ranks in expect (default all); kills everything left at the end.
    check_exit: the ranks in expect must also exit with status 0 (a failure otherwise, in errors)."""
    expect = set(range(len(procs)) if expect is None else expect)
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    dead_since = {}
    finished = False
    try:
        while expect - set(results) - set(errors):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(expect - set(results) - set(errors))
                _dump_stacks(procs, missing)
                tails = "".join(f"\n--- rank {r} (still running; its stacks and stderr) ---\n"
                                f"{stderr_tail(procs, r, 60)}" for r in missing)
                raise TimeoutError(f"ranks {missing} did not finish within {timeout} s; "
                                   f"errors so far: {errors}{tails}")
            try:
                rank, status, value = q.get(timeout=min(left, 0.5))
            except queue.Empty:
                _note_dead(procs, expect - set(results) - set(errors), dead_since, errors)
                continue
            (results if status == "ok" else errors)[rank] = value
        if check_exit:
            _check_exits(procs, expect - set(errors), errors)
        finished = True
    finally:
        # The ranks left running get 5 s each to exit; after a timeout (their stacks are taken
        # already) none: a stuck rank is killed at once.
        for p in procs:
            p.join(timeout=5 if finished else 0)
            if p.is_alive():
                p.kill()
                # A process inside a driver call may not die at once: never block the suite on it.
                p.join(timeout=10)
    return results, errors


def run_ranks(world, fn, *args, timeout=180, env=None, backend="gloo"):
    """Runs fn(rank, world, *args) on every rank; returns the results in rank order or raises
    with every failing rank's traceback."""
    procs, q, _ = spawn(world, fn, *args, env=env, backend=backend)
    results, errors = collect(procs, q, timeout, check_exit=True)
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world)]
