"""DDP training step time on CPU: DDP's built-in Gloo all-reduce vs ringreduce (hook and backend).

    python benchmarks/ddp_step.py [--worlds 2 4] [--iters 20] [--batch 8]

Each world size runs in its own processes (Gloo group over a file store). Every rank holds four
copies of the same model, started from the same weights: DDP without a hook (Gloo reduces the
buckets), DDP with ringreduce.ddp.allreduce_hook, DDP without a hook on a group of ringreduce's
torch.distributed backend (rr_backend: DDP's own bucket all-reduce on the ring), and two floors: DDP
with a hook that returns
the bucket unreduced (noop_hook: all of DDP's bucket copies, no communication; no all-reduce can
beat it) and the step inside no_sync() (no_sync: DDP skips its reducer). One iteration times one
step of each, in an order that rotates every iteration; each step starts after a barrier and its
time is the slowest rank's.
The table gives the median (and 10th-90th percentiles) over the iterations after warm-up, the ratio
of medians, and the median of the per-iteration ratios (paired: robust to a shared machine's load).
"""
import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

VARIANTS = ("gloo", "ringreduce", "rr_backend", "noop_hook", "no_sync")


def noop_hook(state, bucket):
    """A DDP comm hook that communicates nothing (the bucket comes back as it went in)."""
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def make_model(width, hidden):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, width))


def rank_main(rank, world, store_path, args, q):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ringreduce as rr
    from ringreduce import ddp as rr_ddp

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    try:
        rr_group = dist.new_group(backend="ringreduce")
        models, optims = {}, {}
        for name in VARIANTS:
            torch.manual_seed(0)
            model = DDP(make_model(args.width, args.hidden),
                        gradient_as_bucket_view=args.bucket_view,
                        process_group=rr_group if name == "rr_backend" else None)
            if name == "ringreduce":
                model.register_comm_hook(None, rr_ddp.allreduce_hook)
            elif name == "noop_hook":
                model.register_comm_hook(None, noop_hook)
            models[name] = model
            optims[name] = torch.optim.SGD(model.parameters(), lr=1e-4)
        n_params = sum(p.numel() for p in models["gloo"].parameters())
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width,
                                                                             generator=g)
        times = {name: [] for name in VARIANTS}
        for it in range(args.warmup + args.iters):
            shift = it % len(VARIANTS)
            for name in VARIANTS[shift:] + VARIANTS[:shift]:
                model, opt = models[name], optims[name]
                dist.barrier()
                t0 = time.perf_counter()
                with model.no_sync() if name == "no_sync" else contextlib.nullcontext():
                    opt.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                elapsed = time.perf_counter() - t0
                if it >= args.warmup:
                    times[name].append(elapsed)
        # The step time of an iteration is the slowest rank's.
        slowest = {}
        for name in VARIANTS:
            t = torch.tensor(times[name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slowest[name] = t.tolist()
        # The ranks must still agree: the ringreduce models were trained with the same data.
        b = torch.cat([p.detach().reshape(-1) for p in models["gloo"].parameters()])
        max_diff = max((torch.cat([p.detach().reshape(-1) for p in models[name].parameters()]) - b)
                       .abs().max().item() for name in ("ringreduce", "rr_backend"))
        q.put((rank, "ok", (n_params, slowest, max_diff)))
    except BaseException as e:
        q.put((rank, "error", repr(e)))
        raise
    finally:
        rr.destroy()
        dist.destroy_process_group()


def run_world(world, args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="rr-ddp-bench-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=rank_main, args=(r, world, store, args, q))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(world):
                rank, status, value = q.get(timeout=args.timeout)
                if status != "ok":
                    raise RuntimeError(f"rank {rank} failed: {value}")
                results[rank] = value
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return results[0]


def percentile(values, pct):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(pct / 100 * (len(s) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="samples per rank per step")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--bucket-view", action="store_true",
                    help="DDP(gradient_as_bucket_view=True) for all three (no gradient copies)")
    ap.add_argument("--timeout", type=float, default=1200)
    args = ap.parse_args()

    import torch
    print(f"# torch {torch.__version__}, {len(os.sched_getaffinity(0))} CPUs, model "
          f"Linear({args.width},{args.hidden})-ReLU-Linear({args.hidden},{args.hidden})-ReLU-"
          f"Linear({args.hidden},{args.width}), batch {args.batch}/rank, "
          f"{args.iters} timed iterations after {args.warmup} warm-up, "
          f"gradient_as_bucket_view={args.bucket_view}; load average at start "
          f"{os.getloadavg()[0]:.2f}")
    print(f"{'world':>5} {'params':>8} {'variant':>11} {'median ms':>10} {'p10-p90 ms':>15} "
          f"{'vs gloo':>8} {'paired':>7}")
    for world in args.worlds:
        n_params, slowest, max_diff = run_world(world, args)
        base = statistics.median(slowest["gloo"])
        for name in VARIANTS:
            t = slowest[name]
            med = statistics.median(t)
            # paired: median over iterations of gloo's time / this variant's in the same iteration
            # (the variants alternate, so this cancels slow drifts of a shared machine's load).
            paired = statistics.median(g / v for g, v in zip(slowest["gloo"], t))
            print(f"{world:>5} {n_params / 1e6:>7.1f}M {name:>11} {med * 1e3:>10.1f} "
                  f"{percentile(t, 10) * 1e3:>7.1f}-{percentile(t, 90) * 1e3:<7.1f} "
                  f"{base / med:>7.2f}x {paired:>6.2f}x")
        print(f"{'':>5} max |ringreduce or rr_backend - gloo| parameter difference after training: "
              f"{max_diff:.2e}; load average now {os.getloadavg()[0]:.2f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
