"""What a call costs through torch.distributed's API on ringreduce's backend, against the direct
call, in the same processes (issue 27's targets): float32 SUM all-reduce in place, world 2 by
default, one process per rank on this machine.

    OMP_NUM_THREADS=1 python benchmarks/backend_dispatch.py [--world 2] [--sizes 4K,256K]

Rows, per size (median of --reps batches of calls, us per call, rank 0's clock; every rank makes
the same calls in the same order):
  rr.all_reduce                      the direct API, synchronous (the baseline of the ratios)
  dist.all_reduce                    torch.distributed on a ringreduce group, async_op=False
  dist.all_reduce async + wait       async_op=True, then Work.wait() (DDP's buckets take this path)
  rr.all_reduce async + wait         the direct API's async path
  dist.all_reduce (Gloo)             the same call on a Gloo group of the same ranks
  dist.all_reduce, 1-rank group      on a ringreduce group of this rank alone: what torch's
                                     dist.all_reduce (Python wrapper, dispatcher, Work) plus our
                                     backend's entry cost with nothing to communicate
  rr.all_reduce, 1-rank group        the direct API on that group (its dispatch alone)
  dist.all_reduce, torch's fake group  on torch's own FakeProcessGroup, whose all_reduce does
                                     nothing: the floor torch's API puts under every backend
Targets (issue 27): at 4 KiB, dist sync <= 2x and both async + wait <= 3x rr.all_reduce; at
256 KiB all within 1.2x.
"""
import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

TARGETS = {  # row -> (max ratio at <= 64 KiB, max ratio above)
    "dist.all_reduce": (2.0, 1.2),
    "dist.all_reduce async + wait": (3.0, 1.2),
    "rr.all_reduce async + wait": (3.0, 1.2),
}


def parse_size(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(text.rstrip("KM")) * mult


def rank_main(rank, world, store_path, args, q):
    import torch
    import torch.distributed as dist
    import ringreduce as rr

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("ringreduce", store=store, rank=rank, world_size=world)
    gloo = dist.new_group(backend="gloo")
    solo = [dist.new_group([r], backend="ringreduce") for r in range(world)][rank]
    try:  # registers the "fake" backend (torch's test helper; absent from some builds)
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
        fake = dist.new_group(backend="fake")
    except Exception:
        fake = None
    results = []
    for size in args.sizes:
        t = torch.ones(size // 4)
        rows = [
            ("rr.all_reduce", lambda: rr.all_reduce(t)),
            ("dist.all_reduce", lambda: dist.all_reduce(t)),
            ("dist.all_reduce async + wait", lambda: dist.all_reduce(t, async_op=True).wait()),
            ("rr.all_reduce async + wait", lambda: rr.all_reduce(t, async_op=True).wait()),
            ("dist.all_reduce (Gloo)", lambda: dist.all_reduce(t, group=gloo)),
            ("dist.all_reduce, 1-rank group", lambda: dist.all_reduce(t, group=solo)),
            ("rr.all_reduce, 1-rank group", lambda: rr.all_reduce(t, group=solo)),
        ] + ([("dist.all_reduce, torch's fake group", lambda: dist.all_reduce(t, group=fake))]
             if fake is not None else [])
        calls = max(20, int(args.calls * 4096 / max(size, 4096)))
        times = {name: [] for name, _ in rows}
        for name, fn in rows:  # warm-up (the first call creates the communicators)
            for _ in range(20):
                fn()
        for _ in range(args.reps):
            for name, fn in rows:  # interleaved: a slow spell of the machine hits every row
                n = calls if "Gloo" not in name else max(10, calls // 10)
                dist.barrier(group=gloo)
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    fn()
                times[name].append((time.perf_counter_ns() - t0) / n / 1000)
        results.append((size, {name: statistics.median(v) for name, v in times.items()}))
    if rank == 0:
        q.put(results)
    dist.barrier(group=gloo)
    rr.destroy()
    dist.destroy_process_group()


def fmt_size(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes", default="4K,256K")
    p.add_argument("--calls", type=int, default=2000, help="calls per batch at 4 KiB (fewer above)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    a = p.parse_args()
    a.sizes = [parse_size(s) for s in a.sizes.split(",")]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    procs = [ctx.Process(target=rank_main, args=(r, a.world, store, a, q)) for r in range(a.world)]
    for pr in procs:
        pr.start()
    results = q.get(timeout=1800)
    for pr in procs:
        pr.join(60)
    import torch
    print(f"# world {a.world}, float32 SUM in place, median of {a.reps} batches, rank 0's clock; "
          f"torch {torch.__version__}, {len(os.sched_getaffinity(0))} cores")
    missed = []
    for size, row in results:
        base = row["rr.all_reduce"]
        w = max(len(name) for name in row)
        print(f"\n{fmt_size(size):>8}{'':<{w - 5}}{'us/call':>9}  {'x rr.all_reduce':>15}  target")
        for name, us in row.items():
            limit = TARGETS.get(name, (None, None))[0 if size <= 64 << 10 else 1]
            ratio = us / base
            mark = "" if limit is None else f"<= {limit:g}" + ("" if ratio <= limit else "  MISSED")
            if limit is not None and ratio > limit:
                missed.append(f"{name} at {fmt_size(size)}: {ratio:.2f}x > {limit:g}x")
            print(f"  {name:<{w}} {us:9.1f}  {ratio:15.2f}  {mark}")
    if missed:
        print("\nmissed: " + "; ".join(missed))
    for size, row in results:
        floor = row.get("dist.all_reduce, torch's fake group")
        if floor is not None:
            print(f"{fmt_size(size)}: torch's API alone costs {floor:.1f} us a call; with the "
                  f"communication, dist.all_reduce on any backend is >= "
                  f"{1 + floor / row['rr.all_reduce']:.2f}x rr.all_reduce here")
    return 1 if (a.check and missed) else 0


if __name__ == "__main__":
    sys.exit(main())
