"""The multi-process harness (dist_utils) and the CUDA binding's ownership rules, on the CPU.

The first GPU run showed two blind spots: ranks that crashed at exit were reported as "exited
with code -11 without reporting a result" (or not at all), and nothing on a CPU machine could see
that the binding destroyed a stream torch still held. The harness now checks every rank's exit
status and names signals; the rules below are what the binding follows so that cannot recur (a
GPU proves them: tests/test_cuda.py's exit tests).
"""
import os
import pathlib
import re
import time

import pytest

from dist_utils import run_ranks

ROOT = pathlib.Path(__file__).resolve().parents[1]


def abort_at_exit_worker(rank, world):
    import atexit
    import signal
    if rank == 1:  # after the result is reported, as the CUDA crash at interpreter shutdown was
        atexit.register(lambda: os.kill(os.getpid(), signal.SIGABRT))
    return rank


def test_a_rank_killed_by_a_signal_at_exit_fails_by_name():
    with pytest.raises(AssertionError) as info:
        run_ranks(2, abort_at_exit_worker, timeout=60)
    msg = str(info.value)
    assert "rank 1 reported its result, then exited with SIGABRT" in msg, msg
    assert "Fatal Python error: Aborted" in msg, msg  # its stderr tail (faulthandler's report)
    assert "--- rank 0 ---" not in msg, msg


def stuck_worker(rank, world):
    if rank == 0:
        return "fine"
    def stuck_in_a_named_frame():
        time.sleep(600)
    stuck_in_a_named_frame()


def test_a_timeout_shows_the_stuck_ranks_stack():
    # Ranks are forked by tests/prefork.py in milliseconds; spawned ones (RR_TEST_SPAWN=1) need
    # seconds each to import torch on a loaded machine.
    timeout = 45 if os.environ.get("RR_TEST_SPAWN") == "1" else 6
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_ranks(2, stuck_worker, timeout=timeout)
    msg = str(info.value)
    assert f"ranks [1] did not finish within {timeout} s" in msg, msg
    assert "stuck_in_a_named_frame" in msg, msg  # the Python stack the harness asked for
    assert time.monotonic() - t0 < 90


def code_lines(path, comment):
    """The lines of a source file without their comments (comment: the comment marker)."""
    return [line.split(comment, 1)[0] for line in path.read_text().splitlines()]


def test_binding_never_destroys_a_stream_torch_may_hold():
    """Streams of communicators go back to a free list (csrc/binding/cuda_comm.h, .cpp)."""
    code = "\n".join(line for f in ("cuda_comm.h", "cuda_comm.cpp")
                     for line in code_lines(ROOT / "csrc" / "binding" / f, "//"))
    assert "cudaStreamDestroy" not in code
    assert "give_back_stream(device_, stream_)" in code and "take_stream(device_)" in code


def test_no_record_stream_on_our_streams():
    """Tensors are held until the call's event instead (as TORCH_NCCL_AVOID_RECORD_STREAMS)."""
    offenders = []
    for path in [*sorted((ROOT / "csrc" / "binding").glob("cuda_*")), *sorted((ROOT / "ringreduce").rglob("*.py"))]:
        comment = "#" if path.suffix == ".py" else "//"
        for n, line in enumerate(code_lines(path, comment), 1):
            if re.search(r"\brecord_stream\s*\(", line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_destructors_make_no_cuda_call_while_python_finalizes():
    binding = (ROOT / "csrc" / "binding" / "cuda_comm.cpp").read_text()
    for cls in ("CudaWork::~CudaWork()", "CudaComm::~CudaComm()"):
        body = binding.split(cls, 1)[1].split("\n}\n", 1)[0]
        assert "finalizing()" in body, f"{cls} must check finalizing() first:\n{body}"


def env_worker(rank, world, name):
    return os.environ.get(name), os.getcwd(), os.getpid()


def test_ranks_get_the_callers_environment_and_fresh_processes(monkeypatch, tmp_path):
    """The prefork server (tests/prefork.py) forks ranks from a process started earlier: each rank
    must still see the environment and working directory of the call, and be a process of its own."""
    run_ranks(1, env_worker, "RR_HARNESS_PROBE")  # the server exists before the variable does
    monkeypatch.setenv("RR_HARNESS_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    results = run_ranks(2, env_worker, "RR_HARNESS_PROBE")
    assert [v for v, _, _ in results] == ["set after the server started"] * 2, results
    assert all(cwd == str(tmp_path) for _, cwd, _ in results), results
    assert len({pid for _, _, pid in results} | {os.getpid()}) == 3, results


def settings_worker(rank, world):
    import logging
    import ringreduce as rr
    return rr.is_deterministic(), logging.getLogger("ringreduce").level


def test_ranks_get_the_settings_ringreduce_reads_at_import():
    """The server imported ringreduce before the call's environment existed: what the import read
    (RINGREDUCE_DETERMINISTIC, RINGREDUCE_DEBUG) must come from the call's (on the first GPU run,
    the CUDA deterministic tests ran the default mode and failed)."""
    import logging
    run_ranks(1, settings_worker)  # the server exists
    on = run_ranks(2, settings_worker, env={"RINGREDUCE_DETERMINISTIC": "1", "RINGREDUCE_DEBUG": "1"})
    assert on == [(True, logging.DEBUG)] * 2, on
    off = run_ranks(2, settings_worker, env={"RINGREDUCE_DETERMINISTIC": "0"})
    assert [d for d, _ in off] == [False, False], off


def test_a_reused_pid_does_not_inherit_an_old_exit_code():
    """The prefork server reports ("started", job, pid) and ("exited", pid, code); when the kernel
    gives a new rank the pid of a child that exited earlier in the session, that rank is alive,
    not "exited with status 0 without reporting a result" (a CI failure of session 18)."""
    import threading
    from dist_utils import _Forked, _Server
    from prefork import read_msg, write_msg
    r, w = os.pipe()
    server = object.__new__(_Server)
    server.cond, server.pids, server.exits, server.dead = threading.Condition(), {}, {}, False

    class Out:
        def fileno(self):
            return r

    server.proc = type("P", (), {"stdout": Out()})()
    reader = threading.Thread(target=server._read, args=(read_msg,), daemon=True)
    reader.start()
    write_msg(w, ("started", 0, 4242))
    write_msg(w, ("exited", 4242, 0))   # the first child with that pid ends
    write_msg(w, ("started", 1, 4242))  # a new child gets the same pid
    with server.cond:
        assert server.cond.wait_for(lambda: 1 in server.pids, timeout=10)
    rank = object.__new__(_Forked)
    rank.server, rank.pid = server, 4242
    assert rank.is_alive() and rank.exitcode is None
    write_msg(w, ("exited", 4242, -9))
    rank.join(timeout=10)
    assert rank.exitcode == -9
    os.close(w)
    reader.join(timeout=10)
    assert server.dead
    os.close(r)
