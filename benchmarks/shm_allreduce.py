"""ringreduce.all_reduce (shared-memory ring) vs torch.distributed.all_reduce on Gloo, CPU, float32.

Both run in the same processes, alternating iteration by iteration. An iteration is a checked,
untimed call, then a Gloo barrier so every rank starts together, then agg calls back to back
(enough to move 1 MiB, at most 32; 1 from 1 MiB up) timed together: the time is per call, rank
0's, median over --iters. Timing single calls after a barrier would add the barrier's skew (tens
of microseconds) to calls that take a few. Also prints the machine's memory
copy bandwidth measured in the same run (read + write counted), the physical limit here.

    python benchmarks/shm_allreduce.py --nranks 2,4
    RINGREDUCE_SLICE_BYTES=65536 python benchmarks/shm_allreduce.py --nranks 2   # tuning
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp


def parse_size(s):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("B")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def fmt_size(b):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= div:
            return f"{b / div:g} {unit}"
    return f"{b} B"


def copy_bandwidth(nbytes=256 << 20, iters=5):
    """GB/s of a large tensor copy, counting bytes read plus bytes written."""
    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times) / 1e9


def worker(rank, world, store_path, sizes, iters, warmup, queue):
    import torch.distributed as dist
    import ringreduce as rr
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    rows = []
    for nbytes in sizes:
        n = nbytes // 4
        t = torch.ones(n)
        ring, gloo = [], []
        agg = max(1, min(32, (1 << 20) // nbytes))
        for it in range(warmup + iters):
            for name, fn, acc in (("ringreduce", rr.all_reduce, ring),
                                  ("gloo", dist.all_reduce, gloo)):
                t.fill_(1.0)  # checked, untimed call
                fn(t)
                if t[0].item() != world or t[-1].item() != world:
                    raise AssertionError(f"{name}: wrong result {t[0].item()} at {nbytes} B")
                t.zero_()  # timed calls reduce zeros: the same work, values that never overflow
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(agg):
                    fn(t)
                dt = (time.perf_counter() - t0) / agg
                if it >= warmup:
                    acc.append(dt)
        rows.append((nbytes, statistics.median(ring), statistics.median(gloo)))
    if rank == 0:
        queue.put(rows)
    rr.destroy()
    dist.destroy_process_group()


def run(world, sizes, iters, warmup):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=worker, args=(r, world, os.path.join(tmp, "store"), sizes, iters,
                                                  warmup, q)) for r in range(world)]
        for p in procs:
            p.start()
        rows = q.get(timeout=1800)
        for p in procs:
            p.join()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nranks", default="2,4", help="comma-separated world sizes")
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M", help="comma-separated bytes (K/M/G)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    print(f"# machine: {os.cpu_count()} cores, torch {torch.__version__}, float32 SUM, "
          f"median of {args.iters}, rank 0's time per call, back to back after a barrier")
    print(f"# memory copy bandwidth (read+write): {copy_bandwidth():.1f} GB/s")
    for world in (int(w) for w in args.nranks.split(",")):
        rows = run(world, sizes, args.iters, args.warmup)
        factor = 2 * (world - 1) / world
        print(f"\n## world {world}")
        print("| size | ringreduce (us) | gloo (us) | ringreduce busbw (GB/s) | gloo busbw (GB/s) "
              "| speedup |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for nbytes, tr, tg in rows:
            print(f"| {fmt_size(nbytes)} | {tr * 1e6:.1f} | {tg * 1e6:.1f} | "
                  f"{nbytes / tr * factor / 1e9:.2f} | {nbytes / tg * factor / 1e9:.2f} | "
                  f"{tg / tr:.1f}x |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
