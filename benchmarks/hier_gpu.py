"""GPUs on several hosts (issue 74), emulated on the GPUs of one machine: the two-level plan beside the
flat NCCL ring and NCCL's own all_reduce, with and without the narrow wire between hosts.

    python benchmarks/hier_gpu.py [--hosts 2] [--per-host 2] [--sizes 16M,64M] [--iters 20]

Ranks are processes, rank r on GPU r % device_count (one GPU: start MPS first,
`nvidia-cuda-mps-control -d`), in hosts of --per-host consecutive ranks (RINGREDUCE_HOST_ID), and
NCCL told the same (NCCL_HOSTID per host: between hosts it takes its socket transport over
loopback, as between machines; inside a host, ranks sharing a GPU need NCCL_MULTI_RANK_GPU_ENABLE,
NCCL >= 2.30). The rows, float32 SUM, each a group of its own:
  hier         ringreduce's two-level plan (p2p inside each host, NCCL between hosts; auto)
  hier/bf16    the same, bf16 on the wire between hosts (wire_dtype=torch.bfloat16)
  hier/fp8     the same, float8_e4m3fn on the wire between hosts
  rr-nccl      ringreduce's flat ring over NCCL send/recv (RINGREDUCE_TRANSPORT=nccl)
  torch-nccl   NCCL's own all_reduce (torch.distributed's NCCL backend)
Each call starts after a barrier and a device synchronize; its time is the slowest rank's. The
table: median and p10-p90 in us, and the median against hier's and against rr-nccl's in the same
run (speed-ups above 1 are faster). A row that cannot run here says why. For a shaped link between
the hosts, the namespace lab (tests/netlab.py) runs CPU ranks only so far.
"""
import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

ROWS = ("hier", "hier/bf16", "hier/fp8", "rr-nccl", "torch-nccl")


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def percentile(values, pct):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(pct / 100 * (len(s) - 1))))]


def table(times, skipped, sizes):
    """times[(row, size)] = seconds per call (slowest rank), per iteration."""
    lines = [f"{'size':>6} {'row':>11} {'median us':>10} {'p10-p90 us':>19} {'vs hier':>8} {'vs rr-nccl':>10}"]
    for size in sizes:
        base = {k: statistics.median(times[(k, size)]) for k in ("hier", "rr-nccl") if times.get((k, size))}
        for row in ROWS:
            if row in skipped:
                continue
            t = times.get((row, size))
            if not t:
                continue
            med = statistics.median(t)
            vs = [f"{base[k] / med:.2f}x" if k in base else "-" for k in ("hier", "rr-nccl")]
            lines.append(f"{size >> 20:>5}M {row:>11} {med * 1e6:>10.1f} {percentile(t, 10) * 1e6:>9.1f}-"
                         f"{percentile(t, 90) * 1e6:<9.1f} {vs[0]:>8} {vs[1]:>10}")
    for row, why in skipped.items():
        lines.append(f"{'':>6} {row:>11} not run: {why}")
    return "\n".join(lines)


def rank_main(rank, world, per_host, store_path, args, q):
    host = rank // per_host
    os.environ["RINGREDUCE_HOST_ID"] = f"hier-gpu-host-{host}"
    os.environ["NCCL_HOSTID"] = f"hier-gpu-host-{host}"
    os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    import ringreduce as rr

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        groups, skipped, calls = {}, {}, {}
        wires = {"hier/bf16": torch.bfloat16, "hier/fp8": torch.float8_e4m3fn}
        for row in args.rows:
            try:
                if row == "torch-nccl":
                    g = dist.new_group(backend="nccl")
                    calls[row] = lambda t, g=g: dist.all_reduce(t, group=g)
                else:
                    g = dist.new_group(backend="gloo")
                    os.environ["RINGREDUCE_TRANSPORT"] = "nccl" if row == "rr-nccl" else "auto"
                    w = wires.get(row)
                    calls[row] = lambda t, g=g, w=w: rr.all_reduce(t, group=g, wire_dtype=w)
                    calls[row](torch.ones(world * 128, device=dev))  # the communicator, made now
                    torch.cuda.synchronize()
                    if row == "hier":
                        kinds = [c.transport for c in rr._lifecycle.REGISTRY.live(("cuda", dev.index))]
                        if "hier" not in kinds:
                            raise RuntimeError(f"auto chose {kinds}, not hier")
                groups[row] = g
            except Exception as e:  # noqa: BLE001
                skipped[row] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        times = {}
        for size in args.sizes:
            t = torch.randn(size // 4, device=dev)
            for it in range(args.warmup + args.iters):
                for row in calls:
                    if row in skipped:
                        continue
                    dist.barrier()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    calls[row](t)
                    torch.cuda.synchronize()
                    if it >= args.warmup:
                        times.setdefault((row, size), []).append(time.perf_counter() - t0)
        q.put((rank, "ok", (times, skipped)))
    except Exception as e:  # noqa: BLE001
        q.put((rank, "error", f"{type(e).__name__}: {e}"))
    finally:
        rr._lifecycle.REGISTRY.destroy_all()
        dist.destroy_process_group()


def run(args):
    world = args.hosts * args.per_host
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="rr-hier-gpu-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=rank_main, args=(r, world, args.per_host, store, args, q))
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
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    times, skipped = {}, {}
    for r in sorted(results):
        for key, ts in results[r][0].items():  # the slowest rank's time of each call
            times[key] = [max(a, b) for a, b in zip(times[key], ts)] if key in times else list(ts)
        for row, why in results[r][1].items():
            skipped.setdefault(row, f"rank {r}: {why}")
    return times, skipped


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--sizes", default="16M,64M")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=540)
    args = ap.parse_args(argv)
    if args.hosts < 2 or args.per_host < 1:
        ap.error(f"--hosts must be >= 2 and --per-host >= 1; got {args.hosts} and {args.per_host}")
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    import torch
    if not torch.cuda.is_available():
        sys.exit("hier_gpu.py: needs a CUDA device (python -m ringreduce.bench --hosts 2 times CPU ranks)")
    times, skipped = run(args)
    print(f"# torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, "
          f"{torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}; {args.hosts} emulated hosts x "
          f"{args.per_host} ranks; float32 SUM; {args.iters} calls after {args.warmup} warm-up; the slowest "
          f"rank's time per call")
    print(table(times, skipped, args.sizes))


if __name__ == "__main__":
    main()
