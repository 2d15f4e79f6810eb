"""dist.shrink_group on the ringreduce backend (issue 84): real processes, a rank killed by SIGKILL
(in each phase of a call, or between calls), the survivors shrink and go on. The store is a TCPStore
this test process holds, as torchrun's agent holds one (a FileStore deletes its file once as many
store objects as the world size were destroyed: shrinking clones and destroys them, and the
survivors then lose each other's keys), except where the test is the store's holder being lost."""
import glob
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from dist_utils import collect, spawn
from test_failures import raised


def _shm_files():
    return set(glob.glob("/dev/shm/*ringreduce*")) | set(glob.glob("/dev/shm/rr*"))


def _wait_file(path, limit=60):
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _victim_loop(coll, t):
    """The call a rank is killed inside: all_reduce (either phase), or one phase alone."""
    k = dist.get_world_size()
    if coll == "reduce_scatter":
        out = torch.empty(t.numel() // k)
        return lambda: dist.reduce_scatter_tensor(out, t)
    if coll == "all_gather":
        big = torch.empty(t.numel() * k)
        return lambda: dist.all_gather_into_tensor(big, t)
    return lambda: dist.all_reduce(t)


def shrink_worker(rank, world, victims, when, ready_dir, flags, hosts=None):
    """Every rank runs the ring; the victims are killed (by the test) between calls or inside
    `when` (a collective); the survivors shrink the default group and check the new group on the
    backend and the direct API. hosts: each rank's host id (simulated hosts: the two-level plan)."""
    if hosts:
        os.environ["RINGREDUCE_HOST_ID"] = hosts[rank]
    n = 3 << 18 if when == "between" else 3 << 20  # divisible by 3 and 4 (reduce-scatter)
    t = torch.ones(n)
    dist.all_reduce(t)  # the backend's communicator, every rank alive
    rr.all_reduce(t)  # and the direct API's
    old = dist.group.WORLD
    call = _victim_loop(when, t)
    if rank in victims:
        open(os.path.join(ready_dir, f"ready{rank}"), "w").close()
        if when == "between":
            time.sleep(300)
        while True:  # killed inside a call
            call()
    if when == "between":
        for v in victims:
            _wait_file(os.path.join(ready_dir, f"ready{v}"))
        time.sleep(0.3)  # the test kills the victims now
        call = _victim_loop("all_reduce", t)
    failed = raised(lambda: [call() for _ in range(10 ** 6)])
    t0 = time.monotonic()
    new = dist.shrink_group(sorted(victims), shrink_flags=flags)
    shrink_s = time.monotonic() - t0
    survivors = [r for r in range(world) if r not in victims]
    me = survivors.index(rank)
    out = {"failed": failed, "shrink_s": shrink_s, "rank": dist.get_rank(), "size":
           dist.get_world_size(), "new_is_world": new is dist.group.WORLD}
    # the backend: the ring (sync and async), a delegated op, a barrier
    x = torch.full((1000,), float(me + 1))
    dist.all_reduce(x)
    out["backend_sum"] = x[0].item()
    x = torch.full((1001,), float(me + 1))
    dist.all_reduce(x, async_op=True).wait()
    out["async_sum"] = x[-1].item()
    b = torch.tensor([float(me)])
    dist.broadcast(b, src=len(survivors) - 1)
    out["broadcast"] = b.item()
    dist.barrier()
    g = torch.empty(len(survivors) * 3)
    dist.all_gather_into_tensor(g, torch.full((3,), float(me)))
    out["gathered"] = g[::3].tolist()
    # the direct API on the new default group, no further call
    y = torch.full((1 << 16,), float(me + 1))
    rr.all_reduce(y)
    out["direct_sum"] = y[0].item()
    out["stale"] = raised(lambda: rr.all_reduce(torch.ones(4), group=old))[:2]
    return out


@pytest.fixture
def tcp_store():  # one per test: torch's keys of one group must not meet another's
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield f"127.0.0.1:{store.port}"


def _env(tcp_store, **more):
    return dict({"RINGREDUCE_TIMEOUT": "60", "RR_TEST_TCP_STORE": tcp_store}, **more)


def _run(tcp_store, tmp_path, world, victims, when, flags=0, hosts=None):
    before = _shm_files()
    procs, q, _ = spawn(world, shrink_worker, victims, when, str(tmp_path), flags, hosts,
                        backend="ringreduce", env=_env(tcp_store))
    for v in victims:
        _wait_file(str(tmp_path / f"ready{v}"))
    time.sleep(0.05 if when == "between" else 0.3)
    for v in victims:
        os.kill(procs[v].pid, signal.SIGKILL)
    survivors = [r for r in range(world) if r not in victims]
    results, errors = collect(procs, q, timeout=120, expect=survivors, check_exit=True)
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in errors.items())
    k = len(survivors)
    for rank, out in results.items():
        me = survivors.index(rank)
        assert out["failed"][0] == "RingReduceError", out
        assert out["failed"][2] < 10, f"rank {rank} took {out['failed'][2]:.1f} s to notice (timeout 60 s)"
        assert out["rank"] == me and out["size"] == k and out["new_is_world"], out
        assert out["backend_sum"] == out["async_sum"] == out["direct_sum"] == k * (k + 1) / 2, out
        assert out["broadcast"] == k - 1 and out["gathered"] == list(range(k)), out
        assert out["stale"][0] == "RingReduceError" and "was shrunk" in out["stale"][1], out
        assert out["shrink_s"] < 5, out
    assert _shm_files() <= before, _shm_files() - before
    return results


PHASE = {"reduce_scatter": "reduce-scatter", "all_gather": "all-gather"}


@pytest.mark.parametrize("when,victims,world", [
    ("between", [2], 3),
    ("all_reduce", [1], 3),
    ("reduce_scatter", [1], 3),  # the victim dies inside the reduce-scatter phase
    ("all_gather", [2], 3),      # inside the all-gather phase
    ("between", [0, 3], 4),      # two at once, rank 0 among them (the file store outlives it)
])
def test_shrink_after_a_lost_rank(when, victims, world, tmp_path, tcp_store):
    results = _run(tcp_store, tmp_path, world, victims, when)
    if when in PHASE:  # the survivors' failed call says where the victim died
        assert any(PHASE[when] in out["failed"][1] for out in results.values()), results


def test_shrink_with_abort_and_across_hosts(tmp_path, tcp_store):
    """Two simulated hosts of two ranks (the two-level plan); rank 3 dies; the three survivors
    (hosts of 2 and 1: the leaders plan) shrink with SHRINK_ABORT."""
    _run(tcp_store, tmp_path, 4, [3], "all_reduce", flags=dist.distributed_c10d.SHRINK_ABORT,
         hosts=["h0", "h0", "h1", "h1"])
