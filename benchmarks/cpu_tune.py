"""Measures the CPU ring's algorithms on this machine and writes what `auto` runs into
ringreduce/cpu_tuning.json, one entry per (CPU model, cores, world size).

    python benchmarks/cpu_tune.py [--worlds 2,4] [-b 1K] [-e 64M] [--rounds 3] [--table PATH]

For each world, ROUNDS runs of `python -m ringreduce.bench` with the ring, one-shot, two-shot and
cma forced (all_reduce, float32 SUM, sizes x4 apart; the algorithms alternated iteration by
iteration). Per size, each algorithm's in-place median over the default's in the same run (the
default: one-shot up to the code's threshold, the ring above: ringreduce/_shm.py), the median of
those ratios over the rounds; the default stays unless another algorithm is faster by more than
MARGIN. The entry keeps each algorithm's best time per size for the record. Auto then runs one-shot
up to the last size of the unbroken run of one-shot choices from the smallest size, and above it
steps to each size's choice where it changes (one-shot above the threshold counts as the ring).
Sizes between two measured ones take the smaller one's choice. Check the table in with the
machine it came from: the entry records the CPU model, cores, date, command and every time.
Cma needs ptrace permission between the ranks (Yama's ptrace_scope <= 1, no seccomp filter
against process_vm_readv): where it is denied the bench run fails; leave it out with --algos
ring,oneshot,twoshot (a table that names it falls back to the ring at run time anyway). --from
JSON...: no runs, the rounds are `ringreduce.bench --json` files.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ringreduce import _shm  # noqa: E402  (no torch.distributed started: only the table helpers)

TABLE = _shm.TUNING_PATH
ALGOS = ("ring", "oneshot", "twoshot", "cma")
# A step needs a win beyond this: within one bench run the algorithms alternate iteration by
# iteration, and there cma's lead over the ring at 4-16 MiB, world 2, was 7-15% in five runs
# (2026-11-28), while separate runs of one algorithm moved 10-20% (so: ratios within a run).
MARGIN = 0.05
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    text = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def default_oneshot_max(world):
    return _shm.ONESHOT_MAX_BYTES_WORLD2 if world == 2 else _shm.ONESHOT_MAX_BYTES


def choose(rounds, world):
    """(oneshot_max, steps, choice per size) from rounds of times[algo][size] (us, in place; the
    algorithms of a round ran interleaved). Per size, each algorithm's time over the default's in
    the same round, its median over the rounds: a run's drift cancels. A size or round an
    algorithm lacks counts as a loss for it."""
    inf = float("inf")
    sizes = sorted({s for times in rounds for ts in times.values() for s in ts})

    def ratio(algo, default, s):
        rs = sorted(t.get(algo, {}).get(s, inf) / t.get(default, {}).get(s, inf)
                    if t.get(default, {}).get(s) else inf for t in rounds)
        mid = len(rs) // 2
        return rs[mid] if len(rs) % 2 else (rs[mid - 1] + rs[mid]) / 2

    choice = {}
    for s in sizes:
        default = "oneshot" if s <= default_oneshot_max(world) else "ring"
        best = min(ALGOS, key=lambda a: ratio(a, default, s))
        choice[s] = best if ratio(best, default, s) * (1 + MARGIN) < 1 else default
    oneshot_max = 0
    for s in sizes:
        if choice[s] != "oneshot":
            break
        oneshot_max = s
    steps, current = [], "ring"
    for s in sizes:
        if s <= oneshot_max:
            continue
        c = "ring" if choice[s] == "oneshot" else choice[s]
        if c != current:
            steps.append([s, c])
            current = c
    return oneshot_max, steps, choice


def merge_best(rounds):
    """Each algorithm's best time per size over several rounds of times[algo][size]."""
    out = {}
    for times in rounds:
        for algo, ts in times.items():
            for s, v in ts.items():
                out.setdefault(algo, {})[s] = min(v, out.get(algo, {}).get(s, float("inf")))
    return out


def times_from_bench(doc):
    """times[algo][size] (in place, slowest rank's median) from a `ringreduce.bench --json` file."""
    out = {}
    for run in doc["runs"]:
        for r in run["rows"]:
            if r["collective"] == "all_reduce" and r["inplace"] and r["backend"].startswith("ringreduce/"):
                algo = r["backend"].split("/", 1)[1]
                if algo in ALGOS:
                    out.setdefault(algo, {})[int(r["size_bytes"])] = float(r["time_us"])
    return out


def run_round(world, lo, hi, timeout, algos=ALGOS):
    """One bench run with every algorithm forced: times[algo][size]."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench.json")
        cmd = [sys.executable, "-m", "ringreduce.bench", "--nranks", str(world), "--collectives",
               "all_reduce", "--backends", ",".join(f"ringreduce/{a}" for a in algos), "-b", str(lo),
               "-e", str(hi), "-f", "4", "--no-results", "--json", path]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0 or not os.path.exists(path):
            raise SystemExit(f"cpu_tune.py: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}"
                             f"{r.stderr[-2000:]}")
        for line in r.stdout.splitlines():
            if line.startswith("# note:"):
                print(f"# world {world}: {line[2:]}", flush=True)
        with open(path) as f:
            return times_from_bench(json.load(f))


def make_entry(model, cores, world, rounds, command):
    oneshot_max, steps, _ = choose(rounds, world)
    times = merge_best(rounds)
    return {"cpu_model": model, "cores": cores, "world": world, "oneshot_max": oneshot_max,
            "steps": steps, "date": datetime.date.today().isoformat(), "command": command,
            "median_us": {a: {str(s): round(v, 1) for s, v in sorted(ts.items())}
                          for a, ts in sorted(times.items())}}


def update_table(path, entry):
    """Replaces the entry of the same (cpu_model, cores, world), or adds it."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        doc = {"about": ABOUT, "entries": []}
    key = lambda e: (e["cpu_model"], e["cores"], e["world"])  # noqa: E731
    doc["entries"] = sorted([e for e in doc["entries"] if key(e) != key(entry)] + [entry], key=key)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


ABOUT = ("Auto's algorithm for CPU all_reduces on one host, measured by benchmarks/cpu_tune.py on "
         "the machine named in each entry (CPU model from /proc/cpuinfo, cores the ranks share, world "
         "size): one-shot up to oneshot_max bytes, then at each step [from_bytes, algo] that algorithm "
         "(ring, twoshot or cma; the ring below the first step). Where no entry matches, the defaults "
         "of ringreduce/_shm.py. RINGREDUCE_CPU_TUNING names another table, or none.")


def describe(e):
    steps = ", ".join(f"{a} from {s} B" for s, a in e["steps"]) or "the ring above"
    return (f"{e['cpu_model']}, {e['cores']} cores, world {e['world']}: one-shot up to "
            f"{e['oneshot_max']} B, {steps}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("-b", "--minbytes", default="1K")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--algos", default=",".join(ALGOS), help="the algorithms to measure")
    p.add_argument("--table", default=TABLE)
    p.add_argument("--timeout", type=float, default=1200, help="seconds per bench run")
    p.add_argument("--from", dest="sources", metavar="JSON", nargs="+",
                   help="no runs: the rounds are these `ringreduce.bench --json` files (one world)")
    p.add_argument("--dry-run", action="store_true", help="print the entries, leave the table")
    a = p.parse_args(argv)
    model, cores = _shm.cpu_model(), len(os.sched_getaffinity(0))
    command = "python benchmarks/cpu_tune.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.sources:
        docs = []
        for src in a.sources:
            with open(src) as f:
                docs.append(json.load(f))
        worlds = {r["nranks"] for d in docs for run in d["runs"] for r in run["rows"]}
        if len(worlds) != 1:
            raise SystemExit(f"cpu_tune.py: --from takes runs of one world size, got {sorted(worlds)}")
        plan = [(worlds.pop(), [times_from_bench(d) for d in docs])]
    else:
        lo, hi = parse_size(a.minbytes), parse_size(a.maxbytes)
        plan = []
        for world in (int(w) for w in a.worlds.split(",")):
            rounds = []
            for i in range(a.rounds):
                print(f"# world {world}, round {i + 1} of {a.rounds}", flush=True)
                rounds.append(run_round(world, lo, hi, a.timeout, a.algos.split(",")))
            plan.append((world, rounds))
    for world, rounds in plan:
        entry = make_entry(model, cores, world, rounds, command)
        print(describe(entry), flush=True)
        best = merge_best(rounds)
        for s, c in sorted(choose(rounds, world)[2].items()):
            row = "  ".join(f"{x} {best.get(x, {}).get(s, float('nan')):9.1f}" for x in ALGOS)
            print(f"#   {s:>10} B: {row}  -> {c}", flush=True)
        if not a.dry_run:
            update_table(a.table, entry)
    if not a.dry_run:
        print(f"# wrote {a.table}", flush=True)


if __name__ == "__main__":
    main()
