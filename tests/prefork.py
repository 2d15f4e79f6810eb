"""A server that imports torch and ringreduce once and forks a process per rank (tests/dist_utils.py).

Started by the harness (python tests/prefork.py); it reads jobs from stdin and answers on stdout:
("started", job id, pid) for each fork and ("exited", pid, exit code) when a child ends (a
negative code: killed by that signal, as multiprocessing reports it). Importing torch takes 3-9 s
on the 2-core CI machine and every rank of every test paid it; a fork takes milliseconds.

A child does not return into the server's loop: serve() returns its job, the child runs it from
the top level and leaves with sys.exit, so its exit is a whole interpreter exit (atexit handlers,
finalization, C++ static destructors), as a process started by multiprocessing's "spawn" has.
The server never runs a torch operation (no thread pools, no CUDA) before it forks.
"""
import os
import pickle
import select
import signal
import struct
import sys

_LEN = struct.Struct("<Q")


def read_msg(fd):
    """The next message on fd, or None at end of file."""
    head = _read(fd, _LEN.size)
    if head is None:
        return None
    body = _read(fd, _LEN.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def write_msg(fd, msg):
    data = pickle.dumps(msg)
    data = _LEN.pack(len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _read(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _reap(out):
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        write_msg(out, ("exited", pid, os.waitstatus_to_exitcode(status)))


def serve():
    """The server's loop. Returns None in the server at end of input; returns the job in a child."""
    inp, out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)  # the jobs' output goes to their own files, never into the protocol
    os.close(null)
    write_msg(out, ("ready", os.getpid(), None))
    while True:
        ready, _, _ = select.select([inp], [], [], 0.02)
        if ready:
            job = read_msg(inp)
            if job is None:
                return None
            pid = os.fork()
            if pid == 0:
                os.close(inp)
                os.close(out)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                return job
            write_msg(out, ("started", job["id"], pid))
        _reap(out)


def run(job):
    """In the child: the job's output file, environment, working directory and sys.path, then its
    function; the exit code (1 if it raised)."""
    out = os.open(job["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)  # not the stderr this server inherited (a finished test's capture file)
    os.close(out)
    os.environ.clear()
    os.environ.update(job["environ"])
    os.chdir(job["cwd"])
    sys.path[:] = job["sys_path"]
    try:
        target, args = pickle.loads(job["payload"])
        target(*args)
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import ringreduce  # noqa: F401
    import pytest  # noqa: F401  (every test module imports it)
    import dist_utils  # noqa: F401
    preload = [n for n in os.environ.pop("RR_PREFORK_PRELOAD", "").split(",") if n]
    if preload:  # what the jobs will import anyway (dist_utils._Server's preload)
        import gc
        import importlib
        for name in preload:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        # The imported objects out of the children's garbage collections: a child's exit then
        # copies fewer of the server's pages (measured with this preload: 1.8 -> 0.5 s of CPU per
        # exit on the 2-core machine).
        gc.freeze()
    job = serve()
    if job is not None:
        sys.stdout.flush()
        sys.exit(run(job))
