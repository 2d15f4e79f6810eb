"""The benchmark CLI (python -m ringreduce.bench) on CPU ranks: output, JSON, plots, checks, flags.

Each CLI run starts its own ranks; sizes are tiny and worlds small so the file stays within about
two minutes on a 2-core machine. No assertion is made on speed.
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest
import torch

from ringreduce.bench import cli, data, header, report

RUN_TIMEOUT = 240
ROW_FIELDS = {"collective", "backend", "nranks", "size_bytes", "count", "dtype", "op", "inplace",
              "time_us", "algbw_GBps", "busbw_GBps", "wrong", "iters", "agg_iters", "time_us_min",
              "time_us_max", "time_us_q1", "time_us_q3"}
MACHINE_FIELDS = {"cpu_model", "cpu_cores", "memory_bytes", "python", "torch", "ringreduce",
                  "cuda", "gpu_name", "nccl_version"}
RUN_FIELDS = {"nranks", "device", "machine", "backends", "notes", "peak_membw_GBps",
              "membw_method", "rows", "summary"}


def bench(*args, timeout=RUN_TIMEOUT, cwd=None, results=False):
    env = {k: v for k, v in os.environ.items()  # never mistaken for a torchrun rank
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    # The results folder (its plots take seconds) only where a test looks at it; then in the
    # current folder, never the checkout.
    extra = [] if results else ["--no-results"]
    return subprocess.run([sys.executable, "-m", "ringreduce.bench", *args, *extra],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd or tempfile.mkdtemp())


def parse_rows(stdout):
    """Data rows of the table: every non-empty line that does not start with '#'."""
    rows = []
    for line in stdout.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split()
        assert len(f) == 13, f"malformed row: {line!r}"
        rows.append({"size": int(f[0]), "count": int(f[1]), "type": f[2], "redop": f[3],
                     "backend": f[4],
                     "oop": (float(f[5]), float(f[6]), float(f[7]), f[8]),
                     "ip": (float(f[9]), float(f[10]), float(f[11]), f[12])})
    return rows


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = bench("--quick", "--nranks", "2,3", "--json", str(out / "r.json"),
                "--plot", str(out / "r.png"), cwd=out, results=True)
    return res, out


def test_quick_says_what_it_ran_and_left_out(quick_run):
    res, _ = quick_run
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert lines[0].startswith("# load average at start: ") and lines[0].endswith(
        f"(1, 5, 15 min) on {cli.cores()} cores"), lines[0]
    end = [i for i, line in enumerate(lines) if line.startswith("# load average at end: ")]
    last_row = max(i for i, line in enumerate(lines) if line.strip() and line[0] != "#")
    assert len(end) == 1 and end[0] > last_row, lines[-8:]
    legend = section(lines, "# backends:")
    for label in ("ringreduce/shm", "torch/gloo", "torch/ringreduce", "ps/gloo"):
        assert any(line.split()[1] == label and header.legend(label).split()[0] in line
                   for line in legend), (label, legend)
    left = {line.split()[1]: line for line in section(lines, "# left out:")
            if not line.startswith("#    ")}  # a label's first line, not its continuation
    if not torch.cuda.is_available():
        assert left["torch/nccl"].split()[2:] == ["no", "GPU"], left
    assert {"torch/nccl", "mpi", "deepspeed/shm"} <= set(left), left
    assert ("# note: 3 ranks on 2 cores" in res.stdout) == (cli.cores() == 2), res.stdout[:2000]
    assert all(len(line) <= header.WIDTH for line in legend)


def test_quick_results_folder(quick_run):
    """Without --results the run writes bench-results/<date>-<time>/ in the current folder and
    names it on its last line: the JSON, the markdown summary and the plots."""
    res, out = quick_run
    last = res.stdout.splitlines()[-1]
    assert last.startswith("# results: bench-results" + os.sep), last
    folder = out / last.split()[2]
    assert folder.parent == out / cli.RESULTS_ROOT
    assert last.endswith("(results.json, summary.md, busbw.png, time_vs_n.png)"), last
    doc = json.loads((folder / "results.json").read_text())
    assert [run["rows"] for run in doc["runs"]] == \
        [run["rows"] for run in json.loads((out / "r.json").read_text())["runs"]]
    start, end = doc["load_average"]["start"], doc["load_average"]["end"]
    assert len(start) == 3 and len(end) == 3 and min(start + end) >= 0
    assert doc["load_average"]["other_cores"] >= 0  # issue 83: CPU time, the bench's own aside
    assert doc["load_average"]["other_how"] == "CPU time from /proc"
    assert f"# other work during the run: {doc['load_average']['other_cores']:.2f} cores" in res.stdout
    assert "torch/nccl" in dict(doc["left_out"]) and "ps/gloo" in doc["legend"]
    for name in ("busbw.png", "time_vs_n.png"):
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (folder / "summary.md").read_text()
    for run in doc["runs"]:  # every in-place time, as printed, in its collective's table
        for r in run["rows"]:
            if not r["inplace"]:
                continue
            table = md[md.index(f"## {r['collective']}, {run['nranks']} ranks: time (us)"):]
            cols = table.splitlines()[2].strip("| ").split(" | ")
            row = next(line for line in table.splitlines()
                       if line.startswith(f"| {report.human(r['size_bytes'])} |"))
            assert row.strip("| ").split(" | ")[cols.index(r["backend"])] == \
                f"{r['time_us']:.1f} ({r['time_us_q1']:.1f} - {r['time_us_q3']:.1f})"
            assert r["time_us_min"] <= r["time_us_q1"] <= r["time_us"] <= r["time_us_q3"] <= r["time_us_max"]
    assert "Wrong elements in total: 0." in md


def section(lines, title):
    """The indented lines under a header title ("#   label  text")."""
    out = []
    for line in lines[lines.index(title) + 1:]:
        if not line.startswith("#   "):
            break
        out.append(line)
    return out


def test_default_rank_count_fits_the_cores():
    if torch.cuda.is_available():
        pytest.skip("the CPU default (with a GPU the ranks follow the GPUs)")
    a = cli.parse_args([])
    assert a.nranks == [min(cli.DEFAULT_RANKS_CPU, max(2, cli.cores()))]
    assert header.oversubscribed(a) is None or cli.cores() < 2
    more = cli.parse_args(["--nranks", f"2,{cli.cores() + 1}"])
    note = header.oversubscribed(more)
    assert note.startswith(f"{cli.cores() + 1} ranks on {cli.cores()} cores: "), note


def test_quick_table_parses_and_is_right(quick_run):
    res, _ = quick_run
    assert res.returncode == 0, res.stderr[-3000:]
    rows = parse_rows(res.stdout)
    # 2 worlds x 3 sizes (1K, 8K, 64K) x (all_reduce: 6 backends (ringreduce/shm, ringreduce/ring,
    # ringreduce/oneshot, torch/gloo, torch/ringreduce, ps/gloo); reduce_scatter and all_gather: 4,
    # the forced algorithms being all-reduce only)
    assert len(rows) == 2 * 3 * (6 + 4 + 4)
    assert {r["backend"] for r in rows} == {"ringreduce/shm", "ringreduce/ring", "ringreduce/oneshot",
                                            "torch/gloo", "torch/ringreduce", "ps/gloo"}
    assert "ringreduce/oneshot skips reduce_scatter" in res.stdout
    for r in rows:
        assert r["type"] == "float"
        assert r["redop"] in ("sum", "none")
        assert r["size"] == r["count"] * 4
        for t, algbw, busbw, wrong in (r["oop"], r["ip"]):
            assert wrong == "0", r
            assert t > 0 and algbw >= 0 and busbw >= 0  # printed with 3 decimals
    assert "Out of bounds values : 0 OK" in res.stdout
    assert "peak memory bandwidth" in res.stdout
    assert "[bench]" in res.stderr  # progress lines


def test_quick_json_fields(quick_run):
    res, out = quick_run
    doc = json.loads((out / "r.json").read_text())
    assert {"command", "args", "machine", "runs"} <= set(doc)
    assert MACHINE_FIELDS <= set(doc["machine"])
    assert doc["machine"]["torch"] == torch.__version__
    assert [run["nranks"] for run in doc["runs"]] == [2, 3]
    for run in doc["runs"]:
        assert RUN_FIELDS <= set(run)
        assert run["peak_membw_GBps"] > 0
        assert {"avg_busbw_GBps", "time_ratios_inplace"} <= set(run["summary"])
        n = run["nranks"]
        for row in run["rows"]:
            assert ROW_FIELDS <= set(row)
            assert row["wrong"] == 0
            factor = 2 * (n - 1) / n if row["collective"] == "all_reduce" else (n - 1) / n
            assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor)
            assert row["algbw_GBps"] == pytest.approx(row["size_bytes"] / row["time_us"] / 1e3)


def test_quick_plots_written(quick_run):
    res, out = quick_run
    for name in ("r.png", "r_vs_n.png"):
        png = out / name
        assert png.exists() and png.stat().st_size > 1000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("dtype,op,agg", [("half", "prod", "1"), ("int32", "avg", "1"),
                                          ("bfloat16", "max", "1"), ("float", "sum", "3"),
                                          ("half", "prod", "3")])
def test_other_types_and_ops_check_clean(dtype, op, agg):
    res = bench("--quick", "--nranks", "2", "-e", "8K", "-d", dtype, "-o", op, "-m", agg)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = parse_rows(res.stdout)
    assert rows and all(r["oop"][3] == "0" and r["ip"][3] == "0" for r in rows)
    if op == "avg" and dtype == "int32":  # torch has no integer avg: only all_gather runs there
        assert "no integer avg" in res.stdout  # (Gloo's); the ring has one, on either API
        assert {r["backend"] for r in rows if r["redop"] == "avg"} == {
            "ringreduce/shm", "ringreduce/ring", "ringreduce/oneshot", "torch/ringreduce"}


def test_wire_rows_checked_and_tabled(tmp_path):
    """--wire: the wire rows and torch's compress rows run, check clean against their own
    tolerance, carry max_err in the JSON, and the last table lists them; float16 under -o sum is
    skipped with its reason; a corrupted wire row is counted."""
    out = tmp_path / "w.json"
    res = bench("--quick", "--nranks", "2", "-e", "64K", "--collectives", "all_reduce,reduce_scatter",
                "--backends", "ringreduce/shm", "--wire", "bf16,fp16,fp8", "--json", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = parse_rows(res.stdout)
    backends = {r["backend"] for r in rows}
    assert {"ringreduce/wire-bf16", "ringreduce/wire-fp8", "torch/bf16-compress"} <= backends
    assert "ringreduce/wire-fp16" not in backends and "repeated in-place sums" in res.stdout
    assert all(r["oop"][3] == "0" and r["ip"][3] == "0" for r in rows)
    data = json.load(open(out))
    fp8 = [r for r in data["runs"][0]["rows"] if r["backend"] == "ringreduce/wire-fp8"]
    assert fp8 and all(0 < r["max_err"] < 0.2 for r in fp8)  # e4m3's step on values <= 1
    assert "# --wire, in place" in res.stdout
    bad = bench("--quick", "--nranks", "2", "-e", "1K", "--collectives", "all_reduce",
                "--backends", "ringreduce/shm", "--wire", "bf16", "--corrupt-for-test",
                "ringreduce/wire-bf16")
    assert bad.returncode == 1 and "FAILED" in bad.stdout, bad.stdout[-2000:]


@pytest.mark.parametrize("agg", ["1", "3"])
def test_corrupted_result_is_counted(agg):
    res = bench("--quick", "--nranks", "2", "-e", "1K", "-m", agg, "--corrupt-for-test",
                "ringreduce")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    rows = parse_rows(res.stdout)
    assert len(rows) == 6 + 4 + 4
    for r in rows:
        expect = "1" if r["backend"] == "ringreduce/shm" else "0"
        assert r["oop"][3] == expect and r["ip"][3] == expect, r
    assert "FAILED" in res.stdout


def test_agg_iters_default():
    a = cli.parse_args(["--nranks", "2"])
    assert [cli.agg_iters(a, n) for n in (4 << 10, 64 << 10, 256 << 10, 1 << 20, 64 << 20)] == \
        [32, 16, 4, 1, 1]
    assert cli.agg_iters(cli.parse_args(["--nranks", "2", "-m", "5"]), 4 << 10) == 5
    assert cli.agg_iters(cli.parse_args(["--quick"]), 1 << 10) == 1


def test_batch_calibration():
    assert cli.calibrated(32, 100e-6, 50) == 16000  # 3.125 us a call -> 16,000 calls in 50 ms
    assert cli.calibrated(32, 0.5, 50) == 4          # 15.6 ms a call -> 4 calls
    assert cli.calibrated(2, 0.5, 50) == 1           # slower than a batch: one call
    assert cli.calibrated(1, 0.0, 50) == cli.BATCH_CALLS_MAX
    a = cli.parse_args(["--nranks", "2", "-w", "0"])
    assert a.agg_iters is None and a.warmup_iters == 1  # calibration needs one warm-up
    assert cli.parse_args(["--nranks", "2", "-w", "0", "-m", "4"]).warmup_iters == 0


def test_calibrated_batches_in_a_run(tmp_path):
    # Without -m each backend's batch is calibrated to last at least --batch_ms (here 20 ms):
    # thousands of calls for ringreduce at 4 KiB, a few for Gloo, never the same count for both.
    res = bench("--nranks", "2", "-b", "4K", "-e", "4K", "--collectives", "all_reduce",
                "--backends", "ringreduce/shm,torch", "-n", "2", "--batch_ms", "20", "--json",
                str(tmp_path / "r.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())["runs"][0]["rows"]
    assert len(rows) == 4 and all(r["wrong"] == 0 for r in rows)
    for r in rows:
        batch_ms = r["agg_iters"] * r["time_us"] / 1e3
        assert batch_ms >= 10, r  # >= 20 ms minus the noise between warm-up and timed batches
        assert r["agg_iters"] > (100 if r["backend"] == "ringreduce/shm" else 0), r


def test_stalled_warmup_does_not_leave_short_batches(tmp_path):
    # Rank 0 stalls 60 ms in every batch of both warm-ups (as a descheduled rank did in CI): the
    # counts those batches suggest are far too small, and the timed batches must not keep them.
    res = bench("--nranks", "2", "-b", "4K", "-e", "4K", "--collectives", "all_reduce",
                "--backends", "ringreduce/shm", "-n", "3", "-w", "2", "--batch_ms", "20",
                "--stall-for-test", "60", "--json", str(tmp_path / "r.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "r.json").read_text())["runs"][0]["rows"]
    assert len(rows) == 2 and all(r["wrong"] == 0 for r in rows)
    for r in rows:
        assert r["agg_iters"] * r["time_us"] / 1e3 >= 10, r


def test_rank_dying_after_its_sweep_is_a_warning_but_during_it_a_failure():
    # Rank 1 aborts (SIGABRT) after its sweep, ringreduce's close and destroy_process_group, as a
    # peer library once did at exit in CI: the run's results stand, with a warning naming it.
    res = bench("--quick", "--nranks", "2", "-e", "1K", "--collectives", "all_reduce",
                "--backends", "ringreduce/shm", "--crash-at-exit-for-test", "1")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "warning: nranks 2: rank 1 exited with signal 6 after the sweep" in res.stderr, res.stderr
    rows = parse_rows(res.stdout)
    assert len(rows) == 1 and rows[0]["oop"][3] == "0" and rows[0]["ip"][3] == "0", res.stdout
    # With corrupted results the exit status still says so.
    res = bench("--quick", "--nranks", "2", "-e", "1K", "--collectives", "all_reduce",
                "--backends", "ringreduce/shm", "--crash-at-exit-for-test", "1",
                "--corrupt-for-test", "ringreduce/shm")
    assert res.returncode == 1 and "FAILED" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_collect_tells_a_crash_at_exit_from_one_in_the_sweep(tmp_path):
    from ringreduce.bench import launch
    (tmp_path / "result.json").write_text('{"rows": []}')
    (tmp_path / "done-0").touch()
    with pytest.raises(RuntimeError, match=r"rank 1 --- died \(signal 9\)"):
        launch._collect(str(tmp_path), 2, [0, -9])  # rank 1 never finished its sweep
    (tmp_path / "done-1").touch()
    assert launch._collect(str(tmp_path), 2, [0, -9]) == {"rows": []}
    assert launch._collect(str(tmp_path), 2, [1, 0], whole_job=True) == {"rows": []}
    (tmp_path / "done-1").unlink()
    with pytest.raises(RuntimeError, match="status 1"):
        launch._collect(str(tmp_path), 2, [1, 0], whole_job=True)


def test_check_off_prints_na():
    res = bench("--quick", "--nranks", "2", "-e", "1K", "--collectives", "all_reduce", "-c", "0")
    assert res.returncode == 0, res.stderr[-3000:]
    rows = parse_rows(res.stdout)
    assert rows and all(r["oop"][3] == "N/A" and r["ip"][3] == "N/A" for r in rows)


def test_mpi_launchers_found_by_name(monkeypatch, tmp_path, capsys):
    """Each MPI installed side by side is found under its Debian name, the default mpirun first;
    asking for one that is not there names what was found and looked for."""
    for name, banner in (("mpirun", "mpirun (Open MPI) 4.1.4"), ("mpirun.openmpi", "Open MPI"),
                         ("mpirun.mpich", "HYDRA build details:")):
        path = tmp_path / name
        path.write_text(f"#!/bin/sh\necho '{banner}'\n")
        path.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    cli.mpi_launchers.cache_clear()
    try:
        assert cli.mpi_launchers() == {"openmpi": str(tmp_path / "mpirun"),
                                       "mpich": str(tmp_path / "mpirun.mpich")}
        assert cli.mpi_launcher() == ("openmpi", str(tmp_path / "mpirun"))
        (tmp_path / "mpirun.mpich").unlink()
        cli.mpi_launchers.cache_clear()
        if cli.importlib.util.find_spec("mpi4py") is not None:
            with pytest.raises(SystemExit):
                cli.parse_args(["--backends", "mpi/mpich"])
            err = capsys.readouterr().err
            assert "no mpich launcher on PATH (found: openmpi); looked for mpirun" in err, err
    finally:
        cli.mpi_launchers.cache_clear()


def test_missing_optional_packages_named(monkeypatch, capsys):
    real = cli.importlib.util.find_spec
    monkeypatch.setattr(cli.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("matplotlib", "mpi4py", "deepspeed")
                        else real(name, *a))
    for flags, message in ((["--plot", "out.png"], "--plot needs matplotlib: pip install"),
                           (["--backends", "mpi"], "pip install '.[peers]'"),
                           (["--backends", "deepspeed"], "needs DeepSpeed: pip install '.[peers]'")):
        with pytest.raises(SystemExit) as exc:
            cli.parse_args(flags)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    left = dict(header.left_out(cli.parse_args(["--nranks", "2"])))
    assert left["mpi"].startswith("not installed (needs an MPI and mpi4py"), left
    assert left["deepspeed/shm"] == "not installed (pip install '.[peers]')", left


@pytest.mark.parametrize("flags,message", [
    (["--bogus"], "unrecognized arguments"),
    (["-b", "4X"], "invalid size"),
    (["-d", "float8"], "invalid choice"),
    (["--nranks", "0"], "must be >= 1"),
    (["--backends", "nccl"], "invalid backend"),
    (["-b", "1M", "-e", "1K"], "larger than"),
    (["-o", "mean"], "invalid choice"),
    (["-m", "0"], "must be >= 1"),
    (["--plot", "out.pdf"], "must end in .png"),
    (["--backends", "ringreduce/p2p-shared"], "transport p2p does not move CPU tensors"),
    (["--results", "out", "--no-results"], "--results out and --no-results: choose one"),
])
def test_bad_flags_rejected(flags, message, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(flags)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "usage:" in err


def test_bad_flag_exits_2_from_the_command_line():
    res = bench("-e", "64Q")
    assert res.returncode == 2
    assert "invalid size '64Q'" in res.stderr and "usage:" in res.stderr
    assert not parse_rows(res.stdout)


def test_torchrun(tmp_path):
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "ringreduce.bench", "--quick", "-e", "1K",
                          "--collectives", "all_gather", "--no-results"], capture_output=True,
                         text=True, timeout=RUN_TIMEOUT, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not os.listdir(tmp_path) and "# results:" not in res.stdout  # --no-results
    assert res.stdout.count("# load average at start") == 1, res.stdout  # rank 0's header only
    rows = parse_rows(res.stdout)
    assert len(rows) == 4  # printed once, by rank 0
    assert all(r["oop"][3] == "0" and r["ip"][3] == "0" for r in rows)


@pytest.mark.parametrize("text,value", [("4096", 4096), ("4K", 4096), ("64M", 64 << 20),
                                        ("1G", 1 << 30), ("8KiB", 8192), ("2kb", 2048)])
def test_parse_size(text, value):
    assert cli.parse_size(text) == value


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.int8, torch.uint8, torch.int32, torch.int64])
@pytest.mark.parametrize("op", ["sum", "avg", "prod", "min", "max"])
def test_reference_matches_brute_force(dtype, op):
    """The closed-form expected result equals reducing every rank's input elementwise."""
    for world in (1, 2, 3, 5, 8):
        count = 7 * world
        inputs = [data.Reference("all_reduce", count, r, world, dtype, op, "cpu").input
                  for r in range(world)]
        x = torch.stack(inputs).double() if dtype.is_floating_point else torch.stack(inputs).long()
        e = {"sum": lambda: x.sum(0), "avg": lambda: x.sum(0), "prod": lambda: x.prod(0),
             "min": lambda: x.min(0).values, "max": lambda: x.max(0).values}[op]()
        if op == "avg":
            e = e / world if dtype.is_floating_point else torch.div(e, world, rounding_mode="trunc")
        result = e.to(dtype)
        for r in range(world):
            ref = data.Reference("all_reduce", count, r, world, dtype, op, "cpu")
            assert ref.wrong(result) == 0
            bad = result.clone()
            bad[r] += 100
            assert ref.wrong(bad) == 1
            c = count // world
            rs = data.Reference("reduce_scatter", count, r, world, dtype, op, "cpu")
            assert rs.wrong(result[r * c:(r + 1) * c]) == 0
            ag = data.Reference("all_gather", count, r, world, dtype, op, "cpu")
            gathered = torch.cat([inp[q * c:(q + 1) * c] for q, inp in enumerate(inputs)])
            assert ag.wrong(gathered) == 0
            assert ref.wrong(torch.full((count,), data.sentinel(dtype), dtype=dtype)) == count


def _have_mpi():
    return cli.mpi_launcher() is not None and cli.importlib.util.find_spec("mpi4py") is not None


@pytest.mark.skipif(not _have_mpi() and os.environ.get("RINGREDUCE_REQUIRE_MPI") != "1",
                    reason="needs mpi4py and mpirun (pip install '.[peers]'; CI installs Open MPI "
                           "and sets RINGREDUCE_REQUIRE_MPI=1 so that this never skips there)")
def test_mpi_backend_quick_sweep():
    """--backends mpi: the suite starts its ranks with mpirun; MPI's rows sit beside ringreduce's,
    checked the same way (and a corrupted MPI result is counted, so the check is real)."""
    kinds = list(cli.mpi_launchers())
    if os.environ.get("RINGREDUCE_REQUIRE_MPICH") == "1":  # CI installs Open MPI and MPICH
        assert "openmpi" in kinds and "mpich" in kinds, kinds
    res = bench("--quick", "--nranks", "2,3", "-e", "8K", "--backends", "ringreduce/shm,mpi")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = parse_rows(res.stdout)
    # every MPI installed, each in its own launch, beside ringreduce: 2 worlds x 3 collectives x
    # 2 sizes (1K, 8K) each
    for label in ["ringreduce/shm"] + [f"mpi/{k}" for k in kinds]:
        assert len([r for r in rows if r["backend"] == label]) == 2 * 3 * 2, (label, res.stdout)
    assert len(rows) == 2 * 3 * 2 * (1 + len(kinds)), res.stdout
    assert all(r["oop"][3] == "0" and r["ip"][3] == "0" for r in rows)
    for k in kinds:  # the library each launch loaded is the one its launcher belongs to
        name = {"openmpi": "Open MPI", "mpich": "MPICH"}.get(k, "")
        assert f"# note: mpi/{k}: {name}" in res.stdout, res.stdout[-3000:]
    summary = res.stdout[res.stdout.rindex("# summary, nranks 3"):]
    assert "/ time of ringreduce/shm" in summary, summary
    assert all(f"mpi/{k}" in summary for k in kinds), summary
    label = f"mpi/{kinds[-1]}"
    bad = bench("--quick", "--nranks", "2", "-e", "1K", "--backends", label,
                "--corrupt-for-test", label)
    assert bad.returncode == 1 and "FAILED" in bad.stdout, bad.stdout[-3000:] + bad.stderr[-3000:]


def _deepspeed_segments():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith("deepspeed_allreduce_buffer_"))


@pytest.mark.skipif(cli.importlib.util.find_spec("deepspeed") is None and
                    os.environ.get("RINGREDUCE_REQUIRE_DEEPSPEED") != "1",
                    reason="needs DeepSpeed (pip install '.[peers]'; CI installs it and sets "
                           "RINGREDUCE_REQUIRE_DEEPSPEED=1 so that this never skips there)")
def test_deepspeed_backend_quick_sweep():
    """--backends deepspeed: DeepSpeed's own shm all-reduce (its op built by the suite before the
    ranks start), checked like every row; its /dev/shm segments are gone afterwards."""
    before = _deepspeed_segments()
    res = bench("--quick", "--nranks", "2,3", "-e", "8K", "--backends", "ringreduce/shm,deepspeed",
                timeout=RUN_TIMEOUT + 300)  # + the op's first build
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = parse_rows(res.stdout)
    ds = [r for r in rows if r["backend"] == "deepspeed/shm"]
    # all_reduce only: 2 worlds x 2 sizes (1K, 8K); ringreduce's: 2 x 3 collectives x 2
    assert len(ds) == 2 * 2 and len(rows) == len(ds) + 2 * 3 * 2, res.stdout
    assert "deepspeed/shm skips reduce_scatter" in res.stdout, res.stdout
    assert all(r["oop"][3] == "0" and r["ip"][3] == "0" for r in rows)
    bad = bench("--quick", "--nranks", "2", "-e", "1K", "--backends", "deepspeed",
                "--collectives", "all_reduce", "--corrupt-for-test", "deepspeed/shm")
    assert bad.returncode == 1 and "FAILED" in bad.stdout, bad.stdout[-3000:] + bad.stderr[-3000:]
    assert _deepspeed_segments() == before


def test_simulated_hosts_row(tmp_path):
    """--hosts 2: a ringreduce/hier row (two-level plan on 2 simulated hosts x 2 ranks) next to the
    flat rows, every collective checked; --hosts above the rank count is refused."""
    res = bench("--quick", "--nranks", "4", "--hosts", "2", "--backends", "ringreduce/hier,torch",
                "--json", str(tmp_path / "r.json"))
    assert res.returncode == 0, res.stderr[-3000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    rows = [r for r in doc["runs"][0]["rows"] if r["backend"] == "ringreduce/hier"]
    assert {r["collective"] for r in rows} == {"all_reduce", "reduce_scatter", "all_gather"}
    assert rows and all(r["wrong"] == 0 for r in rows)
    assert "2 simulated hosts" in res.stdout
    bad = bench("--quick", "--nranks", "2", "--hosts", "3")
    assert bad.returncode == 2 and "more simulated hosts than ranks" in bad.stderr
    bad = bench("--quick", "--nranks", "2", "--backends", "ringreduce/hier")
    assert bad.returncode == 2 and "--hosts H" in bad.stderr


def test_summary_fits_100_columns(capsys):
    """The summary's ratio table: one column per baseline against the automatic choice, short
    aligned headers, every line within 100 columns (issue 27); the full matrix stays in the JSON."""
    from ringreduce.bench import report
    labels = ["ringreduce/shm", "ringreduce/ring", "ringreduce/oneshot", "torch", "torch/ringreduce",
              "mpi/openmpi", "mpi/mpich", "deepspeed"]
    rows = []
    for c in ("all_reduce", "reduce_scatter", "all_gather"):
        for size in (4096, 64 << 20):
            for i, b in enumerate(labels):
                for inplace in (False, True):
                    rows.append({"collective": c, "size_bytes": size, "backend": b,
                                 "inplace": inplace, "time_us": 10.0 * (i + 1),
                                 "time_us_q1": 9.0 * (i + 1), "time_us_q3": 11.0 * (i + 1),
                                 "iters": 20, "busbw_GBps": 1.0, "wrong": 0})
    summary = report.summarize(rows, labels)
    run = {"summary": summary, "nranks": 4, "peak_membw_GBps": None, "rows": rows}
    report.print_summary(run)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    table = out[out.index("/ time of ringreduce/shm"):]
    assert "medians of 20 timed iterations" in table.splitlines()[1]  # issue 83: how many, and
    assert "its spread" in table.splitlines()[1]                      # how far apart
    header = table.splitlines()[3]
    assert header.split()[1:] == ["collective", "size", "torch", "torch/ringreduce", "mpi/openmpi",
                                  "mpi/mpich", "deepspeed"], header
    first = table.splitlines()[4].split()
    assert first[1:4] == ["all_reduce", "4", "KiB"] and first[4:] == ["4.00", "5.00", "6.00", "7.00",
                                                                      "8.00"], first
    # torch (4x ours): its lower quartile 36 / ours' upper 11, its upper 44 / ours' lower 9
    assert table.splitlines()[5].split()[1:3] == ["3.27-4.89", "4.09-6.11"], table.splitlines()[5]
    # the full matrix (every ringreduce row against every baseline) is still in the JSON summary
    assert summary["time_ratios_inplace"][0]["deepspeed / ringreduce/ring"] == 4.0


def test_progress_line_is_erased_before_a_row(capsys):
    """On a terminal the progress line (stderr, no newline) is erased before a note or a row goes
    to stdout on the same terminal; in a log every progress line ends with its newline."""
    from ringreduce.bench.runner import Context
    ctx = object.__new__(Context)  # the printing half only: no group, no backends
    ctx.rank, ctx.notes, ctx.tty, ctx.progress_shown = 0, [], True, False
    ctx.progress("[bench] N=2 all_reduce 4 KiB")
    ctx.clear_progress()
    ctx.note("a note")
    ctx.clear_progress()  # nothing shown: writes nothing
    ctx.progress("[bench] N=2 done", final=True)
    ctx.clear_progress()
    out = capsys.readouterr()
    assert out.err == "\r\033[K[bench] N=2 all_reduce 4 KiB\r\033[K\r\033[K[bench] N=2 done\n"
    assert out.out == "# note: a note\n"
    ctx.tty = False
    ctx.progress("[bench] N=2 all_reduce 8 KiB")
    ctx.clear_progress()
    assert capsys.readouterr().err == "[bench] N=2 all_reduce 8 KiB\n"


# -- benchmarks/cpu_tune.py: the CPU table's arithmetic (its runs are the bench's) ---------------
def _cpu_tune():
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location(
        "cpu_tune", pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "cpu_tune.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


K, M = 1 << 10, 1 << 20


def test_cpu_tune_keeps_the_default_within_the_margin():
    tune = _cpu_tune()
    sizes = [K, 4 * K, 64 * K, M, 4 * M, 16 * M]
    times = {"ring": {s: 100.0 for s in sizes}, "oneshot": {s: 96.0 for s in sizes},
             "twoshot": {s: 96.0 for s in sizes}, "cma": {s: 96.0 for s in sizes}}
    # Nothing beats the default by more than 5%: one-shot up to world 2's 1 KiB, the ring above.
    assert tune.choose([times], 2)[:2] == (K, [])
    # At world 4 the default threshold is 32 KiB: one-shot stays up to 4 KiB, then the ring.
    assert tune.choose([times], 4)[:2] == (4 * K, [])


def test_cpu_tune_steps_where_the_winner_changes():
    tune = _cpu_tune()
    sizes = [K, 4 * K, 64 * K, M, 4 * M, 16 * M]
    ring = {s: 100.0 for s in sizes}
    oneshot = {K: 50.0, 4 * K: 60.0, 64 * K: 300.0, M: 80.0, 4 * M: 500.0, 16 * M: 500.0}
    twoshot = {s: 100.0 for s in sizes} | {64 * K: 70.0}
    cma = {s: 100.0 for s in sizes} | {4 * M: 60.0, 16 * M: 85.0}
    oneshot_max, steps, choice = tune.choose(
        [{"ring": ring, "oneshot": oneshot, "twoshot": twoshot, "cma": cma}], 2)
    # One-shot wins from the bottom up to 4 KiB (beyond world 2's default threshold); its win at
    # 1 MiB is no run from the bottom: the ring there. 16 MiB: cma 15% faster than the ring.
    assert oneshot_max == 4 * K
    assert steps == [[64 * K, "twoshot"], [M, "ring"], [4 * M, "cma"]]
    assert choice[M] == "oneshot" and choice[16 * M] == "cma"
    # A missing time loses: without cma's runs it never steps to cma.
    assert tune.choose([{"ring": ring, "twoshot": twoshot}], 2)[1] == [[64 * K, "twoshot"], [M, "ring"]]


def test_cpu_tune_compares_within_a_run():
    """Ratios to the default within each round, their median over the rounds: a slow round (every
    algorithm 1.5x) moves nothing, where best-of-rounds would pair one round's cma with another's
    ring."""
    tune = _cpu_tune()
    fast = {"ring": {4 * M: 100.0}, "cma": {4 * M: 98.0}}
    slow = {"ring": {4 * M: 150.0}, "cma": {4 * M: 135.0}}
    mid = {"ring": {4 * M: 120.0}, "cma": {4 * M: 105.0}}
    assert tune.choose([fast, slow, mid], 2)[1] == [[4 * M, "cma"]]  # ratios 0.98, 0.9, 0.875
    assert tune.choose([fast, fast, mid], 2)[1] == []  # median 0.98: within the margin


def test_cpu_tune_table_from_bench_json(tmp_path):
    """--from: rounds from bench --json files; the entry is what _shm.tuned reads back."""
    tune = _cpu_tune()
    from ringreduce import _shm

    def doc(ring_4m):
        rows = [dict(collective="all_reduce", backend=f"ringreduce/{a}", nranks=2, size_bytes=s,
                     inplace=ip, time_us=t * (1 if ip else 3))
                for a, ts in (("ring", {M: 100.0, 4 * M: ring_4m}), ("cma", {M: 99.0, 4 * M: 300.0}),
                              ("oneshot", {M: 400.0, 4 * M: 1600.0}))
                for s, t in ts.items() for ip in (False, True)]
        rows.append(dict(rows[0], backend="mpi/openmpi", time_us=1.0))  # a peer: not an algorithm
        return {"runs": [{"rows": rows}]}

    paths = []
    for i, ring_4m in enumerate((500.0, 420.0)):  # cma's 300 beats the best ring (420) by > 5%
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(doc(ring_4m)))
    table = tmp_path / "table.json"
    tune.main(["--from", *map(str, paths), "--table", str(table)])
    entry = json.loads(table.read_text())["entries"][0]
    assert entry["median_us"]["ring"]["4194304"] == 420.0
    assert _shm.tuned(entry["cpu_model"], entry["cores"], 2, str(table))[:2] == (0, [(4 * M, "cma")])


def test_lab_hosts_start_quiet():
    """Issue 73: each emulated host's torchrun gets OMP_NUM_THREADS (no banner in the middle of the
    report) and TORCH_CPP_LOG_LEVEL=ERROR (no c10d host-name warnings from the namespaces), unless
    the user set them; a forced transport is not passed on."""
    from ringreduce.bench.launch import lab_env
    env = lab_env({"RINGREDUCE_TRANSPORT": "shm", "PATH": "/bin"}, "2 hosts", 2)
    assert int(env["OMP_NUM_THREADS"]) >= 1 and env["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    assert "RINGREDUCE_TRANSPORT" not in env and env["PATH"] == "/bin"
    assert "2 hosts" in env.values()
    mine = lab_env({"OMP_NUM_THREADS": "3", "TORCH_CPP_LOG_LEVEL": "INFO"}, "x", 2)
    assert (mine["OMP_NUM_THREADS"], mine["TORCH_CPP_LOG_LEVEL"]) == ("3", "INFO")


def test_busy_machine_flagged(monkeypatch):
    """Issue 83 (73 before it): a run says its rows are not to be trusted when other work took the
    cores the ranks need, measured by CPU time with the bench's own ranks aside; its own busy
    ranks (a load of 2.2 on 2 cores) say nothing."""
    from ringreduce.bench import load
    monkeypatch.setattr(header, "cores", lambda: 2)
    tick = os.sysconf("SC_CLK_TCK")
    s = load.Sample(wall=100.0, machine=0, own=0)
    # 2 s: the bench's ranks took 3.9 core-seconds, something else 0.1 (0.05 cores)
    quiet = load.Sample(wall=102.0, machine=int(4.0 * tick), own=int(3.9 * tick))
    assert abs(load.other_cores(s, quiet) - 0.05) < 0.01
    assert header.other_work(((2.2, 1, 1), s), ((2.2, 1, 1), quiet), 2)[2] is None
    busy = load.Sample(wall=102.0, machine=int(4.0 * tick), own=int(2.8 * tick))  # 0.6 cores
    other, how, note = header.other_work((None, s), (None, busy), 2)
    assert how == "CPU time from /proc" and abs(other - 0.6) < 0.01
    assert "kept 0.60 cores busy" in note and "own 2 ranks aside" in note and \
        "the 0 of the 2 cores" in note and "not to be trusted" in note, note
    # one rank leaves a core free: 0.6 cores of other work fit beside it
    assert header.other_work((None, s), (None, busy), 1)[2] is None
    # without /proc: the 1-minute load average less the ranks
    other, how, note = header.other_work(((2.2, 1, 1), None), ((3.0, 1, 1), None), 2)
    assert how == "the 1-minute load average less the ranks" and abs(other - 1.0) < 1e-9 and note
    assert header.other_work(((2.2, 1, 1), None), ((2.1, 1, 1), None), 2)[2] is None
    assert header.other_work((None, None), (None, None), 2) == (None, "the 1-minute load average less the ranks", None)


def _load_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "bench_load", pathlib.Path(__file__).resolve().parents[1] / "ringreduce" / "bench" / "load.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_own_tree_counts_reaped_children():
    """A child's CPU time, once reaped, is the bench's own (in its reaper's cutime), not other work."""
    import resource
    load = _load_module()
    s = load.sample(os.getpid())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                    "while time.process_time() - t < 0.3: pass"], check=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    e = load.sample(os.getpid())
    child = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert child >= 0.3
    assert (e.own - s.own) / os.sysconf("SC_CLK_TCK") >= child - 0.05, (s, e, child)


def test_bench_root_is_the_top_bench_process():
    """Through ancestors that run ringreduce.bench (torchrun, the --link launcher), not beyond."""
    path = pathlib.Path(__file__).resolve().parents[1] / "ringreduce" / "bench" / "load.py"
    inner = ("import importlib.util as u, os\n"
             f"s = u.spec_from_file_location('l', {str(path)!r}); m = u.module_from_spec(s)\n"
             "s.loader.exec_module(m); print(m.bench_root(), os.getppid())")
    outer = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {inner!r}])"
    p = subprocess.run([sys.executable, "-c", outer, "ringreduce.bench"], capture_output=True,
                       text=True, timeout=120)
    root, parent = p.stdout.split()
    assert root == parent, p.stdout  # the process running "ringreduce.bench", not pytest above it
    p = subprocess.run([sys.executable, "-c", inner], capture_output=True, text=True, timeout=120)
    root, parent = p.stdout.split()
    assert root != parent, p.stdout  # pytest does not run the bench: the process itself


def test_nccl_over_sockets_is_labelled():
    """Issue 73: NCCL's rows from ranks that share a GPU (posing as hosts: its socket transport)
    carry -socket in their label, so no table or results.json shows them as NCCL's GPU speed."""
    from ringreduce.bench.launch import socket_label
    assert socket_label("torch/nccl") == "torch/nccl-socket" and socket_label("ps/nccl") == "ps/nccl-socket"
    assert socket_label("ringreduce/p2p") == "ringreduce/p2p" and socket_label("torch/gloo") == "torch/gloo"
