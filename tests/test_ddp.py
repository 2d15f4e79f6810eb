"""DDP hooks and GradientBucketer against torch's own DDP; overlap; the training example.

Each world size runs every case in one spawned job (spawning costs seconds per rank). A case trains
the same model from the same start for a few steps on per-rank data, once with the reference (DDP
without a hook, or torch's own compressed hook) and once with ringreduce, and returns the final
parameters; the parent compares them across runs (dtype-derived tolerance) and across ranks (exact).
"""
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from dist_utils import run_ranks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3
LR = 0.05
SMALL_CAP_MB = 0.005  # ~5 KiB: the model below then needs 3 buckets or more


class Net(nn.Module):
    """Four layers (the middle ones ~9 KiB each) and a side branch that only some ranks use."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(16, 48), nn.Linear(48, 48), nn.Linear(48, 48)
        self.head, self.side = nn.Linear(48, 4), nn.Linear(16, 4)

    def forward(self, x, use_side=True):
        h = torch.tanh(self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x))))))
        out = self.head(h)
        return out + self.side(x) if use_side else out


def _batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _uses_side(rank, world, step, micro, opts):
    """Whether this rank's micro-batch uses the side branch: varies by rank and step when
    find_unused_parameters is on, including steps where no rank (or, via no_sync, only an
    accumulation micro-batch) uses it."""
    if not opts.get("find_unused_parameters"):
        return True
    return (step + micro + 1) % (world + 1) == rank  # nobody at step world - 1 (micro-batch 0)


def _new_model():
    torch.manual_seed(0)
    return Net()


def _loss(model, rank, world, step, micro, opts):
    x, y = _batch(rank, step, micro)
    return nn.functional.mse_loss(model(x, _uses_side(rank, world, step, micro, opts)), y)


def _flat(params):
    """The parameters as one numpy array (tensors would travel back through file descriptors
    that die with the rank's process)."""
    return torch.cat([p.detach().reshape(-1) for p in params]).numpy()


def _train_ddp(rank, world, hook, opts, bucket_log=None):
    """Trains STEPS steps with DDP (hook None: DDP's built-in reduction); returns the params."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    accumulate = opts.get("no_sync", False)
    ddp_opts = {k: v for k, v in opts.items() if k != "no_sync"}
    model = DDP(_new_model(), **ddp_opts)
    if hook is not None:
        def logged(state, bucket):
            if bucket_log is not None:
                bucket_log.add(bucket.index())
            return hook(state, bucket)
        model.register_comm_hook(None, logged)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        opt.zero_grad()
        if accumulate:
            with model.no_sync():
                _loss(model, rank, world, step, 1, opts).backward()
        _loss(model, rank, world, step, 0, opts).backward()
        opt.step()
    return _flat(model.module.parameters())


def _train_bucketer(rank, world, opts):
    from ringreduce.bucketing import GradientBucketer
    model = _new_model()
    bucketer = GradientBucketer(model.parameters(), bucket_cap_mb=opts.get("bucket_cap_mb", 25.0))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    side_grads = []  # the side branch's .grad after each wait()
    for step in range(STEPS):
        opt.zero_grad()
        if opts.get("no_sync"):
            with bucketer.no_sync():
                _loss(model, rank, world, step, 1, opts).backward()
                bucketer.wait()  # a no-op inside no_sync()
        _loss(model, rank, world, step, 0, opts).backward()
        bucketer.wait()
        side_grads.append(None if model.side.weight.grad is None else
                          model.side.weight.grad.clone().numpy())
        opt.step()
    n_buckets = len(bucketer.buckets)
    bucketer.remove()
    return _flat(model.parameters()), n_buckets, side_grads


DDP_CASES = {
    "default": {},  # one bucket (25 MiB)
    "bucket_view": {"bucket_cap_mb": SMALL_CAP_MB, "gradient_as_bucket_view": True},
    "static_graph": {"bucket_cap_mb": SMALL_CAP_MB, "static_graph": True},
    "unused": {"bucket_cap_mb": SMALL_CAP_MB, "find_unused_parameters": True},
    "no_sync": {"bucket_cap_mb": SMALL_CAP_MB, "no_sync": True},
    "unused_no_sync_view": {"bucket_cap_mb": SMALL_CAP_MB, "find_unused_parameters": True,
                            "no_sync": True, "gradient_as_bucket_view": True},
}
# GradientBucketer options, and the DDP case (DDP without a hook) that is its reference. Bucket
# sizes and gradient_as_bucket_view do not change what DDP computes.
BUCKETER_CASES = {
    "default": ({}, "default"),
    "small_buckets": ({"bucket_cap_mb": SMALL_CAP_MB}, "bucket_view"),
    "unused": ({"bucket_cap_mb": SMALL_CAP_MB, "find_unused_parameters": True}, "unused"),
    "unused_no_sync": ({"bucket_cap_mb": SMALL_CAP_MB, "find_unused_parameters": True,
                        "no_sync": True}, "unused_no_sync_view"),
}


def _parity_job(rank, world):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
    from ringreduce import ddp
    pairs = {"allreduce": (None, ddp.allreduce_hook),
             "fp16": (torch_hooks.fp16_compress_hook, ddp.fp16_compress_hook),
             "bf16": (torch_hooks.bf16_compress_hook, ddp.bf16_compress_hook)}
    out = {"init": _flat(_new_model().parameters())}
    for case, opts in DDP_CASES.items():
        for name, (ref_hook, our_hook) in pairs.items():
            buckets = set()
            out[("ddp", case, name, "ref")] = _train_ddp(rank, world, ref_hook, opts)
            out[("ddp", case, name, "rr")] = _train_ddp(rank, world, our_hook, opts, buckets)
            out[("ddp", case, name, "buckets")] = len(buckets)
    for case, (opts, ref_case) in BUCKETER_CASES.items():
        out[("bucketer", case, "ref")] = out[("ddp", ref_case, "allreduce", "ref")]
        (out[("bucketer", case, "rr")], out[("bucketer", case, "buckets")],
         out[("bucketer", case, "side")]) = _train_bucketer(rank, world, opts)
    return out


def _max_diff(a, b):
    return float(abs(a - b).max())


def _check_parity(results, world):
    eps = {"allreduce": torch.finfo(torch.float32).eps, "fp16": torch.finfo(torch.float16).eps,
           "bf16": torch.finfo(torch.bfloat16).eps}
    r0 = results[0]
    moved = _max_diff(r0[("ddp", "default", "allreduce", "ref")], r0["init"])
    assert moved > 0.05, "training must move the parameters well beyond the tolerances"
    failures = []
    for key in [k for k in r0 if isinstance(k, tuple) and k[-1] == "rr"]:
        ours, ref = r0[key], r0[key[:-1] + ("ref",)]
        for r in range(1, world):  # every rank ends with bitwise the same parameters
            assert (ours == results[r][key]).all(), \
                f"{key}: rank {r} differs from rank 0"
        # Rounding differences of the gradients (a few ulps of the wire dtype per summand and
        # step), carried through momentum over STEPS steps: bounded by a multiple of eps * moved.
        tol = 8 * world * eps[key[2] if key[0] == "ddp" else "allreduce"] * moved + 1e-6
        diff = _max_diff(ours, ref)
        if not diff <= tol:
            failures.append(f"{key}: max |rr - reference| = {diff:.3g} > {tol:.3g}")
    assert not failures, "\n".join(failures)
    for case, opts in DDP_CASES.items():
        for name in ("allreduce", "fp16", "bf16"):
            n = r0[("ddp", case, name, "buckets")]
            assert n >= (3 if "bucket_cap_mb" in opts else 1), f"{case}/{name}: {n} buckets"
        # The compressed hooks really compress: their result differs from the float32 one.
        for name in ("fp16", "bf16"):
            assert (r0[("ddp", case, name, "rr")] != r0[("ddp", case, "allreduce", "rr")]).any(), \
                (case, name)
    for case, (opts, _) in BUCKETER_CASES.items():
        n = r0[("bucketer", case, "buckets")]
        assert n >= (3 if "bucket_cap_mb" in opts else 1), f"bucketer {case}: {n} buckets"
        # Parameters without a gradient: if any rank produced one (in this step or a no_sync()
        # step before it), every rank gets the same average; if none did, .grad stays None.
        for step in range(STEPS):
            micros = (0, 1) if opts.get("no_sync") else (0,)
            used = any(_uses_side(r, world, step, m, opts) for r in range(world) for m in micros)
            grads = [results[r][("bucketer", case, "side")][step] for r in range(world)]
            if used:
                assert all(g is not None and (g == grads[0]).all() for g in grads), (case, step)
            else:
                assert all(g is None for g in grads), (case, step)
    # The scenario above happened: steps where no rank and where only some ranks used the branch.
    unused = BUCKETER_CASES["unused"][0]
    users = [sum(_uses_side(r, world, step, 0, unused) for r in range(world))
             for step in range(STEPS)]
    assert 0 in users and any(0 < n < world for n in users), users


def _job(rank, world):
    return _parity_job(rank, world), _overlap_job(rank, world)


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def world_results(request):
    """One spawned job per world size runs every case (spawning costs seconds per rank)."""
    world = request.param
    return world, run_ranks(world, _job, timeout=300)


def test_parity_with_ddp(world_results):
    world, results = world_results
    _check_parity([parity for parity, _ in results], world)


class _Probe:
    """Records, on rank 0, whether its first collective of a backward pass is launched without
    blocking and completes while backward still runs. The other ranks start backward only after
    rank 0 launched (a store key), so at that moment the collective cannot have completed: if the
    launch had blocked until the collective finished, rank 0 would never set the key (timeout)."""

    def __init__(self, rank, store, tag):
        self.rank, self.store, self.key = rank, store, "overlap/" + tag
        self.armed, self.is_done, self.result, self.events = False, None, {}, []

    def launched(self, is_done, **info):
        if not self.armed or self.is_done is not None:
            return
        self.is_done = is_done
        self.events.append("launch")
        self.result.update(info, done_at_launch=is_done())
        if self.rank == 0:
            self.store.set(self.key, "go")

    def backward(self, early_weight, loss):
        import datetime
        import time

        def on_early_grad(grad):  # the first layer: its gradient is among the last computed
            self.events.append("early grad")
            if self.rank == 0 and self.is_done is not None:
                deadline = time.monotonic() + 60
                while not self.is_done() and time.monotonic() < deadline:
                    time.sleep(0.001)
                self.result["done_in_backward"] = self.is_done()
            return grad
        handle = early_weight.register_hook(on_early_grad)
        self.armed = True
        if self.rank != 0:
            self.store.wait([self.key], datetime.timedelta(seconds=30))
        loss.backward()
        handle.remove()
        self.events.append("backward end")
        return dict(self.result, events=self.events)


def _overlap_job(rank, world):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ringreduce.bucketing as bucketing
    from ringreduce import ddp
    store = dist.distributed_c10d._get_default_store()
    report = {}

    model = DDP(_new_model(), bucket_cap_mb=SMALL_CAP_MB)
    l1 = model.module.l1.weight
    probe = _Probe(rank, store, "ddp")

    def hook(pg, bucket):
        fut = ddp.allreduce_hook(pg, bucket)
        if bucket.index() == 0:
            probe.launched(fut.done, contains_l1=any(p is l1 for p in bucket.parameters()))
        return fut
    model.register_comm_hook(None, hook)
    _loss(model, rank, world, 1, 0, {}).backward()  # warm-up: DDP re-cuts buckets in grad order
    report["ddp"] = probe.backward(l1, _loss(model, rank, world, 0, 0, {}))

    net = _new_model()
    bucketer = bucketing.GradientBucketer(net.parameters(), bucket_cap_mb=SMALL_CAP_MB)
    _loss(net, rank, world, 1, 0, {}).backward()
    bucketer.wait()  # warm-up: the first wait() re-cuts the buckets in gradient order
    bprobe = _Probe(rank, store, "bucketer")
    real_all_reduce = bucketing.all_reduce

    def recording_all_reduce(tensor, **kwargs):
        work = real_all_reduce(tensor, **kwargs)
        bprobe.launched(work.is_completed, contains_l1=0 in bucketer.buckets[0].indices)
        return work
    bucketing.all_reduce = recording_all_reduce
    try:
        report["bucketer"] = bprobe.backward(net.l1.weight, _loss(net, rank, world, 0, 0, {}))
        bucketer.wait()
    finally:
        bucketing.all_reduce = real_all_reduce
    report["buckets"] = len(bucketer.buckets)
    bucketer.remove()
    return report


def test_overlap(world_results):
    _, results = world_results
    for rank, (_, report) in enumerate(results):
        assert report["buckets"] >= 3
        for tag in ("ddp", "bucketer"):
            r = report[tag]
            assert r["events"] == ["launch", "early grad", "backward end"], (rank, tag, r)
            assert r["contains_l1"] is False, (rank, tag)
            if rank == 0:
                assert r["done_at_launch"] is False, (tag, r)
                assert r["done_in_backward"] is True, (tag, r)


def test_example_leaves_nothing_behind(tmp_path):
    """Issue 73: without --checkpoint the example writes no file into the folder it runs in, and
    prints the epoch lines, not the per-rank event lines tests parse (--events); asking for
    periodic checkpoints without a path is refused, naming the option."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(REPO, "examples", "train_ddp.py"), "--epochs", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^epoch 1/1 +train loss", proc.stdout, re.M), proc.stdout
    assert not re.search(r"sha1|first step|restart \d", proc.stdout), proc.stdout
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)
    bad = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_ddp.py"),
                          "--checkpoint-every", "5"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=env)
    assert bad.returncode == 2 and "--checkpoint PATH" in bad.stderr, bad.stderr


@pytest.mark.parametrize("backend", ["default", "ringreduce"])
def test_example_trains(tmp_path, backend):
    """Under torchrun: DDP with the ringreduce hook on Gloo, and unmodified DDP on the ringreduce
    torch.distributed backend."""
    checkpoint = tmp_path / "ck.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(REPO, "examples", "train_ddp.py"), "--epochs", "1",
           "--checkpoint", str(checkpoint), "--backend", backend]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = re.search(r"epoch 1/1 +train loss ([0-9.]+) +test accuracy ([0-9.]+)", proc.stdout)
    assert match, proc.stdout + proc.stderr
    expected = "backend ringreduce, hook none" if backend == "ringreduce" else "hook allreduce"
    assert expected in proc.stdout, proc.stdout
    loss, accuracy = float(match.group(1)), float(match.group(2))
    assert accuracy > 0.3, f"accuracy {accuracy} after one epoch (chance is 0.1)"
    assert loss < 2.3  # below log(10), the loss of a uniform guess
    saved = torch.load(checkpoint)
    assert set(saved["model"]) == {"1.weight", "1.bias", "2.weight", "2.bias", "2.running_mean",
                                   "2.running_var", "2.num_batches_tracked", "5.weight", "5.bias",
                                   "7.weight", "7.bias"}
    assert (saved["epoch"], saved["samples_done"], saved["step"]) == (1, 0, 90)  # 1437 / 2 / 8
    assert saved["test_accuracy"] == pytest.approx(accuracy, abs=1e-4)
