"""ringreduce as a torch.distributed backend (ringreduce/backend.py, csrc/binding/backend.cpp), on the CPU
with real processes: every collective through dist.* against exact or float64 references, which
ops the ring serves and which go to the Gloo delegate, real clients (DDP without a hook, FSDP2,
object collectives) against the same code on Gloo, and failures."""
import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dist_utils import collect, run_ranks, spawn
from reference import DTYPES, OPS, check_close, digest, make_input, reduce_reference

BACKEND = "ringreduce"


pytestmark = pytest.mark.usefixtures("no_shm_leak")  # tests/conftest.py


def calls(group=None):
    from ringreduce import backend
    return dict(backend.backend_of(group).calls)


def collectives_worker(rank, world):
    failures, digests = [], []
    for dtype in DTYPES:
        for op in OPS:
            for numel in (0, 1, world + 1, 1000):
                ins = [make_input(r, numel, dtype, op, seed=numel) for r in range(world)]
                t = ins[rank].clone()
                dist.all_reduce(t, op=op)
                exp, tol = reduce_reference(ins, op)
                if check_close(t, exp, tol):
                    failures.append(f"all_reduce {dtype} {op} {numel}")
                digests.append(digest(t))
        n = 7
        ins = [make_input(r, n * world, dtype, dist.ReduceOp.SUM, seed=3) for r in range(world)]
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, ins[rank])
        exp, tol = reduce_reference(ins, dist.ReduceOp.SUM)
        if check_close(out, exp[rank * n:(rank + 1) * n], None if tol is None else
                       tol[rank * n:(rank + 1) * n]):
            failures.append(f"reduce_scatter_tensor {dtype}")
        lst = [torch.empty(n, dtype=dtype) for _ in range(world)]
        dist.reduce_scatter(lst[0], [ins[rank][r * n:(r + 1) * n] for r in range(world)])
        if check_close(lst[0], exp[rank * n:(rank + 1) * n], None if tol is None else
                       tol[rank * n:(rank + 1) * n]):
            failures.append(f"reduce_scatter (list) {dtype}")
        mine = make_input(rank, n, dtype, dist.ReduceOp.SUM, seed=4)
        everyone = torch.cat([make_input(r, n, dtype, dist.ReduceOp.SUM, seed=4)
                              for r in range(world)])
        big = torch.empty(n * world, dtype=dtype)
        dist.all_gather_into_tensor(big, mine)
        dist.all_gather(lst, mine)
        if not torch.equal(big, everyone) or not torch.equal(torch.cat(lst), everyone):
            failures.append(f"all_gather {dtype}")
    # several tensors of one dtype in one ring pass
    ts = [torch.full((5,), float(rank)), torch.full((3, 2), float(rank + 1))]
    dist.all_reduce_coalesced(ts)
    if not (torch.all(ts[0] == sum(range(world))) and torch.all(ts[1] == sum(range(1, world + 1)))):
        failures.append("all_reduce_coalesced")
    # async handles and their futures (DDP reads the future)
    t = torch.full((100,), float(rank))
    work = dist.all_reduce(t, async_op=True)
    value = work.get_future().wait()
    if not (work.wait() and work.is_completed() and value[0] is not None
            and torch.all(value[0] == sum(range(world)))):
        failures.append("async all_reduce / future")
    return failures, digests, calls()


def test_collectives_on_the_ring():
    world = 3
    results = run_ranks(world, collectives_worker, backend=BACKEND, timeout=300)
    for rank, (failures, _, _) in enumerate(results):
        assert not failures, f"rank {rank}: {failures[:10]}"
    for rank, (_, digests, _) in enumerate(results[1:], start=1):
        assert digests == results[0][1], f"rank {rank}: all_reduce results differ from rank 0's"
    used = results[0][2]
    assert not any(k.startswith("delegate") for k in used), used  # all of it on the ring
    for op in ("allreduce", "_reduce_scatter_base", "reduce_scatter", "_allgather_base",
               "allgather", "allreduce_coalesced"):
        assert used.get("ring " + op), (op, used)


def cpp_path_worker(rank, world):
    """After the first call (Python creates the communicator), the C++ half runs the ring calls:
    sync and async interleaved, non-contiguous tensors, the list and coalesced forms."""
    from ringreduce import backend
    impl = backend.backend_of()
    failures = []
    total = sum(range(1, world + 1))
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)  # creates the communicator (through Python)
    python_first = dict(impl._calls)
    # async calls queued, a sync call behind them, then the waits in reverse order
    ts = [torch.full((1000 + i,), float((rank + 1) * (i + 1))) for i in range(6)]
    works = [dist.all_reduce(x, async_op=True) for x in ts]
    last = torch.full((3,), float(rank + 1))
    dist.all_reduce(last)  # runs after the six queued ones, on every rank
    seen = []
    works[0].get_future().then(lambda f: seen.append(f.value()[0][0].item()))
    for w in reversed(works):
        w.wait()
    for i, x in enumerate(ts):
        if not torch.all(x == total * (i + 1)):
            failures.append(f"async #{i}: {x[:3].tolist()}")
    if not torch.all(last == total):
        failures.append(f"sync after async: {last.tolist()}")
    if seen != [float(total)]:
        failures.append(f"future callback saw {seen}")
    # a non-contiguous view: reduced through a contiguous copy, written back through the view
    m = torch.full((4, 6), float(rank + 1))
    col = m[:, 2]
    dist.all_reduce(col, op=dist.ReduceOp.MAX)
    expect = torch.full((4, 6), float(rank + 1))
    expect[:, 2] = world
    if not torch.equal(m, expect):
        failures.append(f"non-contiguous all_reduce: {m.tolist()}")
    out = torch.empty(6, 2)[:, 0]  # non-contiguous output
    dist.reduce_scatter_tensor(out, torch.arange(6.0 * world) + rank)
    want = (torch.arange(6.0 * world) * world + sum(range(world)))[rank * 6:(rank + 1) * 6]
    if not torch.equal(out, want):
        failures.append(f"reduce_scatter_tensor into a view: {out.tolist()}")
    big = torch.empty(world * 3, dtype=torch.int64)
    work = dist.all_gather_into_tensor(big, torch.full((3,), rank, dtype=torch.int64), async_op=True)
    work.wait()
    if big.tolist() != [r for r in range(world) for _ in range(3)]:
        failures.append(f"all_gather_into_tensor async: {big.tolist()}")
    lst = [torch.empty(2, 2) for _ in range(world)]
    dist.all_gather(lst, torch.full((2, 2), float(rank)))
    if [x[0, 0].item() for x in lst] != [float(r) for r in range(world)]:
        failures.append(f"all_gather (list): {[x.tolist() for x in lst]}")
    mine = torch.empty(3)
    dist.reduce_scatter(mine, [torch.full((3,), float(r + rank)) for r in range(world)])
    if not torch.all(mine == world * rank + sum(range(world))):
        failures.append(f"reduce_scatter (list): {mine.tolist()}")
    gathered = [torch.empty(world * 2) for _ in range(2)]
    scattered = [torch.empty(2) for _ in range(2)]
    with dist._coalescing_manager(async_ops=True) as cm:  # *_tensor_coalesced: one Work
        for i, o in enumerate(gathered):
            dist.all_gather_into_tensor(o, torch.full((2,), float(rank + 10 * i)))
    cm.wait()
    with dist._coalescing_manager() as cm:
        for i, o in enumerate(scattered):
            dist.reduce_scatter_tensor(o, torch.full((2 * world,), float(rank + i)))
    for i, o in enumerate(gathered):
        if o.tolist() != [float(r + 10 * i) for r in range(world) for _ in range(2)]:
            failures.append(f"allgather_into_tensor_coalesced #{i}: {o.tolist()}")
    for i, o in enumerate(scattered):
        if o.tolist() != [float(sum(range(world)) + world * i)] * 2:
            failures.append(f"reduce_scatter_tensor_coalesced #{i}: {o.tolist()}")
    parts = [torch.full((2,), float(rank)), torch.full((2, 3), 1.0)]
    dist.all_reduce_coalesced(parts)
    if not (torch.all(parts[0] == sum(range(world))) and torch.all(parts[1] == world)):
        failures.append("all_reduce_coalesced")
    cpp = dict(impl.slot.counts())
    return failures, python_first, dict(impl._calls), cpp


def test_ring_calls_run_in_cpp():
    """The first ring call creates the communicator through Python; every later one on CPU
    tensors runs in the C++ half (issue 27), in the order made, with the same results."""
    world = 3
    for rank, (failures, first, python, cpp) in enumerate(
            run_ranks(world, cpp_path_worker, backend=BACKEND, timeout=300)):
        assert not failures, (rank, failures)
        assert first == {"ring allreduce": 1}, first
        assert python == first, python  # nothing else went through Python
        assert cpp == {"ring allreduce": 8, "ring _reduce_scatter_base": 1,
                       "ring _allgather_base": 1, "ring allreduce_coalesced": 1,
                       "ring allgather": 1, "ring reduce_scatter": 1,
                       "ring allgather_into_tensor_coalesced": 1,
                       "ring reduce_scatter_tensor_coalesced": 1}, cpp


def delegated_worker(rank, world):
    out = {}
    t = torch.full((4,), float(rank))
    dist.broadcast(t, src=1)
    out["broadcast"] = t.tolist()
    dist.barrier()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    out["all_gather_object"] = objs
    lst = [rank * 10] if rank == 0 else [None]
    dist.broadcast_object_list(lst, src=0)
    out["broadcast_object_list"] = lst
    if rank == 0:
        dist.send(torch.full((3,), 7.0), dst=1)
    elif rank == 1:
        r = torch.empty(3)
        dist.recv(r, src=0)
        out["recv"] = r.tolist()
    g = [torch.empty(2) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), g, dst=0)
    if rank == 0:
        out["gather"] = [x.tolist() for x in g]
    s = torch.empty(2)
    dist.scatter(s, [torch.full((2,), float(r)) for r in range(world)] if rank == 0 else None, src=0)
    out["scatter"] = s.tolist()
    red = torch.full((2,), float(rank + 1))
    dist.reduce(red, dst=0)
    if rank == 0:
        out["reduce"] = red.tolist()
    a2a = torch.empty(world)
    dist.all_to_all_single(a2a, torch.arange(world, dtype=torch.float32) + 10 * rank)
    out["all_to_all_single"] = a2a.tolist()
    # what the ring does not serve: another dtype, another op
    b = torch.tensor([rank == 0, False])
    dist.all_reduce(b)  # bool (SUM is OR): Gloo's
    out["bool"] = b.tolist()
    i = torch.tensor([0b110 | rank], dtype=torch.int32)
    dist.all_reduce(i, op=dist.ReduceOp.BAND)
    out["band"] = i.item()
    out["calls"] = calls()
    return out


def test_everything_else_is_delegated():
    world = 3
    results = run_ranks(world, delegated_worker, backend=BACKEND, timeout=300)
    for rank, out in enumerate(results):
        assert out["broadcast"] == [1.0] * 4
        assert out["all_gather_object"] == [{"rank": r} for r in range(world)]
        assert out["broadcast_object_list"] == [0]
        assert out["scatter"] == [float(rank)] * 2
        assert out["all_to_all_single"] == [float(r * 10 + rank) for r in range(world)]
        assert out["bool"] == [True, False]
        assert out["band"] == 0b110
        used = out["calls"]
        for op in ("broadcast", "barrier", "alltoall_base", "scatter", "gather", "reduce"):
            assert used.get("delegate " + op), (op, used)
        assert used.get("delegate allreduce") == 2, used  # bool and BAND, nothing else
    assert results[1]["recv"] == [7.0] * 3
    assert results[0]["gather"] == [[float(r)] * 2 for r in range(world)]
    assert results[0]["reduce"] == [float(sum(range(1, world + 1)))] * 2


def groups_worker(rank, world):
    out = {}
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])  # inherits ringreduce
    gloo = dist.new_group(backend="gloo")
    if rank % 2 == 0:
        t = torch.full((10,), float(rank))
        dist.all_reduce(t, group=evens)
        out["evens"] = t[0].item()
        out["evens_backend"] = dist.get_backend(evens)
        out["evens_ring"] = calls(evens).get("ring allreduce", 0)
    t = torch.ones(3)
    dist.all_reduce(t, group=gloo)
    out["gloo"] = t[0].item()
    out["default_backend"] = dist.get_backend()
    return out


def test_subgroups_and_per_group_backends():
    world = 4
    for rank, out in enumerate(run_ranks(world, groups_worker, backend=BACKEND, timeout=180)):
        assert out["gloo"] == world and out["default_backend"] == BACKEND
        if rank % 2 == 0:
            assert out["evens"] == 2.0 and out["evens_backend"] == BACKEND
            assert out["evens_ring"] == 1


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def clients_worker(rank, world):
    """The same training on the ringreduce default group and on a Gloo group, side by side."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import DeviceMesh
    from torch.nn.parallel import DistributedDataParallel as DDP
    gloo = dist.new_group(backend="gloo")
    out = {}
    ours, ref = DDP(_model(), bucket_cap_mb=0.002), DDP(_model(), bucket_cap_mb=0.002,
                                                       process_group=gloo)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, ref)]
    for step in range(4):
        x, y = _batch(rank, step)
        for m, o in zip((ours, ref), opts):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in (ours, ref)]
    out["ddp_diff"] = (flat[0] - flat[1]).abs().max().item()
    out["ddp_digest"] = digest(flat[0])
    out["ddp_ring_calls"] = calls().get("ring allreduce", 0)
    # FSDP2: reduce-scatter of gradients and all-gather of parameters
    models = []
    for mesh in (DeviceMesh.from_group(dist.group.WORLD, "cpu"), DeviceMesh.from_group(gloo, "cpu")):
        m = _model()
        for layer in (m[0], m[2], m[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        o = torch.optim.SGD(m.parameters(), lr=0.05)
        for step in range(3):
            x, y = _batch(rank, step)
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
        models.append(torch.cat([p.full_tensor().reshape(-1) for p in m.parameters()]))
    out["fsdp_diff"] = (models[0] - models[1]).abs().max().item()
    out["fsdp_calls"] = {k: v for k, v in calls().items() if "gather" in k or "scatter" in k}
    # a metric, parameters from rank 0, a barrier
    loss = torch.tensor([float(rank)])
    dist.all_reduce(loss, op=dist.ReduceOp.AVG)
    out["metric"] = loss.item()
    return out


def test_ddp_and_fsdp2_match_gloo():
    """Unmodified DDP (no hook) and FSDP2 train the same model on the ringreduce backend and on a
    Gloo group: the same parameters up to float32 rounding of sums in another order (1e-6), the
    same bits on every rank."""
    world = 3
    results = run_ranks(world, clients_worker, backend=BACKEND, timeout=300)
    for rank, out in enumerate(results):
        assert out["ddp_diff"] < 1e-6, (rank, out["ddp_diff"])
        assert out["fsdp_diff"] < 1e-6, (rank, out["fsdp_diff"])
        assert out["ddp_ring_calls"] > 4, out  # DDP's buckets went through the ring
        fsdp = out["fsdp_calls"]  # FSDP2's gathers and scatters went through the ring
        assert fsdp and all(k.startswith("ring") for k in fsdp), fsdp
        assert out["metric"] == pytest.approx(sum(range(world)) / world)
        assert out["ddp_digest"] == results[0]["ddp_digest"]


def mismatch_worker(rank, world, async_op):
    dist.all_reduce(torch.ones(12))
    t0 = time.monotonic()
    try:
        work = dist.all_reduce(torch.ones(13 if rank == world - 1 else 12), async_op=async_op)
        if async_op:
            work.wait()
        return "no error", "", time.monotonic() - t0
    except RuntimeError as e:
        return type(e).__name__, str(e), time.monotonic() - t0


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_mismatched_calls_raise_on_every_rank(async_op):
    """Sync: the direct API's RingReduceError, raised by the call. Async: Work.wait() raises the
    same (a RuntimeError subclass; the Work completes from C++ with the ring's own error)."""
    for rank, (name, msg, secs) in enumerate(run_ranks(3, mismatch_worker, async_op,
                                                       backend=BACKEND,
                                                       env={"RINGREDUCE_TIMEOUT": "30"})):
        assert name == "RingReduceError", (rank, name, msg)
        assert "mismatched collective calls" in msg and "numel=13" in msg, (rank, msg)
        assert secs < 10, secs


def timeout_worker(rank, world):
    """A subgroup's timeout (init_process_group / new_group timeout=) is the ring's timeout."""
    g = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=2))
    dist.all_reduce(torch.ones(4), group=g)
    if rank == 1:
        time.sleep(6)  # never makes the second call in time
        return None
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4), group=g)
        return "no error", time.monotonic() - t0
    except RuntimeError as e:
        return str(e), time.monotonic() - t0


def test_group_timeout_is_the_ring_timeout():
    results = run_ranks(3, timeout_worker, backend=BACKEND, timeout=120)
    for rank in (0, 2):
        msg, secs = results[rank]
        assert ("timed out after 2 s" in msg or "aborted" in msg) and 1.5 < secs < 6, (rank, msg, secs)


def dead_worker(rank, world):
    dist.all_reduce(torch.ones(1 << 16))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(1000):
            dist.all_reduce(torch.ones(1 << 16))
        return "no error", time.monotonic() - t0
    except RuntimeError as e:
        return str(e), time.monotonic() - t0


def test_dead_rank():
    procs, q, _ = spawn(3, dead_worker, env={"RINGREDUCE_TIMEOUT": "60"}, backend=BACKEND)
    results, errors = collect(procs, q, timeout=120, expect=[0, 2])
    assert not errors, errors
    for rank, (msg, secs) in results.items():
        assert ("died" in msg or "aborted" in msg) and secs < 10, (rank, msg, secs)


def bad_input_worker(rank, world):
    out = {}
    try:  # a dtype neither the ring nor the Gloo delegate serves: Gloo's error, at the call
        dist.all_reduce(torch.ones(4, dtype=torch.float8_e4m3fn))
        out["dtype"] = "no error"
    except Exception as e:
        out["dtype"] = f"{type(e).__name__}: {e}"
    try:
        dist.all_gather_into_tensor(torch.empty(5), torch.ones(2))
        out["sizes"] = "no error"
    except Exception as e:
        out["sizes"] = f"{type(e).__name__}: {e}"
    t = torch.ones(4)
    dist.all_reduce(t)  # the group still works
    out["after"] = t[0].item()
    return out


def test_bad_input():
    for out in run_ranks(2, bad_input_worker, backend=BACKEND):
        assert "float8_e4m3fn" in out["dtype"] and "ProcessGroupGloo delegate refused" in \
            out["dtype"], out
        assert "output_tensor has 5 elements" in out["sizes"], out
        assert out["after"] == 2.0


def profiler_worker(rank, world):
    """torch.profiler sees ringreduce's calls as named ranges with their shapes, whichever way
    they are made (direct API sync, fast path, async; the backend's C++ path sync and async)."""
    import ringreduce as rr
    from torch.profiler import ProfilerActivity, profile
    t = torch.ones(6, 2)
    dist.all_reduce(t)  # the backend's communicator exists
    rr.all_reduce(t)  # and the direct API's
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        rr.all_reduce(t)  # fast path
        rr.all_reduce(t, async_op=True).wait()
        rr.all_reduce(t[:, 0])  # full path (a view)
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        out = torch.empty(world * 3)
        dist.all_gather_into_tensor(out, torch.ones(3))
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * world))
    names = {}
    shapes = set()
    for e in prof.events():
        if e.name.startswith("ringreduce::"):
            names[e.name] = names.get(e.name, 0) + 1
            if e.name == "ringreduce::all_reduce":
                shapes.add(str(e.input_shapes))
    return names, sorted(shapes)


def test_profiler_ranges():
    for rank, (names, shapes) in enumerate(run_ranks(2, profiler_worker, backend=BACKEND)):
        assert names == {"ringreduce::all_reduce": 5, "ringreduce::all_gather": 1,
                         "ringreduce::reduce_scatter": 1}, (rank, names)
        assert "[[6, 2]]" in shapes and "[[6]]" in shapes, (rank, shapes)
