"""Auto's steps measured on the machine itself (issue 85): the shm ring's own algorithms timed on the
real group at its first use, once per machine class, cached outside the package.

The table (cpu_tuning.json) is keyed by a CPU model string, and two machines of one model string
can disagree (a 300 MiB L3 guest against the 260 MiB one an entry came from). So the key here is
what the passes depend on: the model, every cache level's size, the cores the ranks share, the
world size, the slice and cma's block. Rank 0 decides (its cache file or its timings) and
publishes the steps through the communicator's setup store: every rank runs the same steps, or
calls would mismatch.
"""
import hashlib
import json
import logging
import math
import os
import time
import warnings

import torch

from . import _C

log = logging.getLogger("ringreduce")

# Sizes timed (bytes): where the table's choice and Open MPI's lead were measured to differ
# (issue 85: 1-16 MiB). Below the first, the table's or the defaults' steps stay.
SIZES = (1 << 20, 4 << 20, 16 << 20)
# Timed rounds per (size, algorithm); the median is kept.
ROUNDS = 3
# Timed calls per (round, size, algorithm), the fastest kept: a rank descheduled (4 ranks on 2
# cores) only adds time, and one such call had the ring at 1 MiB 1.2-1.4 ms against 250 us (B36).
CALLS = 2
# Fewer rounds once this much time has gone (rank 0's clock; all ranks stop after the same round):
# a round is 4 algorithms (ring, twoshot, cma, cmawhole) x 21 MiB, each called 1 + CALLS times;
# a calibration took 220 ms at world 2 and 270-328 ms at world 4 on the idle AMD EPYC (B36), so
# the cost stays near this bound plus a round.
BUDGET_S = 0.25
# Another algorithm replaces the fallback's at a size only if it is this much faster: the
# dev machine's run-to-run noise at 4-16 MiB is 5-10% (docs/cpu-passes.md).
MARGIN = 0.90
# Written into every cache file (and part of its name): a file of another format is recalibrated.
# 2: steps may name cmawhole; the key has cma's block. 3: the fallback's steps from twice the last
# size timed (a format-2 file carries its last choice to every size above). 4: timed warm (a
# format-3 file's cold timings could pick an algorithm slower than the table's, B36).
FORMAT = 4
# The names a cached step may take (csrc/shm/options.h's kStepAlgos and kCmaWholeStep).
STEP_NAMES = tuple(_C.SHM_STEP_ALGOS)


def caches():
    """cpu0's caches from sysfs as ["L1 Data 32K", ...]; [] where sysfs has none."""
    root = "/sys/devices/system/cpu/cpu0/cache"
    out = []
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith("index"))
    except OSError:
        return out
    for n in names:
        try:
            vals = [open(os.path.join(root, n, f)).read().strip() for f in ("level", "type", "size")]
        except OSError:
            continue
        out.append("L%s %s %s" % tuple(vals))
    return out


def machine_key(model, cores, world, slice_bytes, cma_block_bytes=None):
    """cma_block_bytes: the block a "cma" step reads in (None: the slice)."""
    return {"format": FORMAT, "cpu_model": model, "caches": caches(), "cores": cores,
            "world": world, "slice_bytes": slice_bytes,
            "cma_block_bytes": slice_bytes if cma_block_bytes is None else cma_block_bytes}


def cache_path(key):
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(root, "ringreduce", f"cpu-{digest}.json")


def read_cache(path, key):
    """The cached steps for key, or None (no file; a corrupt or foreign one, with a warning)."""
    try:
        with open(path) as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        warnings.warn(f"ringreduce: calibration cache {path} unreadable ({e}); calibrating again")
        return None
    try:
        data = json.loads(raw)
        if data["key"] != key:
            raise ValueError(f"its key {data['key']} is not this machine's {key}")
        steps = [(int(b), str(a)) for b, a in data["steps"]]
        if any(a not in STEP_NAMES or b < 0 for b, a in steps):
            raise ValueError(f"bad steps {data['steps']}")
        return steps, data
    except (ValueError, KeyError, TypeError) as e:
        warnings.warn(f"ringreduce: calibration cache {path} ignored ({type(e).__name__}: {e}); "
                      f"calibrating again")
        log.warning("ringreduce: calibration cache %s ignored (%s)", path, e)
        return None


def write_cache(path, key, steps, result):
    """Atomic (rename): a rank of another job reading it meanwhile sees the old file or the new."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = f"{path}.{os.getpid()}.part"
    with open(part, "w") as f:
        json.dump(dict(result, key=key, steps=[list(s) for s in steps],
                       date=time.strftime("%Y-%m-%d %H:%M:%S")), f, indent=1)
    os.replace(part, path)


def step_algo(steps, nbytes):
    """The algorithm steps give an all_reduce of nbytes (the ring below the first step)."""
    algo = "ring"
    for b, a in sorted(steps):
        if nbytes >= b:
            algo = a
    return algo


def time_algos(native, algos, op_codes, rank, sizes=SIZES, rounds=ROUNDS, budget_s=BUDGET_S):
    """{algo: {size: median us}}, every algorithm forced by a single step from 0. Each is timed
    warm, as a training loop and the bench call it: the timed calls follow an untimed one of the same
    algorithm on the same buffer, and the order of the algorithms turns every round. (Timed cold,
    the first algorithm of each size paid for the cache the one before it evicted: on the AMD EPYC
    the ring at 1 MiB timed 192 us at world 2 and 1,022 at world 4 against the bench's 88 and 278,
    and lost to two-shot and cmawhole it beats, B36.) Collective: every rank must call it with the
    same algos and sizes. Leaves the native steps to the caller."""
    def call_us(buf):
        t0 = time.perf_counter()
        native.all_reduce(buf, op_codes["SUM"], False, 0)
        return (time.perf_counter() - t0) * 1e6

    start = time.perf_counter()
    bufs = {s: torch.ones(s // 4, dtype=torch.float32) for s in sizes}
    times = {a: {s: [] for s in sizes} for a in algos}
    for r in range(rounds):
        order = algos[r % len(algos):] + algos[:r % len(algos)]
        for s in sizes:
            for a in order:
                native.set_auto_steps([(0, a)])
                call_us(bufs[s])  # untimed: pages, slots, the peers' pins
                times[a][s].append(min(call_us(bufs[s]) for _ in range(CALLS)))
        # rank 0's verdict on the budget, by a one-element MAX over the ring (one-shot size)
        over = torch.tensor([float(rank == 0 and time.perf_counter() - start > budget_s)])
        native.all_reduce(over, op_codes["MAX"], False, 0)
        if over.item():
            break
    return {a: {s: round(sorted(v)[len(v) // 2], 1) for s, v in per.items()}
            for a, per in times.items()}


def derive_steps(medians, fallback, sizes=SIZES, margin=MARGIN):
    """Auto's steps from the timings: at each size the fallback's algorithm, unless another measured
    faster than margin x its time; the winner of a size from the geometric middle between it and
    the size below (the first from itself); the fallback's steps below the first size, and from
    twice the last size on (the middle towards 4x it, which nothing timed: on the 480 MiB-L3
    Intel guest cma won at 16 MiB and was 1.17x slower than the table's ring at 64 MiB, B35)."""
    def fallback_at(nbytes):
        algo = step_algo(fallback, nbytes)
        return algo if algo in medians else "ring"  # e.g. cma in the table, denied by the probe

    steps = [(b, a) for b, a in sorted(fallback) if b < sizes[0]]
    reach = 2 * sizes[-1]
    for i, s in enumerate(sizes):
        base = fallback_at(s)
        best = min(medians, key=lambda a: medians[a][s])
        pick = best if medians[best][s] < margin * medians[base][s] else base
        start = s if i == 0 else math.isqrt(sizes[i - 1] * s)
        if step_algo(steps, start) != pick or not steps:
            steps.append((start, pick))
    for b in [reach] + sorted(b for b, _ in fallback if b > reach):
        if step_algo(steps, b) != fallback_at(b):
            steps.append((b, fallback_at(b)))
    return steps
