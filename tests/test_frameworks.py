"""Training frameworks on ringreduce: PyTorch Lightning and Hugging Face Accelerate train a small
MLP on 2 CPU processes, on Gloo (the baseline), on the "ringreduce" backend, and with
rr.ddp.allreduce_hook; the final parameters must equal Gloo's (float tolerance: the ring and Gloo
may sum in different orders), every rank must end with the same bits, and each ringreduce run must
show that the ring served DDP's gradient buckets (the flight recorder's calls by source, the
backend's call counts, the hook's own count), so that a silent fallback to Gloo fails.

The training script is tests/frameworks_train.py; each run is a launch of its own (Lightning's DDP
launcher re-runs the script for rank 1; Accelerate runs under torchrun), in a session of its own
that is killed if it outlives its timeout; two launches run at a time.

Lightning and Accelerate come from the test extra (pip install -e ".[test]"); without them these
tests skip, unless RINGREDUCE_REQUIRE_FRAMEWORKS=1 (CI sets it), which makes them fail instead.
"""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "frameworks_train.py")
RUN_TIMEOUT = 240  # seconds per launch; a run takes ~6 s (Accelerate) to ~20 s (Lightning)
STEPS = 12  # frameworks_train.py: 192 samples, 16 a batch on each of 2 ranks, 2 epochs
RTOL, ATOL = 1e-5, 1e-6  # float32; measured at 2 ranks: 0.0 (the same bits as Gloo)

sys.path.insert(0, HERE)
import frameworks_train  # noqa: E402  (the model and data, to check that training moved them)

REQUIRED = os.environ.get("RINGREDUCE_REQUIRE_FRAMEWORKS") == "1"


def _needs(module, package):
    missing = importlib.util.find_spec(module) is None
    return pytest.mark.skipif(
        missing and not REQUIRED,
        reason=f"needs {package} (the test extra installs it: pip install -e '.[test]'; CI sets "
               f"RINGREDUCE_REQUIRE_FRAMEWORKS=1 so that this never skips there)")


needs_lightning = _needs("lightning", "lightning")
needs_accelerate = _needs("accelerate", "accelerate")


# -- running a launch ---------------------------------------------------------------------------
def _live_in_group(pgid):
    """Pids of the processes (not zombies) in process group pgid."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            pids.append(int(entry))
    return pids


def _start(framework, variant, out):
    """Starts one launch in a session of its own; _finish waits for it and reads its results."""
    if framework == "lightning":
        cmd = [sys.executable, SCRIPT, "lightning", variant, str(out)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               SCRIPT, "accelerate", variant, str(out)]
    # One-shot up to 16 KiB (the default at 2 ranks is 1 KiB) so that DDP's two buckets take the
    # two all-reduce algorithms; a hung ring ends well inside RUN_TIMEOUT.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1",
               RINGREDUCE_TIMEOUT="60",
               RINGREDUCE_ONESHOT_MAX_BYTES=str(16 << 10))
    log_path = out / "launch.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=HERE,
                                start_new_session=True)  # its own process group: every rank
    return {"key": (framework, variant), "proc": proc, "start": time.monotonic(), "out": out}


def _kill(launch):
    try:
        os.killpg(launch["proc"].pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launch["proc"].wait()


def _finish(launch):
    (framework, variant), proc, start, out = (launch[k] for k in ("key", "proc", "start", "out"))
    log_path = out / "launch.log"
    pgid = proc.pid
    try:
        rc = proc.wait(timeout=max(1.0, start + RUN_TIMEOUT - time.monotonic()))
        # Lightning's rank 0 does not wait for rank 1: give the ranks time to exit on their own.
        deadline = time.monotonic() + 30
        while _live_in_group(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        stragglers = _live_in_group(pgid)
    except subprocess.TimeoutExpired:
        rc, stragglers = None, []
    finally:
        _kill(launch)
    seconds = time.monotonic() - start
    with open(log_path) as f:
        log_text = f.read()
    assert rc is not None, f"{framework}/{variant} ran past {RUN_TIMEOUT} s:\n{log_text[-4000:]}"
    assert rc == 0, f"{framework}/{variant} exited with {rc}:\n{log_text[-4000:]}"
    assert not stragglers, f"{framework}/{variant}: processes {stragglers} outlived the launch"
    infos, params = [], []
    for rank in range(2):
        with open(out / f"rank{rank}.json") as f:
            infos.append(json.load(f))
        params.append(torch.load(out / f"rank{rank}.pt"))
    return {"infos": infos, "params": params, "seconds": seconds, "log": log_text}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """run(framework, variant): that launch's results, made once per module. Two launches run at a
    time: one keeps about 1.3 of the 2 CI cores busy (imports; a rank waiting for the other), so
    while a test waits for its launch the next launch a selected test names (its `launches` mark)
    starts beside it."""
    wanted = []  # (framework, variant) in the order the selected tests name them
    for item in request.session.items:
        for mark in item.iter_markers("launches"):
            for key in (tuple(k.split("/")) for k in mark.args):
                if key not in wanted:
                    wanted.append(key)
    done, started = {}, {}

    def start(key):
        started[key] = _start(*key, tmp_path_factory.mktemp(f"{key[0]}-{key[1]}"))

    def run(framework, variant):
        key = (framework, variant)
        if key not in done:
            if key not in started:
                start(key)
            following = [k for k in wanted if k not in done and k not in started]
            if following:
                start(following[0])
            done[key] = _finish(started.pop(key))
        return done[key]

    yield run
    for launch in started.values():  # started for a test that did not run (a failure, -x)
        _kill(launch)


# -- checks -------------------------------------------------------------------------------------
def _check_ranks_agree(run):
    """Both ranks ran in one world of 2 and ended with the same bits and the same synced loss."""
    infos, params = run["infos"], run["params"]
    assert [i["rank"] for i in infos] == [0, 1] and all(i["world"] == 2 for i in infos)
    assert params[0].keys() == params[1].keys()
    for name in params[0]:
        assert torch.equal(params[0][name], params[1][name]), f"ranks differ in {name}"
    assert infos[0]["train_loss"] == infos[1]["train_loss"]


def _check_trained(run):
    """Training moved the parameters away from their (seeded) start."""
    start = frameworks_train.make_model().state_dict()
    moved = max((run["params"][0][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-2, f"parameters barely moved ({moved}): did it train?"


def _max_abs_diff(run, baseline):
    a, b = run["params"][0], baseline["params"][0]
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _check_equals_gloo(run, baseline, record_property):
    diff = _max_abs_diff(run, baseline)
    record_property("max_abs_diff_vs_gloo", diff)
    print(f"max |param - gloo param| = {diff:.3g}; launch {run['seconds']:.1f} s")
    for name, p in run["params"][0].items():
        torch.testing.assert_close(p, baseline["params"][0][name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{n} differs from Gloo's: {m}")
    assert abs(run["infos"][0]["train_loss"] - baseline["infos"][0]["train_loss"]) <= 1e-5


def _ring_buckets(info, source):
    """All-reduces the ring ran for `source` (backend: DDP's bucket all-reduce through the process
    group; ddp_hook: rr.ddp's hook), by algorithm, from the rank's flight recorder."""
    counts = info["trace_sources"]
    return {algo: counts.get(f"{source} all_reduce {algo}", 0) for algo in ("ring", "oneshot")}


def _check_ring_backend(run):
    """The default group was ringreduce's, and DDP's buckets went through its ring: the 64 KiB
    bucket by the ring and the 11 KiB one by one-shot, at least once a step each (the first step
    has one bucket of everything: DDP rebuilds its buckets after it)."""
    for info in run["infos"]:
        assert info["backend"] == "ringreduce", info
        assert info["comm_hooks"] == [], info  # no hook: DDP's own bucket all-reduce
        assert info["ring_calls"]["ring allreduce"] >= 2 * STEPS - 1, info["ring_calls"]
        buckets = _ring_buckets(info, "backend")
        assert buckets["ring"] >= STEPS and buckets["oneshot"] >= STEPS - 1, info
        assert _ring_buckets(info, "ddp_hook") == {"ring": 0, "oneshot": 0}, info


def _check_ring_hook(run):
    """The group was Gloo's, DDP had rr.ddp.allreduce_hook, the hook ran for every bucket of every
    step, and each of its calls was a ring all-reduce."""
    for info in run["infos"]:
        assert info["backend"] == "gloo", info
        assert info["comm_hooks"] == ["counted_allreduce_hook.<locals>.allreduce_hook"], info
        assert info["hook_calls"] >= 2 * STEPS - 1, info
        buckets = _ring_buckets(info, "ddp_hook")
        assert buckets["ring"] >= STEPS and buckets["oneshot"] >= STEPS - 1, info
        assert buckets["ring"] + buckets["oneshot"] == info["hook_calls"], info
        assert info["ring_calls"] is None, info  # the default group is not ringreduce's


def _check_gloo(run):
    for info in run["infos"]:
        assert info["backend"] == "gloo" and info["ring_calls"] is None, info
        assert info["trace_sources"] == {} and info["comm_hooks"] == [], info


# -- PyTorch Lightning ----------------------------------------------------------------------------
@needs_lightning
@pytest.mark.launches("lightning/gloo")
def test_lightning_gloo_baseline(runs):
    """DDPStrategy(process_group_backend="gloo"): trains, ranks agree, nothing touches the ring."""
    run = runs("lightning", "gloo")
    _check_ranks_agree(run)
    _check_trained(run)
    _check_gloo(run)
    assert all(i["steps"] == STEPS for i in run["infos"])


@needs_lightning
@pytest.mark.launches("lightning/ringreduce", "lightning/gloo")
def test_lightning_ringreduce_backend(runs, record_property):
    """DDPStrategy(process_group_backend="ringreduce"): Lightning's DDP (and its sync_dist metric
    all-reduce, broadcasts, barriers) on the ringreduce backend, equal to Gloo."""
    run = runs("lightning", "ringreduce")
    _check_ranks_agree(run)
    _check_ring_backend(run)
    assert all(i["steps"] == STEPS for i in run["infos"])
    _check_equals_gloo(run, runs("lightning", "gloo"), record_property)


@needs_lightning
@pytest.mark.launches("lightning/hook", "lightning/gloo")
def test_lightning_ddp_comm_hook(runs, record_property):
    """DDPStrategy(process_group_backend="gloo", ddp_comm_hook=<rr.ddp.allreduce_hook>) plus the
    callback that registers it on CPU (Lightning itself does only on CUDA: see the next test):
    every bucket through the ring, equal to Gloo."""
    run = runs("lightning", "hook")
    _check_ranks_agree(run)
    _check_ring_hook(run)
    assert all(i["steps"] == STEPS for i in run["infos"])
    _check_equals_gloo(run, runs("lightning", "gloo"), record_property)


@needs_lightning
@pytest.mark.launches("lightning/hook")
def test_lightning_registers_ddp_comm_hook_only_on_cuda(runs):
    """What docs/frameworks.md says: on CPU, DDPStrategy(ddp_comm_hook=...) registers nothing (Lightning's
    DDPStrategy._register_ddp_hooks runs only when the root device is CUDA), with no warning, so
    a CPU job needs the backend, or a callback that registers the hook in on_fit_start. If this
    fails, Lightning has started registering it on CPU: update docs/frameworks.md."""
    for info in runs("lightning", "hook")["infos"]:
        assert info["hooks_registered_by_lightning"] == [], info


# -- Hugging Face Accelerate ----------------------------------------------------------------------
@needs_accelerate
@pytest.mark.launches("accelerate/gloo")
def test_accelerate_gloo_baseline(runs):
    """Accelerator(cpu=True) under torchrun: Accelerate makes a Gloo group and wraps DDP."""
    run = runs("accelerate", "gloo")
    _check_ranks_agree(run)
    _check_trained(run)
    _check_gloo(run)
    assert all(i["distributed_type"] == "DistributedType.MULTI_CPU" for i in run["infos"])


@needs_accelerate
@pytest.mark.launches("accelerate/ringreduce", "accelerate/gloo")
def test_accelerate_ringreduce_backend(runs, record_property):
    """dist.init_process_group("ringreduce") before Accelerator(cpu=True): Accelerate keeps the
    group it finds, so its DDP and accelerator.reduce run on the ring; equal to Gloo."""
    run = runs("accelerate", "ringreduce")
    _check_ranks_agree(run)
    _check_ring_backend(run)
    assert all(i["distributed_type"] == "DistributedType.MULTI_CPU" for i in run["infos"])
    _check_equals_gloo(run, runs("accelerate", "gloo"), record_property)


@needs_accelerate
@pytest.mark.launches("accelerate/hook", "accelerate/gloo")
def test_accelerate_ddp_comm_hook(runs, record_property):
    """model = accelerator.prepare(model); model.register_comm_hook(None, rr.ddp.allreduce_hook):
    every bucket through the ring, equal to Gloo."""
    run = runs("accelerate", "hook")
    _check_ranks_agree(run)
    _check_ring_hook(run)
    _check_equals_gloo(run, runs("accelerate", "gloo"), record_property)


ACCELERATE_REFUSALS = r"""
import os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
import torch.nn as nn
import ringreduce as rr
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

# 1. backend= for CPU processes: refused before any rendezvous.
try:
    Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(backend="ringreduce")])
    print("backend: accepted")
except ValueError as e:
    print("backend:", e)

# 2. comm_hook= takes Accelerate's enum of torch's hooks; a callable registers nothing.
class Model(nn.Module):
    hooks = []
    def register_comm_hook(self, state, hook):
        self.hooks.append(hook)
m = Model()
DistributedDataParallelKwargs(comm_hook=rr.ddp.allreduce_hook).register_comm_hook(m)
print("hook: registered", len(m.hooks))
"""


@needs_accelerate
def test_accelerate_refuses_backend_and_hook_arguments():
    """What docs/frameworks.md says about Accelerate's own arguments: InitProcessGroupKwargs(
    backend="ringreduce") raises for CPU processes (Accelerate sets "gloo", or "mpi", and refuses
    any other), and DistributedDataParallelKwargs(comm_hook=rr.ddp.allreduce_hook) silently
    registers nothing. If this fails, Accelerate has changed: update docs/frameworks.md."""
    res = subprocess.run([sys.executable, "-c", ACCELERATE_REFUSALS], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    assert ("backend: Your assigned backend ringreduce is not available, please use gloo"
            in res.stdout), res.stdout + res.stderr
    assert "hook: registered 0" in res.stdout, res.stdout + res.stderr
