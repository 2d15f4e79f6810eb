"""Runs a function on N real processes joined by a Gloo process group (file store, no ports)."""
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback


def _entry(rank, world, store_path, fn, args, q, env, backend):
    os.environ.update(env or {})
    import torch.distributed as dist
    import ringreduce
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        result = fn(rank, world, *args)
        q.put((rank, "ok", result))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            ringreduce.destroy()
            dist.destroy_process_group()
        except Exception:
            pass


def spawn(world, fn, *args, env=None, backend="gloo"):
    """Starts the ranks; returns (processes, result queue, store dir) for tests that kill ranks.
    backend: the default group's (ringreduce registers its own on import)."""
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="rr-test-")
    q = ctx.Queue()
    procs = [ctx.Process(target=_entry, daemon=True,
                         args=(r, world, os.path.join(tmp, "store"), fn, args, q, env, backend))
             for r in range(world)]
    for p in procs:
        p.start()
    return procs, q, tmp


def _note_dead(procs, waiting, dead_since, errors):
    """A rank that exited without a result (crash, segfault) is an error now, not at the timeout.
    It gets 2 s after exit for its queued result to arrive."""
    now = time.monotonic()
    for r in waiting:
        code = procs[r].exitcode
        if code is None:
            continue
        if now - dead_since.setdefault(r, now) > 2.0:
            errors[r] = f"rank {r} exited with code {code} without reporting a result"


def collect(procs, q, timeout, expect=None):
    """Results by rank of the ranks in expect (default all); kills everything left at the end."""
    expect = set(range(len(procs)) if expect is None else expect)
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    dead_since = {}
    try:
        while expect - set(results) - set(errors):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(expect - set(results) - set(errors))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout} s; "
                                   f"errors so far: {errors}")
            try:
                rank, status, value = q.get(timeout=min(left, 0.5))
            except queue.Empty:
                _note_dead(procs, expect - set(results) - set(errors), dead_since, errors)
                continue
            (results if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return results, errors


def run_ranks(world, fn, *args, timeout=180, env=None, backend="gloo"):
    """Runs fn(rank, world, *args) on every rank; returns the results in rank order or raises
    with every failing rank's traceback."""
    procs, q, _ = spawn(world, fn, *args, env=env, backend=backend)
    results, errors = collect(procs, q, timeout)
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return [results[r] for r in range(world)]
