"""The public collectives on CPU tensors over real processes (Gloo group for bootstrap)."""
import datetime
import json
import os
import time

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from dist_utils import run_ranks
from reference import DTYPES, OPS, check_close, digest, make_input, reduce_reference


def sweep_worker(rank, world, sizes, dtypes, ops):
    """Every collective x dtype x op x size; returns failures and result digests.

    Every caller checks that all ranks' all_reduce digests are equal, so the reference of each
    all_reduce case is computed on one rank only (cases dealt round robin): building every rank's
    input and reducing them was most of this worker's time, repeated on every rank. Each
    reduce_scatter input is built chunk by chunk, so a rank builds only the chunk its output reduces
    of every peer's input (and its own input whole)."""
    failures, digests = [], []
    case = 0
    for dtype in dtypes:
        for op in ops:
            for numel in sizes:
                tag = f"{dtype} {op} numel={numel} world={world}"
                checker = case % world == rank
                case += 1
                # all_reduce, in place
                ins = [make_input(r, numel, dtype, op, seed=numel) for r in range(world)] \
                    if checker else None
                t = ins[rank].clone() if checker else make_input(rank, numel, dtype, op, seed=numel)
                storage = t.data_ptr()
                rr.all_reduce(t, op=op)
                bad = check_close(t, *reduce_reference(ins, op)) if checker else 0
                if bad or t.data_ptr() != storage:
                    failures.append(f"all_reduce {tag}: {bad} wrong")
                digests.append(digest(t))
                # reduce_scatter_tensor: numel elements per rank; chunk c of rank q's input is
                # make_input(q, numel, ..., seed=rs_seed + c)
                rs_seed = (numel + 1) * (world + 1)
                inp = torch.cat([make_input(rank, numel, dtype, op, seed=rs_seed + c)
                                 for c in range(world)])
                mine = inp.clone()
                out = torch.empty(numel, dtype=dtype)
                rr.reduce_scatter_tensor(out, inp, op=op)
                exp, tol = reduce_reference(
                    [make_input(q, numel, dtype, op, seed=rs_seed + rank) for q in range(world)], op)
                bad = check_close(out, exp, tol)
                if bad or not torch.equal(inp, mine):
                    failures.append(f"reduce_scatter {tag}: {bad} wrong or input modified")
            # all_gather_into_tensor (no op)
            for numel in sizes:
                mine = make_input(rank, numel, dtype, dist.ReduceOp.SUM, seed=7)
                out = torch.empty(numel * world, dtype=dtype)
                rr.all_gather_into_tensor(out, mine)
                exp = torch.cat([make_input(r, numel, dtype, dist.ReduceOp.SUM, seed=7)
                                 for r in range(world)])
                if not torch.equal(out, exp):
                    failures.append(f"all_gather {dtype} numel={numel} world={world}")
    return failures, digests


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_sweep(world):
    sizes = sorted({0, 1, max(world - 1, 0), world + 1, 100003})
    results = run_ranks(world, sweep_worker, sizes, DTYPES, OPS, timeout=300)
    for failures, _ in results:
        assert failures == []
    # every rank ends with bitwise-identical all_reduce results
    for _, digests in results[1:]:
        assert digests == results[0][1]


def test_tiny_slices_force_many_steps():
    """64-byte slices: a 100003-element tensor moves in thousands of pipelined messages."""
    sizes = [0, 1, 2, 4, 5003, 100003]
    results = run_ranks(3, sweep_worker, sizes, (torch.float32, torch.float16, torch.int64),
                        (dist.ReduceOp.SUM, dist.ReduceOp.AVG), timeout=300,
                        env={"RINGREDUCE_SLICE_BYTES": "64"})
    for failures, _ in results:
        assert failures == []
    for _, digests in results[1:]:
        assert digests == results[0][1]


def api_worker(rank, world):
    out = {}
    # async handles: several in flight, completed in order, futures carry the tensors
    ts = [torch.full((1000,), float(rank + i)) for i in range(4)]
    works = [rr.all_reduce(t, async_op=True) for t in ts]
    fut = works[-1].get_future()
    for w in works:
        assert w.wait() is True
        assert w.is_completed()
    out["async"] = [t[0].item() for t in ts]
    out["future_value_is_tensor"] = fut.value()[0] is ts[-1]
    # a synchronous call after async ones runs after them
    t = torch.ones(10)
    w = rr.all_reduce(torch.ones(10_000), async_op=True)
    rr.all_reduce(t)
    w.wait()
    out["after_async"] = t[0].item()
    # non-contiguous tensor: reduced through the view
    base = torch.arange(20, dtype=torch.float32).reshape(4, 5)
    view = base.t()
    rr.all_reduce(view, op=rr.ReduceOp.MAX)
    out["noncontig"] = torch.equal(base, torch.arange(20, dtype=torch.float32).reshape(4, 5))
    col = base[:, 1]
    rr.all_reduce(col)
    out["col"] = base[:, 1].tolist()
    out["col_untouched_rest"] = base[:, 0].tolist()
    # subgroups: evens and odds, each their own ring; the world group still works after
    evens = dist.new_group([r for r in range(world) if r % 2 == 0])
    odds = dist.new_group([r for r in range(world) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    rr.all_reduce(t, group=mine)
    out["subgroup"] = t.item()
    other = odds if rank % 2 == 0 else evens
    t2 = torch.tensor([5.0])
    out["not_member"] = rr.all_reduce(t2, group=other) is None and t2.item() == 5.0
    t = torch.tensor([1.0])
    rr.all_reduce(t)
    out["world_after"] = t.item()
    # in-place reduce_scatter and all_gather (chunk of the other tensor is this rank's)
    buf = torch.arange(world * 3, dtype=torch.float32)
    rr.reduce_scatter_tensor(buf[rank * 3:(rank + 1) * 3], buf)
    out["rs_inplace"] = buf[rank * 3:(rank + 1) * 3].tolist()
    g = torch.zeros(world * 2)
    g[rank * 2:(rank + 1) * 2] = rank
    rr.all_gather_into_tensor(g, g[rank * 2:(rank + 1) * 2])
    out["ag_inplace"] = g.tolist()
    # Work.wait(timeout) while the peers are late: raises, and the call itself still completes
    t = torch.ones(4)
    if rank == 0:
        w = rr.all_reduce(t, async_op=True)
        try:
            w.wait(timeout=datetime.timedelta(seconds=0.2))
            out["wait_timeout"] = "no error"
        except rr.RingReduceError as e:
            out["wait_timeout"] = str(e)
        w.wait()
    else:
        time.sleep(1.5)
        rr.all_reduce(t)
    out["late_result"] = t[0].item()
    return out


def test_api_semantics():
    world = 4
    results = run_ranks(world, api_worker)
    for rank, out in enumerate(results):
        assert out["async"] == [sum(r + i for r in range(world)) for i in range(4)]
        assert out["future_value_is_tensor"]
        assert out["after_async"] == world
        assert out["noncontig"]
        assert out["col"] == [world * v for v in (1.0, 6.0, 11.0, 16.0)]
        assert out["col_untouched_rest"] == [0.0, 5.0, 10.0, 15.0]
        members = [r for r in range(world) if r % 2 == rank % 2]
        assert out["subgroup"] == sum(members)
        assert out["not_member"]
        assert out["world_after"] == world
        assert out["rs_inplace"] == [world * v for v in range(rank * 3, rank * 3 + 3)]
        assert out["ag_inplace"] == [float(r) for r in range(world) for _ in range(2)]
        if rank == 0:
            assert "did not finish within timeout=0.2 s" in out["wait_timeout"], out["wait_timeout"]
        assert out["late_result"] == world


def bad_input_worker(rank, world):
    """Every bad argument: the right exception, a message naming the argument, data untouched."""
    cases = []

    def expect(exc, words, fn, *tensors):
        before = [t.clone() for t in tensors]
        try:
            fn()
        except exc as e:
            msg = str(e)
            ok = all(w in msg for w in words)
            cases.append((ok, msg))
        else:
            cases.append((False, f"no {exc.__name__} for {words}"))
        for b, t in zip(before, tensors):
            if not torch.equal(b, t):
                cases.append((False, f"tensor modified by a refused call {words}"))

    t = torch.ones(8)
    expect(TypeError, ["tensor", "torch.Tensor", "list"], lambda: rr.all_reduce([1, 2]))
    c = torch.ones(4, dtype=torch.complex64)
    expect(TypeError, ["tensor", "complex64"], lambda: rr.all_reduce(c), c)
    b = torch.ones(4, dtype=torch.bool)
    expect(TypeError, ["tensor", "bool"], lambda: rr.all_reduce(b), b)
    m = torch.ones(4, device="meta")
    expect(ValueError, ["tensor", "meta"], lambda: rr.all_reduce(m))
    expect(ValueError, ["op", "BAND"], lambda: rr.all_reduce(t, op=dist.ReduceOp.BAND), t)
    expect(ValueError, ["op"], lambda: rr.all_reduce(t, op="sum"), t)
    out, inp = torch.zeros(3), torch.ones(3 * world + 1)
    expect(ValueError, ["input", "elements", "world size"],
           lambda: rr.reduce_scatter_tensor(out, inp), out, inp)
    out2 = torch.zeros(3, dtype=torch.float64)
    inp2 = torch.ones(3 * world)
    expect(TypeError, ["output", "dtype", "float64", "float32"],
           lambda: rr.reduce_scatter_tensor(out2, inp2), out2, inp2)
    g_out, g_in = torch.zeros(5 * world - 1), torch.ones(5)
    expect(ValueError, ["output_tensor", "elements", "world size"],
           lambda: rr.all_gather_into_tensor(g_out, g_in), g_out, g_in)
    g_in2 = torch.ones(5, dtype=torch.int32)
    g_out2 = torch.zeros(5 * world)
    expect(TypeError, ["output_tensor", "dtype"], lambda: rr.all_gather_into_tensor(g_out2, g_in2),
           g_out2, g_in2)
    # overlapping buffers that are not the in-place layout
    buf = torch.arange(4 * world, dtype=torch.float32)
    expect(ValueError, ["overlaps"],
           lambda: rr.all_gather_into_tensor(buf, buf[1:5]) if world > 1 else
           (_ for _ in ()).throw(ValueError("overlaps")), buf)
    os.environ["RINGREDUCE_TRANSPORT"] = "nccl"
    expect(ValueError, ["RINGREDUCE_TRANSPORT", "CPU"], lambda: rr.all_reduce(t), t)
    os.environ["RINGREDUCE_TRANSPORT"] = "bogus"
    expect(ValueError, ["RINGREDUCE_TRANSPORT", "bogus"], lambda: rr.all_reduce(t), t)
    del os.environ["RINGREDUCE_TRANSPORT"]
    # the communicator is still healthy after refused calls
    t = torch.ones(8)
    rr.all_reduce(t)
    cases.append((t[0].item() == world, "collective after bad inputs"))
    return cases


def test_bad_inputs():
    for cases in run_ranks(2, bad_input_worker):
        for ok, msg in cases:
            assert ok, msg


def test_not_initialized():
    assert not dist.is_initialized()
    t = torch.ones(3)
    with pytest.raises(RuntimeError, match="init_process_group"):
        rr.all_reduce(t)
    assert torch.equal(t, torch.ones(3))
    assert issubclass(rr.RingReduceError, RuntimeError)
    assert rr.ReduceOp is dist.ReduceOp


# RINGREDUCE_ALGO forces one algorithm at every size (one-shot over several slices too);
# RINGREDUCE_STREAM=1 writes every slot of >= 32 KiB with non-temporal stores, 0 never (64 KiB
# slices: the ring's, one-shot's and reduce-scatter's slots).
FORCED = {f"algo={a}": ({"RINGREDUCE_ALGO": a, "RINGREDUCE_SLICE_BYTES": "4096"}, [0, 1, 5, 40000])
          for a in ("ring", "oneshot", "twoshot", "cma")}
FORCED.update({f"stream={s}": ({"RINGREDUCE_STREAM": s, "RINGREDUCE_SLICE_BYTES": "65536"},
                               [1, 70000, 300000]) for s in ("1", "0")})


@pytest.mark.parametrize("forced", sorted(FORCED))
def test_forced_setting(forced):
    """Results exact within the dtype's tolerance and bitwise identical on every rank."""
    env, sizes = FORCED[forced]
    results = run_ranks(3, sweep_worker, sizes, [torch.float32, torch.float16, torch.int32],
                        OPS, timeout=300, env=env)
    for failures, _ in results:
        assert failures == []
    assert results[1][1] == results[0][1] and results[2][1] == results[0][1]


def algo_worker(rank, world):
    from ringreduce import _shm
    rr.all_reduce(torch.ones(4))
    comm = rr.get_communicator()
    # world 2: one-shot up to 1 KiB, the ring above (measured: _shm.ONESHOT_MAX_BYTES_WORLD2)
    out = {"small": comm.algo_for(256, torch.float32), "above": comm.algo_for(257, torch.float32),
           "large": comm.algo_for(1 << 20, torch.float32), "default": comm.algo}
    try:
        _shm.Communicator(dist.new_group(), algo="fastest")
    except ValueError as e:
        out["bad"] = str(e)
    os.environ["RINGREDUCE_STREAM"] = "sometimes"
    try:
        _shm.Communicator(dist.new_group())
    except ValueError as e:
        out["bad_stream"] = str(e)
    del os.environ["RINGREDUCE_STREAM"]
    out["stream_switches"] = comm._native.stream_switches()
    return out


def test_auto_algorithm_choice_and_bad_name():
    for out in run_ranks(2, algo_worker, timeout=120):
        assert (out["small"], out["above"], out["large"]) == ("oneshot", "ring", "ring"), out
        assert out["default"] == "auto"
        assert "algo must be one of auto, ring, oneshot, twoshot, cma, got 'fastest'" in out["bad"], out
        assert "RINGREDUCE_STREAM must be one of auto, 0, 1 (non-temporal stores into shared memory), got 'sometimes'" in out["bad_stream"], out
        assert out["stream_switches"] == 0, out  # 16 B: below the size where copies are timed


def table_worker(rank, world, table):
    os.environ["RINGREDUCE_CPU_TUNING"] = table
    g = dist.new_group()
    t = torch.arange(1 << 19, dtype=torch.float32) * (rank + 1)  # 2 MiB: cma
    rr.all_reduce(t, group=g)
    comm = rr.get_communicator(g)
    picks = {b: comm.algo_for(b // 4, torch.float32) for b in (2048, 2052, 65532, 65536, 1 << 20, 4 << 20)}
    want = torch.arange(1 << 19, dtype=torch.float32) * sum(range(1, world + 1))
    out = {"picks": picks, "tuning": comm.tuning, "steps": comm.auto_steps, "exact": torch.equal(t, want),
           "bits": t.numpy().tobytes()}
    return out


def test_auto_follows_the_measured_table(tmp_path):
    """An entry for this machine (CPU model, cores, world) sets auto's one-shot threshold and its
    algorithm above it; cma runs only after every rank read every peer (here they can)."""
    from ringreduce import _shm
    entry = {"cpu_model": _shm.cpu_model(), "cores": len(os.sched_getaffinity(0)), "world": 2,
             "oneshot_max": 2048, "steps": [[1 << 20, "cma"], [65536, "twoshot"]],
             "date": "test", "command": "test"}
    table = tmp_path / "table.json"
    table.write_text(json.dumps({"entries": [dict(entry, world=3), entry]}))
    a, b = run_ranks(2, table_worker, str(table), timeout=120)
    assert a["picks"] == {2048: "oneshot", 2052: "ring", 65532: "ring", 65536: "twoshot",
                          1 << 20: "cma", 4 << 20: "cma"}, a
    assert a["steps"] == [(65536, "twoshot"), (1 << 20, "cma")], a
    assert a["tuning"].startswith("measured on "), a
    assert a["exact"] and b["exact"] and a["bits"] == b["bits"]


def test_tuning_table_lookup(tmp_path):
    from ringreduce import _shm
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"entries": [
        {"cpu_model": "X", "cores": 2, "world": 2, "oneshot_max": 4096, "steps": [[1 << 20, "cma"]]},
        {"cpu_model": "X", "cores": 2, "world": 4, "oneshot_max": 0, "steps": [[0, "fastest"]]}]}))
    assert _shm.tuned("X", 2, 2, str(table))[:2] == (4096, [(1 << 20, "cma")])
    oneshot_max, steps, why = _shm.tuned("X", 8, 2, str(table))  # another core count: no entry
    assert (oneshot_max, steps) == (None, []) and "no measurement for 'X', 8 cores, world 2" in why
    assert "no table" in _shm.tuned("X", 2, 2, str(tmp_path / "missing.json"))[2]
    with pytest.raises(ValueError, match="must be one of ring, twoshot, cma, cmawhole, got 'fastest'"):
        _shm.tuned("X", 2, 4, str(table))
    assert _shm.without_cma([(1, "twoshot"), (5, "cma")]) == [(1, "twoshot"), (5, "ring")]


def test_shipped_tuning_table_is_valid():
    from ringreduce import _shm
    with open(_shm.TUNING_PATH) as f:
        entries = json.load(f)["entries"]
    assert entries
    for e in entries:
        assert e["cores"] >= 1 and e["world"] >= 2 and e["oneshot_max"] >= 0, e
        assert e["date"] and e["command"] and e["median_us"], e
        oneshot_max, steps, _ = _shm.tuned(e["cpu_model"], e["cores"], e["world"], _shm.TUNING_PATH)
        assert oneshot_max == e["oneshot_max"] and all(b > oneshot_max for b, _ in steps), e


def fast_path_worker(rank, world):
    from ringreduce import collectives
    t = torch.ones(64)
    rr.all_reduce(t)  # the first call takes the full path and fills the fast path's cache
    comm = collectives._fast[None][1]
    fn0 = collectives._fast[None][2]
    full_path_calls = []
    real = comm.all_reduce
    comm.all_reduce = lambda *a: (full_path_calls.append(a), real(*a))[1]
    out = {}
    rr.all_reduce(t)  # fast: the full path is not called
    out["fast_calls"] = len(full_path_calls)
    out["value"] = t[0].item()
    a = torch.ones(16)
    work = rr.all_reduce(a, async_op=True)  # async: the C function queues it, no full path either
    work.wait()
    out["async_fast"] = (len(full_path_calls), type(work).__name__, a[0].item(), work.is_completed(),
                         work.get_future().value()[0] is a)
    view = torch.ones(8, 8).t()  # not contiguous: the full path, still right
    rr.all_reduce(view)
    out["view_ok"] = bool((view == world).all())
    out["entry_kept"] = collectives._fast[None][2] is fn0  # made once per communicator
    p = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    rr.all_reduce(p)  # torch counts Parameter as a plain tensor: fast
    out["param_ok"] = bool((p == world).all())
    out["full_calls"] = len(full_path_calls)
    # Every op through the fast path (the C function matches the ReduceOp objects by identity).
    ops = {}
    for name in ("SUM", "AVG", "MIN", "MAX", "PRODUCT"):
        x = torch.tensor([rank + 1.0, 2.0 * rank - 1.0])
        rr.all_reduce(x, op=getattr(dist.ReduceOp, name))
        ops[name] = x.tolist()
    out["ops"] = ops
    out["ops_fast"] = len(full_path_calls) == 1
    x = torch.full((4,), rank + 1.0)
    rr.all_reduce(x, dist.ReduceOp(dist.ReduceOp.MAX))  # an equal op, not the same object: full path
    out["op_object"] = (x.tolist(), len(full_path_calls))
    # A synchronous narrow-wire call takes the fast path too; an async one, or a tensor the wire
    # does not take, the full path (which raises the API's error).
    w = torch.full((300,), rank + 1.0)
    rr.all_reduce(w, wire_dtype=torch.bfloat16)
    n_full = len(full_path_calls)
    rr.all_reduce(w, op=dist.ReduceOp.AVG, wire_dtype=torch.float8_e4m3fn, async_op=True).wait()
    try:
        rr.all_reduce(torch.ones(3, dtype=torch.int32), wire_dtype=torch.bfloat16)
    except TypeError as e:
        out["wire_int"] = str(e)
    out["wire_fast"] = (n_full, len(full_path_calls), w[0].item())
    fast = collectives._fast[None][2]
    out["fast_fn"] = (fast(x, "sum"), fast([1.0], dist.ReduceOp.SUM))  # not ours: False, untouched
    try:
        fast(x)
    except TypeError as e:
        out["fast_fn_args"] = str(e)
    for bad in (lambda: rr.all_reduce(torch.ones(2, dtype=torch.complex64)),
                lambda: rr.all_reduce(t, op="sum")):
        try:
            bad()
        except (TypeError, ValueError) as e:
            out.setdefault("errors", []).append(str(e))
    rr.destroy()  # a closed communicator is never used again: the next call makes a new one
    out["dropped"] = None not in collectives._fast
    # A group's entry goes with its communicator, so destroying the group frees it (its Gloo threads
    # and sockets) at once, not at interpreter exit.
    import gc, weakref
    g = dist.new_group(backend="gloo")
    rr.all_reduce(torch.ones(3), group=g)
    rr.all_reduce(torch.ones(3), group=g)  # through the fast path
    ref, cached = weakref.ref(g), g in collectives._fast
    rr.destroy(g)
    dist.destroy_process_group(g)
    del g
    gc.collect()
    out["group_freed"] = (cached, ref() is None)
    t2 = torch.ones(5)
    rr.all_reduce(t2)
    out["after_destroy"] = t2.tolist()
    out["new_comm"] = collectives._fast[None][1] is not comm
    return out


def test_fast_path_is_taken_and_falls_back():
    for out in run_ranks(2, fast_path_worker, timeout=120):
        assert out["fast_calls"] == 0 and out["value"] == 4.0, out
        assert out["async_fast"] == (0, "Work", 2.0, True, True), out
        assert out["view_ok"] and out["param_ok"] and out["full_calls"] == 1, out
        assert out["entry_kept"], out
        assert out["ops"] == {"SUM": [3.0, 0.0], "AVG": [1.5, 0.0], "MIN": [1.0, -1.0],
                              "MAX": [2.0, 1.0], "PRODUCT": [2.0, -1.0]}, out
        assert out["ops_fast"] and out["op_object"] == ([2.0] * 4, 2), out
        assert out["fast_fn"] == (False, False), out
        assert "takes (tensor, op[, async_op[, wire_dtype]]), got 1 arguments" in out["fast_fn_args"], out
        # the wire: the sync call fast (the count stays 2), the async one full (3); the sum 1 + 2
        assert out["wire_fast"] == (2, 3, 3.0), out
        assert "wire_dtype" in out["wire_int"], out
        assert len(out["errors"]) == 2, out
        assert "dtype torch.complex64" in out["errors"][0], out
        assert "op must be ReduceOp.SUM" in out["errors"][1], out
        assert out["after_destroy"] == [2.0] * 5 and out["new_comm"], out
        assert out["dropped"] and out["group_freed"] == (True, True), out
