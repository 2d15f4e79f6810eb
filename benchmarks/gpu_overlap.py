"""SMs left to the backward pass: a bf16 GEMM stream beside a stream of all_reduces, by the workspace's
blocks, ours beside torch's SymmetricMemory.

    python benchmarks/gpu_overlap.py [--world 2] [--sizes 16M,64M] [--blocks 8,16,24,32,64]
        [--gemm 8192] [--iters 20] [--out overlap.json]

DDP runs each bucket's all_reduce while the backward pass computes the next gradients, and every
block our kernels spin on is an SM that pass does not get. Per rank (processes; one GPU each where
there are several, else all on GPU 0: start MPS first) and per (blocks, size), three timed runs,
each after a barrier:
  alone     the GEMM stream by itself (ms per GEMM), then the all_reduce stream by itself (us per call)
  together  both enqueued at once on two streams, each timed over its own span
The table gives the GEMM's slowdown (together / alone) and the all_reduce's time alone and beside
the GEMM, the slowest rank's medians over --repeats. ours@B runs with RINGREDUCE_CUDA_SYM_BLOCKS=B
(a communicator per B); ordinary tensors (imported from their second call, as DDP's buckets).
symm-twoshot is torch's two_shot_all_reduce_ on its own symmetric tensor (its block count is its
own). The default blocks per size are chosen from this and from benchmarks/ddp_step_gpu.py (the
step time decides): docs/workspace.md.
"""
import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile


def parse_size(s):
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(s[:-1]) * mult[s[-1]]) if s[-1] in mult else int(s)


def rows_of(results):
    """{(label, size): [per-rank dicts]} -> table rows with the slowest rank's figures."""
    rows = []
    for (label, size), per_rank in sorted(results.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        g_alone = max(r["gemm_alone_ms"] for r in per_rank)
        g_with = max(r["gemm_with_ms"] for r in per_rank)
        rows.append({"label": label, "size": size, "gemm_alone_ms": g_alone, "gemm_with_ms": g_with,
                     "slowdown": g_with / g_alone if g_alone else float("nan"),
                     "ar_alone_us": max(r["ar_alone_us"] for r in per_rank),
                     "ar_with_us": max(r["ar_with_us"] for r in per_rank)})
    return rows


def table(rows):
    lines = [f"{'size':>6} {'all_reduce':>16} {'GEMM ms alone':>14} {'beside':>8} {'slowdown':>9} "
             f"{'AR us alone':>12} {'beside GEMM':>12}"]
    for r in rows:
        lines.append(f"{r['size'] >> 20:>5}M {r['label']:>16} {r['gemm_alone_ms']:>14.3f} "
                     f"{r['gemm_with_ms']:>8.3f} {r['slowdown']:>8.3f}x {r['ar_alone_us']:>12.1f} "
                     f"{r['ar_with_us']:>12.1f}")
    return "\n".join(lines)


def rank_main(rank, world, store_path, args, q):
    import torch
    import torch.distributed as dist
    import ringreduce as rr

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)
    out = {}
    try:
        a = torch.randn(args.gemm, args.gemm, device=dev, dtype=torch.bfloat16)
        b = torch.randn(args.gemm, args.gemm, device=dev, dtype=torch.bfloat16)
        c = torch.empty_like(a)
        gemm_s, ar_s = torch.cuda.Stream(), torch.cuda.Stream()

        def span(stream, fn, k):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                e0.record()
                for _ in range(k):
                    fn()
                e1.record()
            return e0, e1

        def timed(gemm=None, ar=None):
            torch.cuda.synchronize()
            dist.barrier()
            spans = {}
            if gemm:  # enqueued first: the all_reduces start beside a running GEMM
                spans["gemm"] = span(gemm_s, gemm, args.gemms)
            if ar:
                spans["ar"] = span(ar_s, ar, args.iters)
            torch.cuda.synchronize()
            return {k: e0.elapsed_time(e1) for k, (e0, e1) in spans.items()}

        def gemm():
            torch.matmul(a, b, out=c)

        configs = [(f"ours@{blk}", blk) for blk in args.blocks] + [("symm-twoshot", None)]
        for label, blk in configs:
            if label == "symm-twoshot" and args.no_symm:
                continue
            for size in args.sizes:
                n = size // 4
                if blk is not None:
                    os.environ["RINGREDUCE_CUDA_SYM_BLOCKS"] = str(blk)  # read by the new communicator
                    group = dist.new_group()
                    t = torch.ones(n, device=dev)

                    def ar():
                        rr.all_reduce(t, group=group)
                else:
                    import torch.distributed._symmetric_memory as symm_mem
                    t = symm_mem.empty(n, dtype=torch.float32, device=dev)
                    symm_mem.rendezvous(t, dist.group.WORLD.group_name)
                    t.fill_(1.0)
                    name = dist.group.WORLD.group_name

                    def ar():
                        torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", name)
                for _ in range(3):  # warm-up (the first call imports the tensor)
                    with torch.cuda.stream(ar_s):
                        ar()
                    gemm()
                samples = []
                for _ in range(args.repeats):
                    alone_g = timed(gemm=gemm)["gemm"] / args.gemms
                    alone_a = timed(ar=ar)["ar"] / args.iters * 1e3
                    both = timed(gemm=gemm, ar=ar)
                    samples.append((alone_g, alone_a, both["gemm"] / args.gemms, both["ar"] / args.iters * 1e3))
                med = [statistics.median(s[i] for s in samples) for i in range(4)]
                out[(label, size)] = {"gemm_alone_ms": med[0], "ar_alone_us": med[1],
                                      "gemm_with_ms": med[2], "ar_with_us": med[3]}
                t = None
                if blk is not None:
                    rr.destroy(group)
                    dist.destroy_process_group(group)
                torch.cuda.synchronize()
                dist.barrier()
        q.put((rank, "ok", out))
    except BaseException as e:
        q.put((rank, "error", repr(e)))
        raise
    finally:
        rr.destroy()
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", default="16M,64M")
    ap.add_argument("--blocks", default="8,16,24,32,64")
    ap.add_argument("--gemm", type=int, default=8192, help="the GEMM's M = N = K (bfloat16)")
    ap.add_argument("--gemms", type=int, default=10, help="GEMMs per timed span")
    ap.add_argument("--iters", type=int, default=20, help="all_reduces per timed span")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-symm", action="store_true", help="skip torch's SymmetricMemory rows")
    ap.add_argument("--out", help="also write the rows as JSON here")
    ap.add_argument("--timeout", type=float, default=540)
    args = ap.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.blocks = [int(b) for b in args.blocks.split(",")]
    if any(not 1 <= b <= 64 for b in args.blocks):
        ap.error(f"--blocks: each must be 1..64 (RINGREDUCE_CUDA_SYM_BLOCKS), got {args.blocks}")
    import torch
    if not torch.cuda.is_available():
        sys.exit("gpu_overlap.py: needs a CUDA device")
    if torch.cuda.device_count() < args.world:
        os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="rr-overlap-") as tmp:
        procs = [ctx.Process(target=rank_main, args=(r, args.world, os.path.join(tmp, "store"), args, q))
                 for r in range(args.world)]
        for p in procs:
            p.start()
        per_rank = []
        try:
            for _ in range(args.world):
                rank, status, value = q.get(timeout=args.timeout)
                if status != "ok":
                    sys.exit(f"gpu_overlap.py: rank {rank} failed: {value}")
                per_rank.append(value)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    results = {key: [r[key] for r in per_rank] for key in per_rank[0]}
    rows = rows_of(results)
    print(f"# {torch.cuda.get_device_name(0)}, world {args.world}, bf16 GEMM {args.gemm}^3 beside "
          f"float32 SUM all_reduces; slowest rank's medians of {args.repeats}")
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
