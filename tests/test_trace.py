"""The flight recorder and its analyzer (python -m ringreduce.trace), on real processes: what every
call records, the dump written on failure, SIGUSR1 dumps, and the analyzer's first line for the
failures users meet (a desync, a rank killed in a call, a rank stuck outside ringreduce), on the
flat shared-memory ring and the hierarchical plan (two simulated hosts)."""
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
import ringreduce.trace
from dist_utils import collect, run_ranks, spawn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def analyze(path, *extra, cli=False):
    """(exit status, output lines) of the analyzer: its main() in this process, or with cli=True
    python -m ringreduce.trace (a process that imports torch: ~3 s, so one test does it)."""
    if not cli:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = ringreduce.trace.main([str(path), *extra])
        return status, out.getvalue().splitlines()
    p = subprocess.run([sys.executable, "-m", "ringreduce.trace", str(path), *extra],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, p.stdout.splitlines()


def dumps_in(folder):
    return sorted(str(p) for p in folder.rglob("rank*.json"))


def _simulated_hosts(rank, hier):
    if hier:  # two simulated hosts of two ranks: the hierarchical plan
        os.environ["RINGREDUCE_HOST_ID"] = f"host{rank // 2}"


def calls_worker(rank, world):
    """Every kind of call, from every source; returns this rank's dump."""
    t = torch.ones(100)
    rr.all_reduce(t)                                                   # 1 api, sync
    rr.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True).wait()       # 2 api, async
    rr.reduce_scatter_tensor(torch.empty(8), torch.ones(8 * world))    # 3
    rr.all_gather_into_tensor(torch.empty(6 * world, dtype=torch.float64),
                              torch.ones(6, dtype=torch.float64))      # 4
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    model.register_comm_hook(None, rr.ddp.allreduce_hook)
    model(torch.ones(3, 4)).sum().backward()                           # 5 ddp_hook
    torch.ops.ringreduce.all_reduce_(torch.ones(5), 0, dist.group.WORLD.group_name)  # 6 op
    files = rr.dump_trace()
    with open(files[0]) as f:
        return json.load(f)


def test_records_every_call(tmp_path):
    world = 2
    results = run_ranks(world, calls_worker, env={"RINGREDUCE_TRACE_DIR": str(tmp_path)})
    for rank, d in enumerate(results):
        assert d["version"] == 1 and d["rank"] == rank and d["world_size"] == world
        assert d["transport"] == "shm" and d["members"] == [0, 1] and d["pid"] > 0
        assert d["calls"] == 6 and d["dropped"] == 0 and d["waiting"] is None
        e = d["entries"]
        assert [x["seq"] for x in e] == [1, 2, 3, 4, 5, 6]
        assert [x["coll"] for x in e] == ["all_reduce", "all_reduce", "reduce_scatter",
                                          "all_gather", "all_reduce", "all_reduce"]
        assert [x["source"] for x in e] == ["api", "api", "api", "api", "ddp_hook", "op"]
        assert (e[0]["numel"], e[0]["dtype"], e[0]["op"], e[0]["bytes"]) == (100, "float32", "SUM", 400)
        assert e[1]["op"] == "MAX"
        assert (e[2]["numel"], e[3]["numel"], e[3]["dtype"]) == (16, 12, "float64")
        assert e[4]["numel"] == 4 * 2 + 2 and e[4]["op"] == "AVG"
        for x in e:
            assert x["state"] == "finished", x
            assert 0 < x["queued_us"] <= x["started_us"] <= x["ended_us"] <= d["time_us"], x
    status, lines = analyze(tmp_path, cli=True)
    assert status == 0 and lines[0].startswith("OK: 2 of 2 ranks agree on 6 calls"), lines


def backend_worker(rank, world):
    pg = dist.new_group(backend="ringreduce")
    t = torch.ones(64)
    dist.all_reduce(t, group=pg)  # the first call makes the communicator (through Python)
    dist.all_reduce(t, group=pg)  # then the C++ half
    dist.all_reduce(t, group=pg, async_op=True).wait()
    files = rr.dump_trace(group=pg)
    with open(files[0]) as f:
        return json.load(f)


def test_records_backend_calls(tmp_path):
    for d in run_ranks(2, backend_worker, env={"RINGREDUCE_TRACE_DIR": str(tmp_path)}):
        assert [x["source"] for x in d["entries"]] == ["backend"] * 3, d["entries"]
        assert all(x["state"] == "finished" for x in d["entries"])


def off_worker(rank, world):
    rr.all_reduce(torch.ones(4))
    return rr.get_communicator().recorder.on, json.loads(rr.get_communicator().recorder.json())


def test_buffer_size_and_off(tmp_path):
    for on, d in run_ranks(2, off_worker, env={"RINGREDUCE_TRACE_BUFFER": "0"}):
        assert not on and d["entries"] == [] and d["capacity"] == 0
    # A small buffer keeps the newest calls and says how many it dropped.
    for d in run_ranks(2, wrap_worker, env={"RINGREDUCE_TRACE_BUFFER": "3"}):
        assert [x["seq"] for x in d["entries"]] == [5, 6, 7] and d["dropped"] == 4, d


def wrap_worker(rank, world):
    for _ in range(7):
        rr.all_reduce(torch.ones(4))
    return json.loads(rr.get_communicator().recorder.json())


def bad_env_worker(rank, world):
    try:
        rr.all_reduce(torch.ones(4))
    except ValueError as e:
        return str(e)
    return None


def test_bad_buffer_size_is_a_clear_error():
    for msg in run_ranks(2, bad_env_worker, env={"RINGREDUCE_TRACE_BUFFER": "-1"}):
        assert msg and "RINGREDUCE_TRACE_BUFFER must be an integer >= 0" in msg and "-1" in msg, msg


# -- failures: the dump every surviving rank writes, and the analyzer's diagnosis ----------------

def desync_worker(rank, world, hier, skip):
    _simulated_hosts(rank, hier)
    for _ in range(2):
        rr.all_reduce(torch.ones(16))
    try:
        if skip and rank == 1:  # skips call #3 and goes on to the next one, an all_gather
            rr.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4))
        else:
            rr.all_reduce(torch.ones(16 if rank != world - 1 or skip else 32))
    except rr.RingReduceError as e:
        return str(e)
    return None


@pytest.mark.parametrize("hier", [False, True], ids=["flat", "hier"])
@pytest.mark.parametrize("skip", [False, True], ids=["numel", "skipped_call"])
def test_desync_named(tmp_path, hier, skip):
    world = 4 if hier else 3
    errors = run_ranks(world, desync_worker, hier, skip,
                       env={"RINGREDUCE_TRACE_DIR": str(tmp_path), "RINGREDUCE_TIMEOUT": "10"})
    for rank, msg in enumerate(errors):
        assert msg and "flight recorder: " in msg, (rank, msg)
        path = msg.split("flight recorder: ")[1].split(" ")[0]
        assert os.path.exists(path), path
    status, lines = analyze(tmp_path)
    odd = 1 if skip else world - 1
    want = "all_gather(numel=" if skip else "all_reduce(numel=32, float32, SUM)"
    assert status == 1
    assert lines[0].startswith(f"DESYNC in call #3: rank {odd} called {want}"), lines


def killed_worker(rank, world, hier, marker):
    _simulated_hosts(rank, hier)
    for _ in range(2):
        rr.all_reduce(torch.ones(1024))
    if rank == 1:
        open(marker, "w").close()
    else:
        time.sleep(1.0)  # rank 1 waits in call #3 when it is killed
    try:  # 4 MiB: the ring, which needs every rank to the end (one-shot would not miss rank 1)
        rr.all_reduce(torch.ones(1 << 20))
    except rr.RingReduceError as e:
        return str(e)
    return None


@pytest.mark.parametrize("hier", [False, True], ids=["flat", "hier"])
def test_killed_rank_named(tmp_path, hier):
    world, victim = (4, 1) if hier else (3, 1)
    marker = tmp_path / "in-call"
    procs, q, _ = spawn(world, killed_worker, hier, str(marker),
                        env={"RINGREDUCE_TRACE_DIR": str(tmp_path / "trace"), "RINGREDUCE_TIMEOUT": "30"})
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, "rank 1 never reached its call"
        time.sleep(0.01)
    time.sleep(0.3)
    os.kill(procs[victim].pid, signal.SIGKILL)
    results, errors = collect(procs, q, timeout=60, expect=[r for r in range(world) if r != victim])
    assert not errors, errors
    assert all(msg and "flight recorder: " in msg for msg in results.values()), results
    status, lines = analyze(tmp_path / "trace")
    assert status == 1
    assert lines[0].startswith(f"rank {victim} died in call #3 all_reduce(numel=1048576"), lines


def sleeper_worker(rank, world, hier, ready_dir):
    _simulated_hosts(rank, hier)
    for _ in range(2):
        rr.all_reduce(torch.ones(256))
    open(os.path.join(ready_dir, f"ready{rank}"), "w").close()
    if rank == 2:
        time.sleep(120)  # stuck outside ringreduce: the test kills it
        return None
    rr.all_reduce(torch.ones(256))  # waits for rank 2 until the test kills the job
    return None


@pytest.mark.parametrize("hier", [False, True], ids=["flat", "hier"])
def test_signal_dump_finds_the_rank_stuck_outside(tmp_path, hier):
    world = 4 if hier else 3
    trace = tmp_path / "trace"
    procs, q, _ = spawn(world, sleeper_worker, hier, str(tmp_path),
                        env={"RINGREDUCE_TRACE_DIR": str(trace), "RINGREDUCE_TRACE_SIGNAL": "1",
                             "RINGREDUCE_TIMEOUT": "120"})
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready*"))) < world:
            assert time.monotonic() < deadline, "ranks never got ready"
            time.sleep(0.01)
        time.sleep(1.0)  # the others are waiting in call #3 by now
        for p in procs:
            os.kill(p.pid, signal.SIGUSR1)
        want = world * (2 if hier else 1)  # the hierarchical plan's own ring records too
        while len(dumps_in(trace)) < want:
            assert time.monotonic() < deadline, dumps_in(trace)
            time.sleep(0.05)
        time.sleep(0.2)
        status, lines = analyze(trace)
        assert status == 1
        first = lines[0]
        assert first.startswith("rank 2 never entered call #3 all_reduce(numel=256"), lines
        assert "its main thread was in sleeper_worker at test_trace.py" in first, first
        # where the others wait: the ring's step and peer (under the hierarchical plan, in the
        # report of the host's own ring, whose calls are the plan's steps)
        assert any("is in call #" in ln and "s for a message from rank" in ln for ln in lines), lines
        stacks = list((trace / "stacks").glob("*.txt"))
        assert len(stacks) == world and all(s.stat().st_size > 0 for s in stacks)
    finally:
        for p in procs:
            p.kill()
            p.join()


def test_chrome_trace_and_plot(tmp_path):
    run_ranks(2, calls_worker, env={"RINGREDUCE_TRACE_DIR": str(tmp_path / "trace")})
    status, lines = analyze(tmp_path / "trace", "--chrome", str(tmp_path / "out.json"))
    assert status == 0, lines
    with open(tmp_path / "out.json") as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == 12 and {e["pid"] for e in spans} == {0, 1}
    for e in events:  # the Trace Event Format's required fields, with their types
        assert isinstance(e["name"], str) and e["ph"] in ("X", "M")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "X":
            assert isinstance(e["ts"], float) and isinstance(e["dur"], float) and e["dur"] >= 0
            assert {"seq", "numel", "dtype", "bytes", "source", "state"} <= set(e["args"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p = subprocess.run([sys.executable, "-m", "ringreduce.trace", str(tmp_path / "trace"),
                            "--plot", str(tmp_path / "t.png")], capture_output=True, text=True,
                           cwd=REPO)
        assert p.returncode != 0 and "needs matplotlib" in p.stderr, p.stderr
    else:
        status, _ = analyze(tmp_path / "trace", "--plot", str(tmp_path / "t.png"))
        assert status == 0 and (tmp_path / "t.png").stat().st_size > 1000


def default_folder_worker(rank, world, temp):
    """A run whose dumps go to the default folder, ringreduce-trace in the temp dir (temp here)."""
    tempfile.tempdir = temp
    rr.all_reduce(torch.ones(8))
    return rr.dump_trace()[0]


def fake_runs(folder, n):
    """n run folders named as a communicator names them, oldest first (a minute apart)."""
    paths = []
    for i in range(n):
        run = folder / f"ringreduce-shm-0-1-0.20260101-10{i:02d}00-abcdef"
        run.mkdir(parents=True)
        (run / "rank0.json").write_text("{}")
        os.utime(run, (1_700_000_000 + 60 * i,) * 2)
        paths.append(run)
    return paths


def test_default_trace_folder_keeps_recent_runs(tmp_path, capsys, monkeypatch):
    """The default folder keeps the TRACE_KEEP most recent runs, this one included, and leaves
    what it did not name alone; a RINGREDUCE_TRACE_DIR folder keeps every run."""
    from ringreduce import _lifecycle
    default = tmp_path / "ringreduce-trace"
    old = fake_runs(default, 25)
    (default / "stacks").mkdir()
    (default / "notes.20260101-100000-abcdef.txt").write_text("a file, not a run folder")
    files = run_ranks(2, default_folder_worker, str(tmp_path))
    assert files[0] == files[1].replace("rank1", "rank0")
    new = os.path.dirname(files[0])
    keep = _lifecycle.TRACE_KEEP
    assert keep == ringreduce.trace.TRACE_KEEP
    assert sorted(os.listdir(default)) == sorted(
        [p.name for p in old[-(keep - 1):]] + [os.path.basename(new), "stacks",
                                               "notes.20260101-100000-abcdef.txt"])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the analyzer's default folder
    status, _ = analyze(new)
    assert status == 0
    assert f"{default} keeps the {keep} most recent runs" in capsys.readouterr().err
    mine = tmp_path / "mine"
    old = fake_runs(mine, 25)
    run_ranks(2, default_folder_worker, str(tmp_path), env={"RINGREDUCE_TRACE_DIR": str(mine)})
    assert len(os.listdir(mine)) == 26 and all(p.exists() for p in old)
    status, _ = analyze(mine)
    assert "keeps the" not in capsys.readouterr().err


def test_analyzer_rejects_what_it_cannot_read(tmp_path):
    (tmp_path / "rank0.json").write_text('{"version": 99, "rank": 0}')
    p = subprocess.run([sys.executable, "-m", "ringreduce.trace", str(tmp_path)],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode not in (0, 1) and "version 99" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "ringreduce.trace", str(tmp_path / "none")],
                       capture_output=True, text=True, cwd=REPO)
    assert p.returncode not in (0, 1) and "no such file" in p.stderr, p.stderr


def straggler_worker(rank, world):
    for _ in range(12):
        if rank == 2:
            time.sleep(0.02)  # arrives last at every call, ~20 ms late
        rr.all_reduce(torch.ones(64))
    rr.dump_trace()


def test_straggler_attributed(tmp_path):
    run_ranks(3, straggler_worker, env={"RINGREDUCE_TRACE_DIR": str(tmp_path)})
    status, lines = analyze(tmp_path)
    assert status == 0 and lines[0].startswith("OK: 3 of 3 ranks agree on 12 calls"), lines
    line = next(ln for ln in lines if "stragglers:" in ln)
    m = __import__("re").search(r"rank (\d) arrived last in (\d+) of 12 calls, ([0-9.]+) ms late", line)
    assert m and m.group(1) == "2" and int(m.group(2)) >= 10, line
    assert 10 <= float(m.group(3)) <= 200, line


def profiled_ddp_worker(rank, world, hier):
    _simulated_hosts(rank, hier)
    from torch.profiler import ProfilerActivity, profile
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256), torch.nn.Linear(256, 4)),
        bucket_cap_mb=0.25)
    buckets = []

    def hook(state, bucket):
        buckets.append(bucket.index())
        return rr.ddp.allreduce_hook(state, bucket)
    model.register_comm_hook(None, hook)
    x = torch.ones(8, 256)
    model(x).sum().backward()  # the first step (DDP rebuilds its buckets after it)
    buckets.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    top = [e for e in prof.events() if e.name == "ringreduce::all_reduce"]
    return len(buckets), len(top)


@pytest.mark.parametrize("hier", [False, True], ids=["flat", "hier"])
def test_profiled_ddp_step_one_range_per_bucket(hier):
    for buckets, ranges in run_ranks(4 if hier else 2, profiled_ddp_worker, hier):
        assert buckets >= 2 and ranges == buckets, (buckets, ranges)


# -- the analyzer on written dumps (no processes): what a two-rank desync is called --------------

def _entry(seq, coll="all_reduce", numel=16, dtype="float32", op="SUM", state="finished"):
    return {"seq": seq, "coll": coll, "numel": numel, "dtype": dtype, "op": op, "algo": "ring",
            "bytes": numel * 4, "source": "api", "state": state, "queued_us": 1000 * seq,
            "started_us": 1000 * seq + 1, "ended_us": 1000 * seq + 2 if state == "finished" else 0}


def _write_dumps(folder, calls):
    """One dump per rank: two matching calls, then call #3 as calls[rank] (kwargs of _entry)."""
    for rank, third in enumerate(calls):
        d = {"version": 1, "rank": rank, "world_size": len(calls), "communicator": "c", "job": "j",
             "transport": "shm", "host": "h", "pid": 100 + rank, "pids": [100, 101],
             "time_us": 10_000, "calls": 3, "dropped": 0, "waiting": None,
             "entries": [_entry(1), _entry(2), _entry(3, state="started", **third)]}
        (folder / f"rank{rank}.json").write_text(json.dumps(d))


@pytest.mark.parametrize("calls, want", [
    ([{}, {"numel": 32}], "the same collective (all_reduce) with different numel: "
                          "rank 0 all_reduce(numel=16, float32, SUM); rank 1 all_reduce(numel=32"),
    ([{}, {"dtype": "float64", "op": "MAX"}], "the same collective (all_reduce) with different "
                                               "dtype / op: "),
    ([{"coll": "all_gather"}, {"coll": "all_gather", "numel": 8, "op": "MAX"}],
     "the same collective (all_gather) with different numel: "),  # all_gather has no op
    ([{}, {"coll": "reduce_scatter"}], "different collectives: rank 0 all_reduce(numel=16"),
])
def test_two_rank_desync_says_what_differs(tmp_path, calls, want):
    """No majority (two ranks): a numel, dtype or op mismatch of one collective is not called
    "different collectives" (issue 37)."""
    _write_dumps(tmp_path, calls)
    status, lines = analyze(tmp_path)
    assert status == 1
    assert lines[0].startswith(f"DESYNC in call #3: the ranks called {want}"), lines
