"""Failure behaviour: dead peers, mismatched calls, ranks that never call, setup that never
completes. Every surviving rank must raise RingReduceError within a bound derived from the timeout,
and /dev/shm must hold nothing of ours afterwards."""
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from dist_utils import collect, run_ranks, spawn


pytestmark = pytest.mark.usefixtures("no_shm_leak")  # tests/conftest.py


def raised(fn):
    """(exception class name, message, seconds) of fn()."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, None, time.monotonic() - t0


def victim_worker(rank, world, victim, how, ready_dir, shared=False):
    def ones(n):  # shared: tensors in ringreduce.shared_empty buffers (the pool algorithm)
        return rr.shared_empty(n).fill_(1.0) if shared else torch.ones(n)
    t = ones(1 << 20)
    rr.all_reduce(t)  # communicator set up, every rank alive
    if how == "sigkill_inside_collective":
        t = ones(16 << 20)  # 64 MiB: tens of ms a call, so the kill lands inside one
    if rank == victim:
        if how == "exit_inside_collective":
            threading.Timer(0.2, lambda: os._exit(3)).start()
            while True:
                rr.all_reduce(t)
        open(os.path.join(ready_dir, "ready"), "w").close()
        if how == "sigkill_inside_collective":
            while True:  # killed from outside while the ring runs
                rr.all_reduce(t)
        open(os.path.join(ready_dir, "ready"), "w").close()
        time.sleep(120)  # killed from outside before the next collective
    if how == "sigkill_before_call":
        while not os.path.exists(os.path.join(ready_dir, "ready")):
            time.sleep(0.01)
        time.sleep(0.5)  # the test kills the victim now

    def loop():
        while True:
            rr.all_reduce(t)
    first = raised(loop)
    again = raised(lambda: rr.all_reduce(torch.ones(4)))
    return first, again


@pytest.mark.parametrize("how,algo", [("sigkill_before_call", "auto"),
                                      ("sigkill_inside_collective", "auto"),
                                      ("exit_inside_collective", "auto"),
                                      ("sigkill_inside_collective", "cma"),  # inside a peer read
                                      ("sigkill_inside_collective", "pool")])  # rr.shared_empty
def test_dead_peer(how, algo, tmp_path):
    world, victim = 3, 1
    procs, q, _ = spawn(world, victim_worker, victim, how, str(tmp_path), algo == "pool",
                        env={"RINGREDUCE_TIMEOUT": "60",
                             "RINGREDUCE_ALGO": "auto" if algo == "pool" else algo})
    if how.startswith("sigkill"):
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline, "victim never got ready"
            time.sleep(0.01)
        if how == "sigkill_inside_collective":
            time.sleep(0.3)  # a few 64 MiB calls in
        os.kill(procs[victim].pid, signal.SIGKILL)  # stays a zombie until joined: still "dead"
    results, errors = collect(procs, q, timeout=90, expect=[r for r in range(world) if r != victim])
    assert not errors, errors
    for rank, (first, again) in results.items():
        name, msg, secs = first
        assert name == "RingReduceError", (rank, first)
        assert secs < 10, f"rank {rank} took {secs:.1f} s to notice (timeout 60 s)"
        assert "died" in msg or "aborted" in msg, msg
        assert again[0] == "RingReduceError" and again[2] < 1.0, again  # broken: raises at once


def mismatch_worker(rank, world, kind):
    t = torch.ones(12)
    rr.all_reduce(t)  # a good call first: the communicator exists on every rank

    def call():
        odd = rank == world - 1
        if kind == "numel":
            rr.all_reduce(torch.ones(13 if odd else 12))
        elif kind == "dtype":
            rr.all_reduce(torch.ones(12, dtype=torch.float64 if odd else torch.float32))
        elif kind == "op":
            rr.all_reduce(torch.ones(12), op=dist.ReduceOp.MAX if odd else dist.ReduceOp.SUM)
        else:  # collective
            if odd:
                rr.reduce_scatter_tensor(torch.empty(12 // world), torch.ones(12))
            else:
                rr.all_reduce(torch.ones(12))
    return raised(call)


@pytest.mark.parametrize("kind", ["numel", "dtype", "op", "collective"])
def test_mismatched_calls(kind):
    world = 3
    words = {"numel": "numel=13", "dtype": "float64", "op": "MAX", "collective": "reduce_scatter"}
    for rank, (name, msg, secs) in enumerate(run_ranks(world, mismatch_worker, kind,
                                                       env={"RINGREDUCE_TIMEOUT": "60"})):
        assert name == "RingReduceError", (rank, msg)
        assert "mismatched" in msg and words[kind] in msg, msg
        assert secs < 10


def silent_rank_worker(rank, world, skip_setup):
    if skip_setup:
        if rank == 1:
            time.sleep(4)  # never joins the communicator
            return None
        return raised(lambda: rr.all_reduce(torch.ones(8)))
    rr.all_reduce(torch.ones(8))
    if rank == 1:
        time.sleep(4)  # never makes the second call
        return None
    return raised(lambda: rr.all_reduce(torch.ones(8)))


@pytest.mark.parametrize("skip_setup", [False, True], ids=["in_collective", "in_setup"])
def test_rank_that_never_calls(skip_setup):
    results = run_ranks(3, silent_rank_worker, skip_setup, env={"RINGREDUCE_TIMEOUT": "1.5"})
    for rank, res in enumerate(results):
        if rank == 1:
            continue
        name, msg, secs = res
        assert name == "RingReduceError", msg
        assert "timed out" in msg or "aborted" in msg, msg
        assert 1.0 <= secs < 6, secs
        if skip_setup:  # the setup's timeout carries the later calls' hint
            assert "did every rank make the same call?" in msg, msg


def early_failure_worker(rank, world):
    if rank == 1:  # a bad dtype: fails in the argument check, before any communicator exists
        return raised(lambda: rr.all_reduce(torch.ones(8, dtype=torch.complex64)))
    return raised(lambda: rr.all_reduce(torch.ones(8)))


def test_rank_failing_before_first_call_gets_the_hint():
    """The others time out in setup (waiting for rank 1's host id) and say what usually causes it,
    as later calls' timeouts do (issue 37)."""
    results = run_ranks(3, early_failure_worker, env={"RINGREDUCE_TIMEOUT": "1.5"})
    name, msg, _ = results[1]
    assert name == "TypeError" and "complex64" in msg, msg
    for rank in (0, 2):
        name, msg, secs = results[rank]
        assert name == "RingReduceError", msg
        assert "setup timed out" in msg and "rank 1's host id" in msg, msg
        assert "did every rank make the same call?" in msg and "before its first collective" in msg, msg
        assert 1.0 <= secs < 6, secs


def close_worker(rank, world):
    comm = rr.get_communicator()
    rr.all_reduce(torch.ones(4))
    comm.close()
    comm.close()  # idempotent
    closed = raised(lambda: comm.all_reduce(torch.ones(4), 0, False))
    t = torch.ones(4)
    rr.all_reduce(t)  # a new communicator replaces the closed one
    return closed[0], t[0].item()


def test_close_is_idempotent_and_final():
    for name, value in run_ranks(2, close_worker):
        assert name == "RingReduceError"
        assert value == 2.0


def interrupt_worker(rank, world, outcome_path, queued, api="direct"):
    # Ctrl-C is SIGINT handled by Python's default handler (KeyboardInterrupt). Installed here, not
    # inherited: a process started in the background by a non-interactive shell (`python -m pytest
    # tests &` in a script, some CI runners) inherits SIGINT *ignored*, Python keeps it ignored, and
    # the signal below would be dropped: the call would just complete when the peers call.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if api == "backend":  # dist.* on a ringreduce group: the C++ half runs the calls
        from ringreduce import backend
        all_reduce = dist.all_reduce
        all_reduce(torch.ones(4))  # the ring is up on every rank
        comm = backend.backend_of()._comms["cpu"]
    else:
        all_reduce = rr.all_reduce
        comm = rr.get_communicator()
        all_reduce(torch.ones(4))  # the ring is up on every rank
    if rank != 1:  # call only after rank 1 reported: it is interrupted before anyone else calls
        deadline = time.monotonic() + 120
        while not os.path.exists(outcome_path):
            assert time.monotonic() < deadline, "rank 1 never reported"
            time.sleep(0.01)
        return raised(lambda: all_reduce(torch.ones(4)))
    # Rank 1: Ctrl-C while waiting for peers that have not called yet.
    calls_before = comm._native.op_seq()
    sent = []

    def ctrl_c():
        # Only once this rank is inside the native call (its call counter moves as the call starts;
        # the call cannot end on its own, the peers wait for our report), so the signal always
        # lands in the ring's wait and never in the Python code around it.
        while comm._native.op_seq() == calls_before:
            time.sleep(0.001)
        time.sleep(0.1)  # a moment later, as a user would: blocked in the futex wait by then
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c, daemon=True).start()
    try:
        try:
            if queued:  # an async call waits on the worker; the sync call queues behind it
                all_reduce(torch.ones(4), async_op=True)
            all_reduce(torch.ones(4))
            outcome = "no interrupt"  # (it can end only by the timeout: the peers have not called)
        except KeyboardInterrupt:
            outcome = "KeyboardInterrupt"
        except Exception as e:
            outcome = f"{type(e).__name__}: {e}"
        latency = time.monotonic() - sent[0] if sent else None
        return outcome, latency, comm.broken
    finally:  # report even on failure, so the peers do not wait for nothing
        with open(outcome_path + ".tmp", "w"):
            pass
        os.rename(outcome_path + ".tmp", outcome_path)


@pytest.mark.parametrize("queued,api", [(False, "direct"), (True, "direct"), (False, "backend"),
                                        (True, "backend")],
                         ids=["inline", "queued_behind_async", "backend_inline",
                              "backend_queued_behind_async"])
def test_ctrl_c_interrupts_a_waiting_rank(tmp_path, queued, api):
    """Inline: the native wait polls for signals. Queued: the sync call waits for the async one
    ahead of it (running it itself), where Ctrl-C must land too. Backend: the same through
    dist.all_reduce on a ringreduce group, whose calls the C++ half runs without Python."""
    results = run_ranks(3, interrupt_worker, str(tmp_path / "rank1-done"), queued, api,
                        env={"RINGREDUCE_TIMEOUT": "30"},
                        **({"backend": "ringreduce"} if api == "backend" else {}))
    outcome, latency, broken = results[1]
    assert outcome == "KeyboardInterrupt", results[1]
    assert latency < 2, f"KeyboardInterrupt {latency:.2f} s after SIGINT (the wait checks every 50 ms)"
    assert broken, "the interrupted rank did not abort the group"
    for rank in (0, 2):  # the group is aborted: their call fails at once, naming the reason
        name, msg, secs = results[rank]
        assert name == "RingReduceError" and secs < 1, results[rank]
        assert "interrupted by a signal" in msg, msg
