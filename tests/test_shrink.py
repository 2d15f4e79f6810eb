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


def disagree_worker(rank, world, ready_dir):
    t = torch.ones(3 << 16)
    dist.all_reduce(t)
    if rank == 3:
        open(os.path.join(ready_dir, "ready3"), "w").close()
        time.sleep(300)  # killed by the test
    _wait_file(os.path.join(ready_dir, "ready3"))
    time.sleep(0.3)
    raised(lambda: [dist.all_reduce(t) for _ in range(10 ** 6)])
    if rank == 1:  # never calls shrink_group: its peers must not wait past the timeout
        time.sleep(12)
        return None
    excluded = [1, 3] if rank == 2 else [3]
    return raised(lambda: dist.shrink_group(excluded))


def test_shrink_with_disagreeing_lists(tmp_path, tcp_store):
    """Rank 2 excludes [1, 3], rank 0 [3], rank 1 never calls: every caller raises, naming why."""
    procs, q, _ = spawn(4, disagree_worker, str(tmp_path), backend="ringreduce",
                        env=_env(tcp_store, RINGREDUCE_TIMEOUT="8"))
    _wait_file(str(tmp_path / "ready3"))
    time.sleep(0.1)
    os.kill(procs[3].pid, signal.SIGKILL)
    results, errors = collect(procs, q, timeout=120, expect=[0, 1, 2], check_exit=True)
    assert not errors, errors
    pair = ("rank 2 excludes ranks [1, 3] but rank 0 excludes [3]",
            "rank 0 excludes ranks [3] but rank 2 excludes [1, 3]")
    for rank in (0, 2):  # each sees the other's list, or the other's refusal naming both, at once
        name, msg, secs = results[rank]
        assert name == "RingReduceError" and "shrink_group refused" in msg, results[rank]
        assert any(p in msg for p in pair), results[rank]
        assert secs < 8, results[rank]


def store_lost_worker(rank, world, ready_dir):
    t = torch.ones(3 << 16)
    dist.all_reduce(t)
    if rank == 0:
        open(os.path.join(ready_dir, "ready0"), "w").close()
        time.sleep(300)  # killed by the test, and the store it holds with it
    _wait_file(os.path.join(ready_dir, "ready0"))
    time.sleep(0.3)
    failed = raised(lambda: [dist.all_reduce(t) for _ in range(10 ** 6)])
    return failed[0], raised(lambda: dist.shrink_group([0]))


def test_shrink_refused_when_the_store_holder_is_lost(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, q, _ = spawn(3, store_lost_worker, str(tmp_path), backend="ringreduce",
                        env={"RINGREDUCE_TIMEOUT": "20", "RR_TEST_TCP_STORE": f"127.0.0.1:{port}:rank0"})
    _wait_file(str(tmp_path / "ready0"))
    time.sleep(0.1)
    os.kill(procs[0].pid, signal.SIGKILL)
    results, errors = collect(procs, q, timeout=120, expect=[1, 2], check_exit=True)
    assert not errors, errors
    for rank, (failed, (name, msg, secs)) in results.items():
        assert failed == "RingReduceError", results
        assert name == "RingReduceError" and "rendezvous store cannot be reached" in msg, (rank, msg)
        assert secs < 20, (rank, secs)


def abort_worker(rank, world, ready_dir, flags):
    t = torch.ones(3 << 18)
    dist.all_reduce(t)
    if rank == 2:
        open(os.path.join(ready_dir, "ready2"), "w").close()
        time.sleep(300)  # stopped (SIGSTOP: alive, so no one sees it die), then killed
    _wait_file(os.path.join(ready_dir, "stopped"))
    work = dist.all_reduce(t, async_op=True)  # waits on the stopped rank
    time.sleep(0.5)
    t0 = time.monotonic()
    dist.shrink_group([2], shrink_flags=flags)
    shrink_s = time.monotonic() - t0
    x = torch.ones(7)
    dist.all_reduce(x)
    return shrink_s, raised(work.wait)[:2], x[0].item()


@pytest.mark.parametrize("flags", [1, 0], ids=["SHRINK_ABORT", "SHRINK_DEFAULT"])
def test_shrink_abort_ends_calls_in_flight(flags, tmp_path, tcp_store):
    """A rank that hangs alive (SIGSTOP) is excluded while the survivors' call waits on it:
    SHRINK_ABORT ends that call at once; SHRINK_DEFAULT waits for it, here until the timeout."""
    procs, q, _ = spawn(3, abort_worker, str(tmp_path), flags, backend="ringreduce",
                        env=_env(tcp_store, RINGREDUCE_TIMEOUT="6"))
    try:
        _wait_file(str(tmp_path / "ready2"))
        os.kill(procs[2].pid, signal.SIGSTOP)
        (tmp_path / "stopped").touch()
        results, errors = collect(procs, q, timeout=120, expect=[0, 1], check_exit=True)
    finally:
        procs[2].kill()  # collect killed it already, unless it raised first
    assert not errors, errors
    for rank, (shrink_s, (name, msg), total) in results.items():
        assert total == 2.0, results
        assert name is not None and "SHRINK_ABORT" in msg if flags else "timed out" in msg, msg
        assert shrink_s < 3 if flags else shrink_s > 4, (rank, shrink_s)


def _batch(step, rank, world, b=8):
    """The step's samples of a rank: the same rule whatever the world (as DistributedSampler's
    shards are re-cut for the survivors)."""
    g = torch.Generator().manual_seed(1000 * step + 17)
    x = torch.randn(world * b, 16, generator=g)
    y = x.sum(dim=1, keepdim=True).sin()
    return x[rank * b:(rank + 1) * b], y[rank * b:(rank + 1) * b]


def ddp_worker(rank, world, mode, victim, kill_step, state_path, steps, bucketer):
    """mode "shrink": DDP (or GradientBucketer) at world ranks, the victim SIGKILLs itself at
    kill_step, the survivors find the lost rank, shrink, re-wrap and redo the step. mode "fresh":
    the same training started at kill_step on world ranks from the state saved before it."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = 0
    if mode == "fresh":
        state = torch.load(state_path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = kill_step

    def wrap():
        if bucketer:
            return model, rr.GradientBucketer(model.parameters())
        ddp = DDP(model)
        ddp.register_comm_hook(None, rr.ddp.allreduce_hook)
        return ddp, None
    net, buckets = wrap()
    losses, shrinks = {}, []
    while step < steps:
        if mode == "shrink" and step == kill_step:
            if rank == 0:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, state_path)
            dist.barrier()
            if rank == victim:
                os.kill(os.getpid(), signal.SIGKILL)
        x, y = _batch(step, dist.get_rank(), dist.get_world_size())
        try:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            if buckets is not None:
                buckets.wait()
            opt.step()
        except RuntimeError as e:  # RingReduceError, or DDP's error carrying its message
            t0 = time.monotonic()
            if bucketer:  # the two steps rr.shrink_group takes, by hand
                lost = rr.lost_ranks(wait=5.0)
                dist.shrink_group(lost)
            else:
                lost = dist.get_process_group_ranks(dist.group.WORLD)
                rr.shrink_group()
                lost = sorted(set(lost) - set(dist.get_process_group_ranks(dist.group.WORLD)))
            if buckets is None:
                del net  # its reducer's hooks go with it
                net, buckets = wrap()
            shrinks.append((str(e).splitlines()[0][:200], lost, time.monotonic() - t0))
            continue  # the failed step again, on the survivors
        losses[step] = loss.item().hex()
        step += 1
    digest = [p.detach().clone() for p in model.parameters()]
    pools = len({line.split()[-2] for line in open("/proc/self/maps") if "ringreduce-pool" in line})
    return losses, shrinks, [d.sum().item().hex() for d in digest], (
        pools, len(buckets.buckets) if buckets is not None else None)


@pytest.mark.parametrize("bucketer", [False, True], ids=["ddp_hook", "bucketer"])
def test_ddp_goes_on_at_n_minus_1(bucketer, tmp_path, tcp_store):
    """Deterministic mode: from the shrink on, the survivors' losses and parameters equal, bit for
    bit, a run that starts at N-1 from the same step's state."""
    state = str(tmp_path / "state.pt")
    env = _env(tcp_store, RINGREDUCE_DETERMINISTIC="1")
    procs, q, _ = spawn(3, ddp_worker, "shrink", 1, 3, state, 7, bucketer, backend="ringreduce",
                        env=env)
    shrunk, errors = collect(procs, q, timeout=180, expect=[0, 2], check_exit=True)
    assert not errors, errors
    for rank, (losses, shrinks, _, (pools, nbuckets)) in shrunk.items():
        assert len(shrinks) == 1 and shrinks[0][1] == [1], (rank, shrinks)
        assert shrinks[0][2] < 3, shrinks  # the dead pid seen on this machine: no 5 s wait
        assert sorted(losses) == list(range(7)), losses
        if bucketer:  # the old group's shared buffers are gone; the new group's (2 ranks) mapped
            assert pools == 2 * nbuckets, (rank, pools, nbuckets)
    assert shrunk[0][2] == shrunk[2][2]  # the same parameters on every survivor
    procs, q, _ = spawn(2, ddp_worker, "fresh", None, 3, state, 7, bucketer, backend="ringreduce",
                        env=dict(env, RR_TEST_TCP_STORE=""))
    fresh, errors = collect(procs, q, timeout=180, check_exit=True)
    assert not errors, errors
    for old, new in ((0, 0), (2, 1)):  # the survivors, renumbered
        after = {s: v for s, v in shrunk[old][0].items() if s >= 3}
        assert after == fresh[new][0], (old, after, fresh[new][0])
        assert shrunk[old][2] == fresh[new][2]
