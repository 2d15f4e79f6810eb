"""DDP across emulated hosts joined by a shaped link: step time and accuracy per gradient hook.

    python benchmarks/ddp_hosts.py [--hosts 2] [--ranks-per-host 2] [--link 1gbit] [--steps 40]

Builds the lab (ringreduce/bench/netlab.py: network namespaces on a bridge, each link shaped by
tc tbf; needs root), then starts `torchrun --nnodes H --node-rank h` inside every host with this
file as the script. Every rank trains the same MLP (about 25 M parameters at the default sizes)
on a synthetic task (Gaussian inputs labelled by a fixed random teacher network, so that accuracy
means something and nothing is downloaded) once per variant, each from the same initial weights,
with the same batches:

  gloo            DDP as it is: its buckets all-reduced in float32 by Gloo
  rr-float32      ringreduce.ddp.allreduce_hook (float32, the two-level plan across hosts)
  rr-bf16-wire    ringreduce.ddp.bf16_wire_hook (bfloat16 between hosts, float32 sums)
  rr-fp8-wire-ef  ringreduce.ddp.fp8_wire_hook with error feedback (WireState)
  torch-bf16      torch's bf16_compress_hook over Gloo
  powersgd-r1/-r4 torch's PowerSGD hook over Gloo, matrix rank 1 and 4 (from step 2); not by
                  default: it hung here (see DEFAULT)

A step's time is the slowest rank's (forward, backward with the hook, optimizer); the table gives
the median over the steps after the first three, the speedup over gloo, and the test accuracy
after the last step. The variants run one after the other (seven such models with Adam would not
fit in memory side by side), so run it twice on a quiet machine.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("gloo", "rr-float32", "rr-bf16-wire", "rr-fp8-wire-ef", "torch-bf16", "powersgd-r1",
            "powersgd-r4")
# PowerSGD over Gloo hung here in its first compressed step (rank 0 waiting in the hook's
# all-reduce of Qs, the others in backward), with Gloo's default threads and with 16: asked for
# by name only (--variants), never by default, until the cause is known.
DEFAULT = VARIANTS[:5]


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--ranks-per-host", type=int, default=2)
    ap.add_argument("--link", default="1gbit",
                    help="tc rate of every host's link ('none': unshaped)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="per rank")
    ap.add_argument("--features", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--variants", default=",".join(DEFAULT),
                    help=f"comma list of {', '.join(VARIANTS)} (default: all but PowerSGD)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.variants = a.variants.split(",")
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}")
    return a


def make_model(a):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(a.features, a.hidden), nn.ReLU(),
                         nn.Linear(a.hidden, a.hidden), nn.ReLU(),
                         nn.Linear(a.hidden, a.features), nn.ReLU(),
                         nn.Linear(a.features, 10))


def data(a, world):
    """(train x, train y, test x, test y): a random teacher's labels of Gaussian inputs."""
    import torch
    g = torch.Generator().manual_seed(1234)
    w1 = torch.randn(a.features, 64, generator=g) / a.features ** 0.5
    w2 = torch.randn(64, 10, generator=g)
    n = a.steps * a.batch * world
    x = torch.randn(n + 2048, a.features, generator=g)
    y = (torch.tanh(x @ w1) @ w2).argmax(1)
    return x[:n], y[:n], x[n:], y[n:]


def powersgd_group():
    """A Gloo group for PowerSGD with more threads than Gloo's default two: its hook waits for
    one all-reduce inside the callback of another, and with two threads and several buckets in
    flight every thread ended up waiting (a hang seen here on the default group)."""
    import torch.distributed as dist
    opts = dist.ProcessGroupGloo._Options()
    opts._threads = 16
    return dist.new_group(backend="gloo", pg_options=opts)


def hook_for(name, group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    import ringreduce as rr
    if name == "gloo":
        return None, None
    if name == "rr-float32":
        return None, rr.ddp.allreduce_hook
    if name == "rr-bf16-wire":
        return None, rr.ddp.bf16_wire_hook
    if name == "rr-fp8-wire-ef":
        return "ef", rr.ddp.fp8_wire_hook
    if name == "torch-bf16":
        return None, default_hooks.bf16_compress_hook
    rank = int(name.rsplit("r", 1)[1])
    state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=2, min_compression_rate=0.5)
    return state, powerSGD_hook.powerSGD_hook


def worker(a):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ringreduce as rr

    torch.set_num_threads(1)  # every rank of every emulated host shares this machine's cores
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, ys, xt, yt = data(a, world)
    psgd = powersgd_group()
    params = sum(p.numel() for p in make_model(a).parameters())
    if rank == 0:
        print(f"# DDP across {os.environ.get('RINGREDUCE_BENCH_LAB', 'hosts')}")
        print(f"# {world} ranks, MLP of {params / 1e6:.1f} M parameters "
              f"({params * 4 / 2 ** 20:.0f} MiB of float32 gradients), batch {a.batch} per rank, "
              f"{a.steps} steps (Adam 1e-3); step time: median of the slowest rank's, steps 4..")
        print(f"{'variant':<16}{'step (ms)':>11}{'vs gloo':>9}{'test acc':>10}", flush=True)
    base = None
    for name in a.variants:  # one at a time: seven 25 M-parameter models with Adam do not fit
        torch.manual_seed(0)
        model = DDP(make_model(a))
        state, hook = hook_for(name, psgd)
        if state == "ef":
            state = rr.ddp.WireState(None, error_feedback=True, params=model.parameters())
        if hook is not None:
            model.register_comm_hook(state, hook)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        times = []
        for step in range(a.steps):
            lo = (step * world + rank) * a.batch
            x, y = xs[lo:lo + a.batch], ys[lo:lo + a.batch]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank is done
        with torch.no_grad():
            acc = (model(xt).argmax(1) == yt).float().mean().item()
        med = statistics.median(t.tolist()[3:] or t.tolist())
        base = med if name == "gloo" else base
        if rank == 0:
            vs = f"{base / med:.2f}x" if base else "-"
            print(f"{name:<16}{med * 1e3:>11.1f}{vs:>9}{acc * 100:>9.2f}%", flush=True)
        del model, opt
    rr.destroy()
    dist.destroy_process_group()


def main(argv=None):
    a = parse(argv)
    if a.worker:
        return worker(a)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ringreduce.bench.netlab import Lab, LabUnavailable
    rate = None if a.link == "none" else a.link
    try:
        lab = Lab(a.hosts, rate)
    except LabUnavailable as e:
        print(f"ddp_hosts.py: {e}", file=sys.stderr)
        return 2
    with lab:
        desc = f"{lab.describe()}; one TCP stream: {lab.measure():.2f} GB/s"
        argv = [x for x in (argv if argv is not None else sys.argv[1:])]
        procs = []
        for h in range(a.hosts):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(a.hosts),
                   "--node-rank", str(h), "--nproc-per-node", str(a.ranks_per_host),
                   "--master-addr", lab.address(0), "--master-port", "29500",
                   os.path.abspath(__file__), "--worker"] + argv
            procs.append(lab.popen(h, cmd, private_shm=True,
                                   env=dict(os.environ, RINGREDUCE_BENCH_LAB=desc),
                                   stderr=subprocess.DEVNULL if h else None,
                                   stdout=None if h == 0 else subprocess.DEVNULL))
        codes = [p.wait() for p in procs]
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
