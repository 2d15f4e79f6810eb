"""DDP training step time on GPUs: a transformer of >= 100 M parameters, DDP's default 25 MiB buckets,
ringreduce's hooks and backend beside torch's, NCCL and Gloo, and the floors.

    python benchmarks/ddp_step_gpu.py [--world 2] [--iters 20] [--layers 8] [--variants ...]

Ranks are processes, one per GPU where there are several, else sharing GPU 0 (start MPS first:
`nvidia-cuda-mps-control -d`; without it they take turns in time slices). Each rank holds one DDP
copy of the same model per variant, started from the same weights, trained on the same data:

  ringreduce    DDP + ringreduce.ddp.allreduce_hook (the bucket reduced where it lies from its
                second step on: imported memory)
  rr_backend    DDP on a group of ringreduce's torch.distributed backend (no hook)
  rr_bf16_wire  DDP + ringreduce.ddp.bf16_wire_hook (bf16 on the wire, exact float32 sum)
  rr_fp8_wire   DDP + ringreduce.ddp.fp8_wire_hook
  torch_bf16    DDP on NCCL + torch's bf16_compress_hook
  nccl          DDP on NCCL (no hook). On one GPU NCCL runs two ranks only as separate hosts
                (distinct NCCL_HOSTID: its socket transport), so the row says "nccl/socket"
  gloo          DDP on Gloo (CUDA tensors through host memory)
  noop_hook     a hook that returns the bucket unreduced: DDP's bucket copies, no communication
                (no all-reduce beats it)
  no_sync       the step inside no_sync(): DDP's reducer skipped

One iteration times one step of each variant, in an order that rotates every iteration; each step
starts after a barrier and a device synchronize, and its time is the slowest rank's. The table:
median and p10-p90, the ratio to the noop_hook floor, and the paired ratio (median over iterations
of this variant / noop_hook in the same iteration: robust to drift). A variant that cannot run here
is listed with why. The parameters of every variant are compared with rr's after training.
"""
import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

VARIANTS = ("ringreduce", "rr_backend", "rr_bf16_wire", "rr_fp8_wire", "torch_bf16", "nccl", "gloo",
            "noop_hook", "no_sync")
FLOOR = "noop_hook"


def noop_hook(state, bucket):
    import torch
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def make_model(args):
    """A transformer encoder: layers x (attention 4 d^2 + feed-forward 8 d^2) parameters."""
    import torch.nn as nn
    layer = nn.TransformerEncoderLayer(args.d_model, args.heads, 4 * args.d_model, dropout=0.0,
                                       batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False)


def params_of(model):
    import torch
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def rank_main(rank, world, store_path, args, q):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ringreduce as rr
    from ringreduce import ddp as rr_ddp

    ngpu = torch.cuda.device_count()
    dev = torch.device("cuda", rank % ngpu)
    torch.cuda.set_device(dev)
    if ngpu < world:  # ranks share a GPU: NCCL < 2.30 only as separate hosts (its sockets)
        os.environ.setdefault("NCCL_MULTI_RANK_GPU_ENABLE", "1")
        if torch.cuda.nccl.version() < (2, 30):
            os.environ["NCCL_HOSTID"] = f"ddp-step-rank-{rank}"
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        groups, skipped = {}, {}
        for name in args.variants:
            try:
                if name == "rr_backend":
                    groups[name] = dist.new_group(backend="ringreduce")
                elif name in ("nccl", "torch_bf16"):
                    groups[name] = groups.get("nccl") or groups.get("torch_bf16") or dist.new_group(backend="nccl")
                else:
                    groups[name] = None  # the default (Gloo) group; the hooks bring their own path
            except Exception as e:  # noqa: BLE001
                skipped[name] = f"{type(e).__name__}: {e}"
        models, optims = {}, {}
        for name in args.variants:
            if name in skipped:
                continue
            torch.manual_seed(0)
            model = DDP(make_model(args).to(dev), device_ids=[dev.index], bucket_cap_mb=25,
                        process_group=groups[name])
            hooks = {"ringreduce": rr_ddp.allreduce_hook, "rr_bf16_wire": rr_ddp.bf16_wire_hook,
                     "rr_fp8_wire": rr_ddp.fp8_wire_hook, "torch_bf16": default_hooks.bf16_compress_hook,
                     "noop_hook": noop_hook}
            if name in hooks:
                model.register_comm_hook(groups[name] if name == "torch_bf16" else None, hooks[name])
            models[name] = model
            optims[name] = torch.optim.SGD(model.parameters(), lr=1e-5)
        n_params = sum(p.numel() for p in make_model(args).parameters())
        g = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(args.batch, args.seq, args.d_model, device=dev, generator=g)
        y = torch.randn(args.batch, args.seq, args.d_model, device=dev, generator=g)
        names = [n for n in args.variants if n in models]
        times = {name: [] for name in names}
        for it in range(args.warmup + args.iters):
            shift = it % len(names)
            for name in names[shift:] + names[:shift]:
                model, opt = models[name], optims[name]
                try:
                    torch.cuda.synchronize()
                    dist.barrier()
                    t0 = time.perf_counter()
                    with model.no_sync() if name == "no_sync" else contextlib.nullcontext():
                        opt.zero_grad(set_to_none=False)
                        with torch.autocast("cuda", dtype=torch.bfloat16):
                            loss = torch.nn.functional.mse_loss(model(x), y)
                        loss.backward()
                        opt.step()
                    torch.cuda.synchronize()
                    elapsed = time.perf_counter() - t0
                except Exception as e:  # noqa: BLE001 - a variant that fails here is reported
                    skipped.setdefault(name, f"{type(e).__name__}: {e}"[:300])
                    elapsed = float("nan")
                if it >= args.warmup:
                    times[name].append(elapsed)
        slowest = {}
        for name in names:
            t = torch.tensor(times[name], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slowest[name] = t.tolist()
        base = params_of(models[names[0]])
        diffs = {name: (params_of(models[name]) - base).abs().max().item() for name in names}
        q.put((rank, "ok", (n_params, slowest, skipped, diffs, names[0])))
    except BaseException as e:
        q.put((rank, "error", repr(e)))
        raise
    finally:
        rr.destroy()
        dist.destroy_process_group()


def run(args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="rr-ddp-gpu-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=rank_main, args=(r, args.world, store, args, q))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        results = {}
        try:
            for _ in range(args.world):
                rank, status, value = q.get(timeout=args.timeout)
                if status != "ok":
                    raise RuntimeError(f"rank {rank} failed: {value}")
                results[rank] = value
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    skipped = {}
    for r in sorted(results):
        for name, why in results[r][2].items():
            skipped.setdefault(name, f"rank {r}: {why}")
    n_params, slowest, _, diffs, first = results[0]
    return n_params, slowest, skipped, diffs, first


def percentile(values, pct):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(pct / 100 * (len(s) - 1))))]


def table(slowest, skipped, label=lambda n: n):
    """The rows: median, p10-p90, vs the floor, paired vs the floor (ms and ratios)."""
    lines = [f"{'variant':>13} {'median ms':>10} {'p10-p90 ms':>17} {'vs ' + FLOOR:>12} {'paired':>7}"]
    floor = slowest.get(FLOOR)
    for name, t in slowest.items():
        if name in skipped or not t:
            continue
        med = statistics.median(t)
        ratio = paired = float("nan")
        if floor:
            ratio = med / statistics.median(floor)
            paired = statistics.median(v / f for v, f in zip(t, floor))
        lines.append(f"{label(name):>13} {med * 1e3:>10.2f} {percentile(t, 10) * 1e3:>8.2f}-"
                     f"{percentile(t, 90) * 1e3:<8.2f} {ratio:>11.3f}x {paired:>6.3f}x")
    for name, why in skipped.items():
        lines.append(f"{label(name):>13} not run: {why}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8, help="encoder layers (8 x d_model 1024: 101 M)")
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--timeout", type=float, default=540)
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        sys.exit("ddp_step_gpu.py: needs a CUDA device (benchmarks/ddp_step.py times DDP on the CPU)")
    if FLOOR not in args.variants:
        args.variants.append(FLOOR)
    n_params, slowest, skipped, diffs, first = run(args)
    sharing = torch.cuda.device_count() < args.world
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, "
          f"world {args.world}{' sharing one GPU' if sharing else ''}; transformer {args.layers} x "
          f"d_model {args.d_model} ({n_params / 1e6:.1f} M parameters), batch {args.batch} x seq "
          f"{args.seq} per rank, bf16 autocast, DDP buckets 25 MiB; {args.iters} iterations after "
          f"{args.warmup} warm-up; medians of the slowest rank's step")
    socket = sharing and torch.cuda.nccl.version() < (2, 30)  # ranks posing as hosts
    print(table(slowest, skipped, lambda n: "nccl/socket" if n == "nccl" and socket else n))
    print("# max |parameter - " + first + "'s| after training: " +
          ", ".join(f"{n} {d:.1e}" for n, d in diffs.items() if n != first))


if __name__ == "__main__":
    main()
