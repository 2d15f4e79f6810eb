"""Measures the p2p algorithms on the GPU at hand and writes the threshold `auto` uses (issue 36
item 4) into ringreduce/gpu_tuning.json, one entry per (device name, world, ranks per device).

    python benchmarks/gpu_tune.py [--worlds 2,4] [--sizes 4K..256M] [--table ringreduce/gpu_tuning.json]

For each world (ranks as processes; on one GPU they share it: run under MPS, as users should),
one-shot and two-shot run a float32 all_reduce in place at every size (`python -m ringreduce.bench`,
RINGREDUCE_CUDA_ALGO forced). Auto picks between those two only (on the symmetric workspace the
ring runs where ranks cannot map each other, never by size): one-shot from the smallest size up to
the last before two-shot is faster by more than MARGIN (one batch's noise must not move the
threshold: the first H200 run of the workspace had the same kernel at 19 and 38 us in two runs of
4 KiB). Check the table in with the machine it came from
(the entry records device, date, command, MPS and every median). `--from roofline.json` takes the
medians of a `gpu_roofline.py --json` run under MPS instead of running its own. Without a GPU
nothing here runs but the threshold arithmetic, which tests/test_gpu_tools.py checks.
"""
import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_roofline as roof  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = os.path.join(ROOT, "ringreduce", "gpu_tuning.json")
MEASURED = ("oneshot", "twoshot")
MARGIN = 0.10


def threshold(times, sizes):
    """oneshot_max in bytes from times[algo][size] (us): one-shot up to the last size before the
    first where two-shot is faster by more than MARGIN; 0 where that is the smallest size (auto then
    runs two-shot at every size). A size missing for one-shot counts as a loss for it."""
    inf = float("inf")
    t = lambda algo, s: times.get(algo, {}).get(s, inf)  # noqa: E731
    oneshot_max = 0
    for s in sorted(sizes):
        if t("oneshot", s) > t("twoshot", s) * (1 + MARGIN):
            break
        oneshot_max = s
    return oneshot_max


def sym_blocks(plain, variants, current=None):
    """The workspace's most blocks for the table: variants[blocks][algo] = {size: us} are runs with
    RINGREDUCE_CUDA_SYM_BLOCKS=blocks, plain[algo] the same algorithms with the blocks the table
    gave them (current; None: the default). A variant replaces current where, for two-shot and for
    registered where both ran, it is nowhere slower by more than MARGIN at 1 MiB and above (below,
    a piece has too few 32 KiB parts for the cap to matter) and, at the plain two-shot's largest
    size, faster by more than MARGIN; of those, the fastest there (a variant cut short before that
    size does not count). Otherwise current stays."""
    big = [s for s in plain.get("twoshot", {}) if s >= 1 << 20]
    if not big:
        return current
    top = max(big)
    best, best_t = current, plain["twoshot"][top] / (1 + MARGIN)
    for blocks, runs in sorted(variants.items()):
        t = runs.get("twoshot", {}).get(top)
        if t is None or t >= best_t:
            continue
        if all(runs.get(algo, {})[s] <= base[s] * (1 + MARGIN)
               for algo, base in plain.items() for s in set(base) & set(runs.get(algo, {})) if s >= 1 << 20):
            best, best_t = blocks, t
    return best


def update_table(path, entry):
    """Replaces the entry of the same (device, world, ranks_per_device), or adds it."""
    with open(path) as f:
        doc = json.load(f)
    key = lambda e: (e["device"], e["world"], e["ranks_per_device"])  # noqa: E731
    doc["entries"] = [e for e in doc["entries"] if key(e) != key(entry)] + [entry]
    doc["entries"].sort(key=key)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def mps_running():
    ctl = shutil.which("nvidia-cuda-mps-control")
    if not ctl:
        return False
    r = subprocess.run([ctl], input="get_server_list\n", text=True, capture_output=True)
    return r.returncode == 0 and bool(r.stdout.strip())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M,256M")
    p.add_argument("--table", default=TABLE)
    p.add_argument("--timeout", type=float, default=300, help="seconds per bench run")
    p.add_argument("--from", dest="source", metavar="JSON",
                   help="no runs: take the MPS medians of a gpu_roofline.py --json file")
    a = p.parse_args(argv)
    if a.source:
        with open(a.source) as f:
            for entry in entries_from_roofline(json.load(f), " ".join(argv or sys.argv[1:]), a.table):
                update_table(a.table, entry)
                print(describe(entry), flush=True)
        return
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gpu_tune.py needs a CUDA device")
    sizes = [roof.parse_size(s) for s in a.sizes.split(",")]
    device = torch.cuda.get_device_name()
    for world in (int(w) for w in a.worlds.split(",")):
        per_device = -(-world // torch.cuda.device_count())  # the bench's round-robin placement
        times = {algo: roof.run_bench(world, algo, sizes, a.timeout) for algo in MEASURED}
        entry = make_entry(device, world, per_device, times, mps_running(), torch.__version__,
                           "python benchmarks/gpu_tune.py " + " ".join(argv or sys.argv[1:]),
                           current_blocks(a.table, device, world, per_device))
        update_table(a.table, entry)
        print(describe(entry), flush=True)


def make_entry(device, world, per_device, times, mps, torch_version, command, blocks=None):
    """An entry of the table from times[algo] = {size: us} (one-shot and two-shot; with
    blocks, also the runs that chose them)."""
    sizes = sorted({s for algo in MEASURED for s in times.get(algo, {})})
    e = {"device": device, "world": world, "ranks_per_device": per_device,
         "oneshot_max": threshold(times, sizes)}
    if blocks:
        e["sym_blocks"] = blocks
    return {**e, "date": datetime.date.today().isoformat(), "mps": mps, "torch": torch_version,
            "command": command,
            "median_us": {algo: {str(s): round(v, 2) for s, v in sorted(ts.items())}
                          for algo, ts in times.items()}}


def current_blocks(path, device, world, per_device):
    """The sym_blocks of the table's entry (what the plain runs used), or None."""
    try:
        with open(path) as f:
            entries = json.load(f)["entries"]
    except (OSError, ValueError, KeyError):
        return None
    for e in entries:
        if (e["device"], e["world"], e["ranks_per_device"]) == (device, world, per_device):
            return e.get("sym_blocks")
    return None


def entries_from_roofline(doc, args, table=TABLE):
    """One entry per world of a gpu_roofline.py --json document's MPS runs (its ranks share one
    GPU: ranks per device = world). A world without both forced runs (one-shot and two-shot, each
    with a median) has nothing to tune from: no entry, and it is said on stderr (session 24's
    roofline, cut after its auto run, would otherwise have written one-shot <= 0 B: two-shot at
    every size). Runs with blocks ("twoshot@64", "registered@64") against the plain ones choose
    the entry's sym_blocks (sym_blocks()); the table's current value stays otherwise."""
    out = []
    for world in sorted({r["world"] for r in doc["results"] if r["mps"] == "on"}):
        runs = {r["algo"]: {int(s): v for s, v in r["median_us"].items()} for r in doc["results"]
                if r["mps"] == "on" and r["world"] == world and "peer_of" not in r}
        times = {algo: runs[algo] for algo in MEASURED if runs.get(algo)}
        missing = [algo for algo in MEASURED if algo not in times]
        if missing:
            print(f"gpu_tune.py: world {world}: no {' or '.join(missing)} medians in the roofline; "
                  f"its threshold is left as it is", file=sys.stderr)
            continue
        variants = {}
        for label, ts in runs.items():
            algo, blocks = roof.split_algo(label)
            if blocks and algo in ("twoshot", "registered") and ts:
                variants.setdefault(blocks, {})[algo] = ts
        # The blocks the plain runs had: the table's entry when the roofline ran (it says), else now.
        if "plain_sym_blocks" in doc:
            current = doc["plain_sym_blocks"].get(str(world))
        else:
            current = current_blocks(table, doc["device"], world, world)
        plain = {a: runs[a] for a in ("twoshot", "registered") if runs.get(a)}
        blocks = sym_blocks(plain, variants, current)
        if blocks != current:
            print(f"gpu_tune.py: world {world}: workspace calls of at most {blocks} blocks (was "
                  f"{current or 'the default'})", file=sys.stderr)
        for b, rs in variants.items():
            times.update({f"{a}@{b}": ts for a, ts in rs.items()})
        if runs.get("registered"):
            times["registered"] = runs["registered"]
        e = make_entry(doc["device"], world, world, times, True, doc["torch"],
                       "python benchmarks/gpu_tune.py " + args, blocks)
        if variants:  # what the plain runs' medians were measured with (the check recomputes it)
            e["plain_sym_blocks"] = current
        out.append(e)
    return out


def describe(e):
    return (f"{e['device']}, world {e['world']}, {e['ranks_per_device']} ranks per device: "
            f"one-shot <= {e['oneshot_max']} B, two-shot above; workspace calls of at most "
            f"{e.get('sym_blocks', 'the default')} blocks")


if __name__ == "__main__":
    main()
