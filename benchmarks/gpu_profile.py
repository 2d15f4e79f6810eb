"""Where a small CUDA all_reduce's time goes: the host, or the kernel (issue 50's 4 KiB target).

    python benchmarks/gpu_profile.py [--nranks 2] [--size 4K] [--calls 300]

Ranks are processes on this host's GPUs (round robin; on one GPU they share it: start MPS). Each
runs --calls float32 `rr.all_reduce` in place back to back, twice: timed by the host (the enqueue
rate, then the wall time to the device's end), then under torch.profiler (CPU and CUDA activity).
Rank 0 prints one line: host us per call, wall us per call, the collective kernel's median duration
on the device, and the median interval between two of its starts. Host-bound: the interval is the
host's time and the kernel ends well within it; device-bound: the interval is the kernel's
duration. The first H200 run of the workspace had 4 KiB at 19 us in one run and 34-39 us in
others with the same kernel (docs/benchmark-log.md, B17): this says which side moved.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_roofline as roof  # noqa: E402


def summarize(kernels, calls):
    """kernels: [(name, start_us, duration_us)] of one rank's profile. The collective's kernel is
    the most frequent name with at least `calls` launches (one per call); None if there is none.
    Returns {name, count, median_us, interval_us} (interval: median gap between consecutive starts).
    Medians: the first kernel of a profiled run waits for a peer still starting its profiler (the
    H200 run of session 24 had a mean of 3,261 us beside 15 us between starts)."""
    counts = {}
    for name, _, _ in kernels:
        counts[name] = counts.get(name, 0) + 1
    frequent = [n for n, c in counts.items() if c >= calls]
    if not frequent:
        return None
    name = max(frequent, key=lambda n: counts[n])
    mine = sorted((s, d) for n, s, d in kernels if n == name)
    starts = [s for s, _ in mine]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    return {"name": name, "count": len(mine), "median_us": statistics.median(d for _, d in mine),
            "interval_us": statistics.median(gaps) if gaps else float("nan")}


def worker(rank, world, size, calls, init):
    import torch
    import torch.distributed as dist
    import ringreduce as rr
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    t = torch.ones(max(1, size // 4), device=dev)
    for _ in range(50):
        rr.all_reduce(t)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        rr.all_reduce(t)
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    dist.barrier()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(calls):
            rr.all_reduce(t)
        torch.cuda.synchronize()
    dist.barrier()
    if rank == 0:
        kernels = [(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        s = summarize(kernels, calls)
        line = (f"size {roof.human(size)}, world {world}: host {host / calls * 1e6:.1f} us/call, "
                f"wall {wall / calls * 1e6:.1f} us/call")
        if s is None:
            line += f"; no kernel with {calls} launches in the profile ({len(kernels)} CUDA events)"
        else:
            line += (f"; kernel {s['name'][:60]}: {s['count']} launches, {s['median_us']:.1f} us "
                     f"median, {s['interval_us']:.1f} us between starts")
        print(line, flush=True)
    rr.destroy()
    dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nranks", type=int, default=2)
    p.add_argument("--size", default="4K", help="bytes per rank, e.g. 4K, 1M")
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args(argv)
    import torch
    import torch.multiprocessing as mp
    if not torch.cuda.is_available():
        raise SystemExit("gpu_profile.py needs a CUDA device")
    with tempfile.TemporaryDirectory() as d:
        init = "file://" + os.path.join(d, "store")
        mp.spawn(worker, args=(a.nranks, roof.parse_size(a.size), a.calls, init), nprocs=a.nranks)


if __name__ == "__main__":
    main()
