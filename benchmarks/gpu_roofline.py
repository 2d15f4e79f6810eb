"""How far the CUDA path is from the hardware's limit, in one run on one GPU (issue 36 item 5).

    python benchmarks/gpu_roofline.py [--worlds 2,4] [--sizes 4K,64K,1M,16M,256M] [--mps both]

Prints, and writes as markdown to --out (default gpu_roofline.md) for a new entry of docs/benchmark-log.md (and BENCHMARKS.md's GPU tables):
1. the device-to-device copy bandwidth (read + write counted), the limit of everything below;
2. world 1: rr.all_reduce against NCCL's world-1 all_reduce and a bare t.add_(0), us per call;
3. worlds 2 and 4 as processes sharing the GPU, with MPS and without, per p2p algorithm (auto,
   ring, oneshot, twoshot, copy: RINGREDUCE_CUDA_ALGO; registered: the tensor a shared_empty one;
   without MPS auto runs copy; "twoshot@64": two-shot with RINGREDUCE_CUDA_SYM_BLOCKS=64),
   float32 all_reduce in place: the median us per
   call from `python -m ringreduce.bench`, the fraction of the HBM limit (an all_reduce of S bytes
   per rank on one GPU reads N inputs and writes N outputs: 2NS bytes at the copy bandwidth), and
   the time without MPS as a multiple of the time with it;
4. the peer in the same bench runs (issue 50 item 6; --peers off leaves it out): torch's
   SymmetricMemory one-/two-shot all-reduces (torch.ops.symm_mem) beside auto on ordinary tensors
   (copied into its buffer, as vLLM does) and beside registered on its symmetric tensors, as rows
   of their own with the same fraction of the HBM limit, and a table of the faster peer's time over
   ours at each size (> 1: ours faster; the issue's target is >= 1 everywhere).
MPS is started with `nvidia-cuda-mps-control -d` and stopped with `quit` (needs root), from
whatever state the run finds (a daemon already running is used); --mps off or on runs one of the
two (MPS on first). Each bench run has a time limit (--timeout per backend in
it) and keeps the sizes it finished; the runs with the peer go first (--algos), and the report is
rewritten after each run, so a lease that ends early keeps what ran. --json writes every median and
its fraction of the limit, for `gpu_tune.py --from`. Nothing here runs without a GPU except the table arithmetic, which
tests/test_gpu_tools.py checks.
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

# registered: all_reduce of ringreduce.shared_empty tensors (ringreduce/p2p-shared; algorithm auto);
# copy: copies and stream waits, what auto runs without MPS (RINGREDUCE_CUDA_ALGO=copy)
ALGOS = ("auto", "ring", "oneshot", "twoshot", "registered", "copy", "ll")
# The peer's labels (ringreduce.bench backends) run in the same bench run as these algorithms.
PEERS = {"auto": ("torch/symm-oneshot", "torch/symm-twoshot"),
         "registered": ("torch/symm-oneshot-sym", "torch/symm-twoshot-sym")}
# Runs with the peer first: a lease cut short keeps the comparison the targets need.
DEFAULT_ORDER = ("auto", "registered", "ring", "oneshot", "twoshot", "copy", "ll")
# An algorithm may name the workspace's most blocks: "twoshot@64" runs twoshot with
# RINGREDUCE_CUDA_SYM_BLOCKS=64 (no peer beside it); gpu_tune.py --from compares it with "twoshot".


MAX_BLOCKS = 64  # RINGREDUCE_CUDA_SYM_BLOCKS's range (ringreduce/_cuda/policy.py: MAX_SYM_BLOCKS)


def split_algo(label):
    """(algorithm, blocks or None) of an --algos entry: "twoshot@64" -> ("twoshot", 64)."""
    algo, _, blocks = label.partition("@")
    return algo, int(blocks) if blocks else None

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    text = text.strip().upper().rstrip("B").rstrip("I")
    if text and text[-1] in UNITS:
        return int(float(text[:-1]) * UNITS[text[-1]])
    return int(text)


def human(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def hbm_limit_us(world, size_bytes, copy_GBps):
    """The least time of an all_reduce of size_bytes per rank, world ranks on one GPU: 2 x world x
    size bytes (every input read, every output written) at the copy bandwidth."""
    return 2 * world * size_bytes / (copy_GBps * 1e9) * 1e6


def row_names(labels=()):
    """Every algorithm and peer label in table order, each peer after the algorithm it runs with,
    and each of labels with blocks ("twoshot@64") after its algorithm's rows."""
    variants = lambda algo: sorted((x for x in set(labels) if split_algo(x)[0] == algo and "@" in x),  # noqa: E731
                                   key=lambda x: split_algo(x)[1])
    return [x for algo in ALGOS for x in (algo,) + PEERS.get(algo, ()) + tuple(variants(algo))]


def table(results, copy_GBps, sizes):
    """Markdown rows from results[(mps, world, algo)] = {size: us} (algo: ours, or a peer's label):
    per world, size and row, the time with MPS, its fraction of the HBM limit, the time without MPS
    and its ratio."""
    lines = ["| world | size | algorithm | us, MPS | fraction of HBM limit | us, no MPS | no MPS / MPS |",
             "|---:|---:|---|---:|---:|---:|---:|"]
    worlds = sorted({w for _, w, _ in results})
    for w in worlds:
        for s in sizes:
            for algo in row_names([x for _, _, x in results]):
                on = results.get(("on", w, algo), {}).get(s)
                off = results.get(("off", w, algo), {}).get(s)
                if on is None and off is None:
                    continue
                best = on if on is not None else off
                frac = hbm_limit_us(w, s, copy_GBps) / best
                cell = lambda v: f"{v:,.1f}" if v is not None else "-"  # noqa: E731
                ratio = f"{off / on:.1f}x" if on and off else "-"
                lines.append(f"| {w} | {human(s)} | {algo} | {cell(on)} | {frac:.2f} | {cell(off)} | {ratio} |")
    return "\n".join(lines)


def peer_table(results, sizes):
    """Markdown rows: per MPS mode, world and size, ours (auto; registered) against the faster of
    the peer's ops on the same tensors in the same run, and its time over ours (> 1: ours faster)."""
    lines = ["| MPS | world | size | auto | faster torch symm op | it / auto | registered | "
             "faster torch symm op, symmetric | it / registered |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cell = lambda v: f"{v:,.1f}" if v is not None else "-"  # noqa: E731
    any_row = False
    for m in ("on", "off"):
        for w in sorted({w for mode, w, _ in results if mode == m}):
            for s in sizes:
                cells, seen = [], False
                for algo, peers in PEERS.items():
                    ours = results.get((m, w, algo), {}).get(s)
                    times = [(results.get((m, w, p), {}).get(s), p) for p in peers]
                    best = min(((t, p) for t, p in times if t is not None), default=(None, None))
                    seen = seen or best[0] is not None
                    ratio = f"{best[0] / ours:.2f}" if ours and best[0] else "-"
                    name = f"{cell(best[0])} ({best[1].split('-')[1]})" if best[0] else "-"
                    cells += [cell(ours), name, ratio]
                if seen:
                    any_row = True
                    lines.append(f"| {m} | {w} | {human(s)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) if any_row else ""


# -- on the GPU --------------------------------------------------------------------------------
def cuda_time_us(fn, calls, repeats=15):
    """Median us per call of `calls` back-to-back fn() between two CUDA events."""
    import torch
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(out)


def copy_bandwidth_GBps(nbytes=256 << 20):
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = cuda_time_us(lambda: dst.copy_(src), 10)
    return 2 * nbytes / (us * 1e-6) / 1e9


def world_one(sizes):
    """{size: (rr us, nccl us, add_ us)} in this process, a world-1 group."""
    import torch
    import torch.distributed as dist
    import ringreduce as rr
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    nccl = dist.new_group(backend="nccl")
    out = {}
    for s in sizes:
        t = torch.zeros(max(1, s // 4), device="cuda")
        calls = 200 if s <= (1 << 20) else 20
        out[s] = (cuda_time_us(lambda: rr.all_reduce(t), calls),
                  cuda_time_us(lambda: dist.all_reduce(t, group=nccl), calls),
                  cuda_time_us(lambda: t.add_(0), calls))
    rr.destroy()
    dist.destroy_process_group()
    return out


def mps_answers(ctl):
    """True when an MPS control daemon answers (the control client exits 0 only then)."""
    r = subprocess.run([ctl], input="get_server_list\n", text=True, capture_output=True)
    return r.returncode == 0


def set_mps(on, settle_s=1.0):
    """MPS on or off, from whatever state this finds it in (issue 71 item 3): a second `-d` fails
    while a daemon runs, which stopped the roofline when gpu_lease.sh's steps had left one."""
    ctl = shutil.which("nvidia-cuda-mps-control")
    if not ctl:
        if on:
            raise SystemExit("nvidia-cuda-mps-control not found: run with --mps off")
        return  # no MPS here: off already
    if on:
        r = subprocess.run([ctl, "-d"], text=True, capture_output=True)
        if r.returncode != 0 and not mps_answers(ctl):
            raise SystemExit(f"nvidia-cuda-mps-control -d failed (exit {r.returncode}) and no "
                             f"daemon answers: {(r.stderr or r.stdout).strip()[-300:]}")
        time.sleep(settle_s)
    elif mps_answers(ctl):
        subprocess.run([ctl], input="quit\n", text=True, capture_output=True)
        time.sleep(2 * settle_s)


def parse_rows(text, backend=None):
    """{size_bytes: in-place us} of the all_reduce data rows a ringreduce.bench run printed (the
    nccl-tests-style table; a run stopped at its time limit keeps the rows it finished), of one
    backend's label or of every row. Rows with wrong elements are not times."""
    times = {}
    for line in text.splitlines():
        f = line.split()
        if not f or line.startswith("#") or len(f) != 13 or backend not in (None, f[4]):
            continue
        try:
            size, us, wrong = int(f[0]), float(f[9]), f[12]
        except ValueError:
            continue
        if wrong in ("0", "N/A"):
            times[size] = us
    return times


def run_bench(world, algo, sizes, timeout, bench_args=()):
    """{size: median us} of world ranks running algo (RINGREDUCE_CUDA_ALGO), in place, float32."""
    return run_bench_rows(world, algo, sizes, timeout, bench_args)[algo]


def run_bench_rows(world, algo, sizes, timeout, bench_args=(), peers=()):
    """{algo or peer label: {size: median us}}: algo and the peer's labels in one bench run, the
    backends alternated iteration by iteration; timeout is per backend. The run is a process group
    of its own: at the time limit every rank is killed with it (a rank left spinning would skew
    every later run) and the rows printed so far are kept."""
    base, blocks = split_algo(algo)
    registered = base == "registered"
    ours = "ringreduce/p2p-shared" if registered else "ringreduce/p2p"
    timeout *= 1 + len(peers)
    cmd = [sys.executable, "-m", "ringreduce.bench", "--nranks", str(world), "--backends",
           ",".join((ours,) + tuple(peers)), "--collectives",
           "all_reduce", "-b", str(min(sizes)), "-e", str(max(sizes)), "-f", "4", *bench_args]
    env = {**os.environ, "RINGREDUCE_CUDA_ALGO": "auto" if registered else base,
           "PYTHONUNBUFFERED": "1"}
    if blocks:
        env["RINGREDUCE_CUDA_SYM_BLOCKS"] = str(blocks)
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)

        def stopped(signum, frame):  # timeout(1) ends this script: the ranks must not outlive it
            os.killpg(p.pid, signal.SIGKILL)
            raise SystemExit(128 + signum)
        before = signal.signal(signal.SIGTERM, stopped)
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            code = f"killed at its {timeout:.0f} s limit"
        finally:
            signal.signal(signal.SIGTERM, before)
        out.seek(0)
        text = out.read()
    for line in text.splitlines():  # a peer the bench dropped, and why
        if line.startswith("# note:") and "skipped" in line:
            print(f"# world {world} {algo}: {line[2:]}", flush=True)
    if code != 0:
        print(f"# world {world} {algo}: bench {code if isinstance(code, str) else f'exited {code}'}"
              f"\n{text[-2000:]}", flush=True)
    return {label: {s: v for s, v in parse_rows(text, backend).items() if s in sizes}
            for label, backend in ((algo, ours),) + tuple((p, p) for p in peers)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--sizes", default="4K,64K,1M,16M,256M")
    p.add_argument("--algos", default=",".join(DEFAULT_ORDER), help="in the order run")
    p.add_argument("--peers", choices=("on", "off"), default="on",
                   help="torch's SymmetricMemory all-reduces in the auto and registered runs")
    p.add_argument("--mps", choices=("both", "on", "off"), default="both")
    p.add_argument("--timeout", type=float, default=300, help="seconds per backend of a bench "
                   "run (then it is killed and keeps the sizes it finished)")
    p.add_argument("--sizes-off", default="", help="sizes of the runs without MPS (default --sizes)")
    p.add_argument("--bench-args", default="", help="more arguments for ringreduce.bench, e.g. '-n 10'")
    p.add_argument("--out", default="gpu_roofline.md")
    p.add_argument("--json", help="also write every median here (gpu_tune.py --from reads it)")
    p.add_argument("--phase1", metavar="JSON", help=argparse.SUPPRESS)  # internal
    a = p.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    sizes_off = [parse_size(s) for s in a.sizes_off.split(",")] if a.sizes_off else sizes
    worlds = [int(w) for w in a.worlds.split(",")]
    algos = [x for x in a.algos.split(",") if x]
    for x in algos:
        base, at, blocks = x.partition("@")
        if base not in ALGOS or (at and not (blocks.isdigit() and 1 <= int(blocks) <= MAX_BLOCKS)):
            p.error(f"--algos: {x!r} is not one of {', '.join(ALGOS)} (optionally @blocks, 1 to "
                    f"{MAX_BLOCKS}: twoshot@64)")
    if a.phase1:  # in a process of its own: no CUDA context of ours stays while MPS starts
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("gpu_roofline.py needs a CUDA device")
        from ringreduce._cuda.policy import tuned
        name = torch.cuda.get_device_name()
        # The workspace's blocks the plain runs get (the table's entry; None: the default), for
        # gpu_tune.py --from to compare the "@blocks" runs with.
        doc = {"device": name, "torch": torch.__version__, "copy_GBps": copy_bandwidth_GBps(),
               "world1": {}, "plain_sym_blocks": {str(w): tuned(name, w, w)[1] for w in worlds}}
        with open(a.phase1, "w") as f:  # the copy bandwidth stays if world 1 fails
            json.dump(doc, f)
        doc["world1"] = world_one(sizes)
        with open(a.phase1, "w") as f:
            json.dump(doc, f)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "phase1.json")
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--sizes", a.sizes,
                            "--worlds", a.worlds, "--phase1", path], timeout=a.timeout)
        if not os.path.exists(path):
            raise SystemExit(f"gpu_roofline.py: the copy bandwidth was not measured (exit {r.returncode})")
        with open(path) as f:
            doc = json.load(f)
    copy = doc["copy_GBps"]
    w1 = {int(s): v for s, v in doc["world1"].items()}
    report = [f"# {doc['device']}, torch {doc['torch']}, device-to-device copy {copy:,.0f} GB/s "
              f"(read + write counted)", ""]
    report += ["| size | rr.all_reduce world 1 (us) | NCCL world 1 (us) | t.add_(0) (us) |",
               "|---:|---:|---:|---:|"]
    report += [f"| {human(s)} | {r:.1f} | {n:.1f} | {z:.1f} |" for s, (r, n, z) in w1.items()]
    print("\n".join(report), flush=True)
    results = {}
    modes = ("on", "off") if a.mps == "both" else (a.mps,)  # MPS first: the targets are there
    for mode in modes:
        set_mps(mode == "on")  # whatever state the machine was left in
        for w in worlds:
            for algo in algos:
                t0 = time.monotonic()
                run_sizes = sizes if mode == "on" or not a.sizes_off else sizes_off
                peers = PEERS.get(algo, ()) if a.peers == "on" else ()
                rows = run_bench_rows(w, algo, run_sizes, a.timeout, a.bench_args.split(), peers)
                results.update({(mode, w, x): ts for x, ts in rows.items()})
                print(f"# MPS {mode}, world {w}, {algo}: {time.monotonic() - t0:.0f} s", flush=True)
                write_out(a, report, results, copy, sorted(set(sizes) | set(sizes_off)), doc)
    if a.mps == "both":
        set_mps(False)
    print(write_out(a, report, results, copy, sorted(set(sizes) | set(sizes_off)), doc))


def write_out(a, report, results, copy, sizes, doc):
    """Writes the markdown report (and --json) as it stands; a run cut short keeps what it has."""
    peer = peer_table(results, sizes)
    text = "\n".join(report + ["", table(results, copy, sizes)] + (["", peer] if peer else []))
    with open(a.out, "w") as f:
        f.write(text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**doc, "results": json_results(results, copy)}, f, indent=1)
    return text


def json_results(results, copy_GBps):
    """One entry per (mps, world, algo or peer label): medians and fractions of the HBM limit by
    size; a peer's entry names the algorithm it ran beside (peer_of)."""
    peer_of = {p: algo for algo, peers in PEERS.items() for p in peers}
    out = []
    for (m, w, x), ts in results.items():
        e = {"mps": m, "world": w, "algo": x, "median_us": {str(s): v for s, v in ts.items()},
             "fraction_of_hbm_limit": {str(s): round(hbm_limit_us(w, s, copy_GBps) / v, 4)
                                       for s, v in ts.items() if v > 0}}
        if x in peer_of:
            e["peer_of"] = peer_of[x]
        out.append(e)
    return out

if __name__ == "__main__":
    main()
