"""Data-parallel training of a small MLP on handwritten digits, gradients reduced by ringreduce.

    torchrun --nproc-per-node=2 examples/train_ddp.py [--epochs 10] [--hook allreduce|fp16|bf16]
    torchrun --nproc-per-node=2 examples/train_ddp.py --wire fp8 [--error-feedback]  # narrow wire
    torchrun --nproc-per-node=2 examples/train_ddp.py --backend ringreduce   # no hook: DDP as is
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node=2 --max-restarts=3 \
        examples/train_ddp.py --checkpoint ck.pt --checkpoint-every 20   # resumes where it stopped
    torchrun --nnodes=3 --node-rank=H ... --max-restarts=0 examples/train_ddp.py \
        --backend ringreduce --on-failure shrink   # a lost host: the others go on without it

The model is the one PyTorch's DDP tutorial trains (Flatten, Linear(784, 10), ReLU, Linear(10, 10),
ReLU, Linear(10, 10)) with a BatchNorm1d after the first layer (--sync-bn makes it ringreduce's
SyncBatchNorm) and an optional Dropout. The data is scikit-learn's bundled digits (1797 images, 8x8,
no download), upsampled to 28x28 so that they have MNIST's shape. Runs on CPU with Gloo by default
(--device cuda uses one GPU per local rank and NCCL), and DDP reduces through ringreduce's comm hook.
With --backend ringreduce the process group is ringreduce's torch.distributed backend and DDP runs
unmodified (no hook): its own bucket all-reduce goes through the ring. Every epoch prints the
training loss and the test accuracy, both averaged over all ranks with ringreduce.all_reduce.

Checkpoints (only with --checkpoint PATH; nothing is written otherwise): rank 0 writes PATH
atomically (temporary file, fsync, rename) at the end of every epoch and every --checkpoint-every
steps: model, optimizer, LR schedule, AMP GradScaler, the
position in the data (epoch and samples done) and every rank's RNG states and partial epoch
statistics. At start every rank resumes from it if it exists, skipping exactly the samples already
done, so that a job restarted by torchrun (--max-restarts) ends with the same parameters, bit for
bit, as one that never stopped (same world size, seed and arguments). After a change of world
size (torchrun --nnodes=1:2 losing a node) it resumes at the same point of the epoch's data and of
the cosine LR schedule, not bitwise. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun so that
each attempt gets a fresh store: the shared one keeps the failed attempt's keys.

With --on-failure shrink (--backend ringreduce) a step that fails because ranks are lost is not
raised: the survivors agree on who is gone and shrink the group (rr.shrink_group), wrap the model
in a new DDP, re-cut the epoch's remaining data and the test set among themselves, put the LR
schedule where the data is, and redo the step. Under torchrun this is for a whole host lost (its
agent too) with --max-restarts=0: a dead worker makes its own agent stop that host's others.

Lines other programs parse (one write each): "epoch E/N  train loss L  test accuracy A  (...)",
and with --events (for tests and restart measurements) "rank R host H parameters sha1 D" and,
with wall-clock times (time.time()), "rank R restart C dying at step S time T", "rank R restart C
failed at step S time T: ERROR", "rank R restart C resumed at step S (epoch E, batch B) time T",
"rank R restart C first step S done time T", and after a shrink "rank R restart C shrunk at
step S time T (lost [...]; now rank R' of W)" and "rank R restart C first step after shrink S done
time T" (R' and the new step numbering from there on). Without --events a resumed job says so
once (rank 0).
"""
import argparse
import contextlib
import gc
import hashlib
import importlib.util
import inspect
import itertools
import math
import os
import random
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Sampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ringreduce as rr
from ringreduce import ddp as rr_ddp
from ringreduce.nn import convert_sync_batchnorm

try:
    import numpy as np
except ImportError:  # only its global RNG state is saved
    np = None

HOOKS = {"allreduce": rr_ddp.allreduce_hook, "fp16": rr_ddp.fp16_compress_hook,
         "bf16": rr_ddp.bf16_compress_hook, "bf16-wire": rr_ddp.bf16_wire_hook,
         "fp8-wire": rr_ddp.fp8_wire_hook}
TEST_FRACTION = 0.2  # the last 20% of a fixed shuffle is held out
SEED = 0


def emit(line):
    # One write per line: with PYTHONUNBUFFERED, print() writes the text and its newline separately,
    # and another process sharing the pipe can land between them.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def load_digits_8x8():
    """scikit-learn's digits (1797 8x8 images, values 0-16, and their labels) as numpy arrays. The
    CSV file scikit-learn ships is read directly where found: importing sklearn (scipy.stats with
    it) costs every rank about a second of CPU before its first step."""
    spec = importlib.util.find_spec("sklearn")
    if np is not None and spec is not None and spec.submodule_search_locations:
        path = os.path.join(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
        if os.path.exists(path):
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit("examples/train_ddp.py reads scikit-learn's digits: pip install scikit-learn "
                         "(the bench and test extras install it)") from None
    digits = load_digits()
    return digits.images, digits.target


def load_digits_28x28():
    """(train, test) TensorDatasets of 1x28x28 float images in [0, 1] and int64 labels."""
    pixels, target = load_digits_8x8()
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0  # N,1,8,8
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    labels = torch.tensor(target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_test = int(len(labels) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def make_model(dropout=0.0):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10), nn.BatchNorm1d(10), nn.ReLU(),
                         nn.Dropout(dropout), nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10))


class SkipSampler(Sampler):
    """The wrapped sampler's indices after the first `skip` (set before each epoch): resuming
    mid-epoch skips the samples already done without loading them."""

    def __init__(self, sampler):
        self.sampler, self.skip = sampler, 0

    def __iter__(self):
        return itertools.islice(iter(self.sampler), self.skip, None)

    def __len__(self):
        return len(self.sampler) - self.skip


def rng_state(device):
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if np is not None:  # as tensors, so that the checkpoint loads with weights_only=True
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached)
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state, device):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_atomically(obj, path):
    """Readers see the old file or the new one, never a partial one, even if we are killed."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fd = os.open(directory, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def first_death(marker):
    """--die-at-step dies once: across nodes, torchrun's restart counts differ (a node whose
    workers did not fail restarts them with the count unchanged) and ranks can move between
    nodes, so TORCHELASTIC_RESTART_COUNT=0 alone could kill a rank again."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def kill_node():
    """SIGKILLs our torchrun agent and its workers (us last), as if the host went down."""
    agent = os.getppid()
    with open(f"/proc/{agent}/task/{agent}/children") as f:
        workers = [int(pid) for pid in f.read().split()]
    os.kill(agent, signal.SIGKILL)
    for pid in workers:
        if pid != os.getpid():
            os.kill(pid, signal.SIGKILL)


def lost_rank_error(e):
    """A collective that failed, as a lost rank makes it: ringreduce's error, torch.distributed's,
    or a RuntimeError carrying ringreduce's or Gloo's message (DDP's backward raises the hook's
    error as one; its buffer broadcast in forward goes through Gloo: "Connection closed by peer")."""
    return isinstance(e, (rr.RingReduceError, dist.DistError)) or \
        (isinstance(e, RuntimeError) and ("ringreduce" in str(e) or "gloo" in str(e).lower()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--lr", type=float, default=0.003, help="peak; cosine decay to 0 per step")
    ap.add_argument("--backend", choices=("default", "ringreduce"), default="default",
                    help="default: gloo (cpu) or nccl (cuda), gradients through the hook")
    ap.add_argument("--hook", choices=sorted(HOOKS) + ["none"], default=None,
                    help="DDP comm hook (default: allreduce, or none with --backend ringreduce)")
    ap.add_argument("--wire", choices=("bf16", "fp8"), default=None,
                    help="the hook bf16_wire_hook or fp8_wire_hook: that type on the wire, an exact "
                         "float32 sum (CPU)")
    ap.add_argument("--error-feedback", action="store_true",
                    help="with --wire: each rank carries what rounding lost into its next step "
                         "(kept in the checkpoint)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none",
                    help="autocast; fp16 adds a GradScaler")
    ap.add_argument("--sync-bn", action="store_true", help="ringreduce.nn.SyncBatchNorm")
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--events", action="store_true",
                    help="print the per-rank event lines (restarts, first step, parameter digest) "
                         "that tests and restart measurements parse")
    ap.add_argument("--checkpoint", default=None, metavar="PATH",
                    help="written by rank 0, resumed from by every rank if it exists")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                    help="also checkpoint every K steps (0: only at the end of each epoch)")
    ap.add_argument("--on-failure", choices=("restart", "shrink"), default="restart",
                    help="a lost rank: restart (raise, so that torchrun restarts the group) or "
                         "shrink (the survivors drop the lost ranks and redo the step; needs "
                         "--backend ringreduce, under torchrun --max-restarts=0)")
    ap.add_argument("--die-at-step", type=int, default=0, metavar="N",
                    help="test only: on torchrun's first attempt (TORCHELASTIC_RESTART_COUNT=0), "
                         "--die-rank SIGKILLs itself in step N, between forward and backward, "
                         "once (it leaves CHECKPOINT.died-at-N)")
    ap.add_argument("--die-rank", type=int, default=0)
    ap.add_argument("--die-node", action="store_true",
                    help="test only: --die-rank kills its torchrun agent and every worker of it")
    args = ap.parse_args(argv)
    if args.wire is not None:
        if args.hook not in (None, f"{args.wire}-wire"):
            ap.error(f"--wire {args.wire} is the hook {args.wire}-wire; --hook {args.hook} too")
        args.hook = f"{args.wire}-wire"
    if args.error_feedback and not (args.hook or "").endswith("-wire"):
        ap.error("--error-feedback needs --wire")
    if args.checkpoint is None and (args.checkpoint_every or args.die_at_step):
        ap.error("--checkpoint-every and --die-at-step need --checkpoint PATH (where to save)")
    if args.on_failure == "shrink" and args.backend != "ringreduce":
        ap.error("--on-failure shrink needs --backend ringreduce (a Gloo group cannot shrink)")
    if args.hook is None:
        args.hook = "none" if args.backend == "ringreduce" else "allreduce"
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("ringreduce" if args.backend == "ringreduce" else "nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("ringreduce" if args.backend == "ringreduce" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if (rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0):
        # The store outlives the attempt, with the last attempt's keys in it: a restarted group
        # can read a dead rank's address and hang in init_process_group (pytorch/pytorch#135712).
        emit("warning: torchrun shares one store across restarts; a restarted group may hang "
             "starting up. Launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.")

    train_set, test_set = load_digits_28x28()
    # Each iterator draws a seed from its generator (the global one if none is given: resuming
    # would then draw once more than an uninterrupted run and shift every dropout mask after it).
    loader_generator = torch.Generator()

    def cut_data(rank, world):
        """This rank's share of the training data and its test shard (every world-th test sample,
        so that each test image is counted exactly once)."""
        sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True,
                                     seed=SEED)
        skipper = SkipSampler(sampler)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=skipper,
                            generator=loader_generator)
        test = test_set.tensors[0][rank::world].to(device), test_set.tensors[1][rank::world]
        return sampler, skipper, loader, test

    sampler, skipper, train_loader, (test_x, test_y) = cut_data(rank, world)
    steps_per_epoch = -(-len(sampler) // args.batch_size)

    torch.manual_seed(SEED)  # DDP broadcasts rank 0's parameters anyway
    random.seed(SEED)
    model = make_model(args.dropout)
    if args.sync_bn:
        model = convert_sync_batchnorm(model)
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    # Cosine decay to 0 over the run, in closed form: a resume at another world size (other
    # steps per epoch) can put it where the data is.
    total_steps = args.epochs * steps_per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total_steps) / total_steps)))

    def schedule_at(step):
        """The LR schedule where the data is (after a change of world size)."""
        scheduler.last_epoch = step
        for group, lr in zip(optimizer.param_groups, scheduler.base_lrs):
            group["lr"] = lr * scheduler.lr_lambdas[0](step)

    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16 if args.amp == "bf16"
                               else torch.float16) if args.amp != "none"
                else contextlib.nullcontext())

    # Resume. Every rank reads the file; they must agree on what they found (say, a path that
    # only some hosts can see would split the job).
    # done: samples of this rank's share of the epoch already trained on
    epoch, done, step, accuracy, saved = 0, 0, 0, None, None
    if args.checkpoint and os.path.exists(args.checkpoint):
        saved = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        if not {"step", "samples_done", "scheduler", "ranks"} <= set(saved):  # an older format
            raise RuntimeError(f"{args.checkpoint} is not a checkpoint this script can resume "
                               f"from: remove it or pass another --checkpoint")
    found = [None] * world
    dist.all_gather_object(found, None if saved is None else saved["step"])
    if len(set(found)) != 1:
        raise RuntimeError(f"ranks disagree on the checkpoint {args.checkpoint} (its step on each "
                           f"rank, None where absent): {found}")
    # stats: [sum of losses, samples, correct test predictions, test samples], summed over ranks.
    stats = torch.zeros(4, dtype=torch.float64, device=device)
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        scaler.load_state_dict(saved["scaler"])
        epoch, step, accuracy = saved["epoch"], saved["step"], saved["test_accuracy"]
        # DistributedSampler deals the epoch's permutation out round-robin, so the first n
        # samples of every rank's share are the first n * world of the permutation: the same
        # samples are skipped whatever the world size (exactly when it divides them).
        done = saved["samples_done"] // world
        if saved["world_size"] != world:  # steps count this world size's batches
            step = epoch * steps_per_epoch + done // args.batch_size
            schedule_at(step)
        mine = saved["ranks"][rank % len(saved["ranks"])]
        set_rng_state(mine["rng"], device)
        if len(saved["ranks"]) == world:
            stats[:2] = mine["stats"].to(device)
        elif rank == 0:  # another world size: the data split differs, keep the epoch's totals
            stats[:2] = sum(r["stats"] for r in saved["ranks"]).to(device)
        if args.events:
            emit(f"rank {rank} restart {restart} resumed at step {step} (epoch {epoch}, batch "
                 f"{done // args.batch_size}) time {time.time():.6f}")
        elif rank == 0:
            emit(f"resumed from {args.checkpoint} at step {step} (epoch {epoch + 1}, batch "
                 f"{done // args.batch_size})")

    device_ids = [device.index] if device.type == "cuda" else None
    # With SyncBatchNorm the running statistics are the group's, the same on every rank: nothing
    # to broadcast before each forward.
    ddp_options = {}
    if args.sync_bn:  # torch >= 2.14 renamed the option
        new = "forward_sync_buffers" in inspect.signature(DDP).parameters
        ddp_options["forward_sync_buffers" if new else "broadcast_buffers"] = False
    # The wire hooks' state: this rank's error feedback residuals, saved with the checkpoint.
    wire_state = rr_ddp.WireState(None, args.error_feedback, model.parameters()) \
        if args.hook.endswith("-wire") else None
    if saved is not None and wire_state is not None and len(saved["ranks"]) == world and \
            saved["ranks"][rank].get("wire") is not None:
        wire_state.load_state_dict(saved["ranks"][rank]["wire"])

    def wrap(module):
        """DDP on the current default group (a new one after a shrink): it broadcasts rank 0's
        parameters and buffers, so every rank starts the same."""
        ddp = DDP(module, device_ids=device_ids, **ddp_options)
        if args.hook != "none":  # the hooks' state names no group (None): the default one
            ddp.register_comm_hook(wire_state, HOOKS[args.hook])
        return ddp

    net, model = model, wrap(model)

    def checkpoint():
        if not args.checkpoint:
            return
        # Every rank's RNG states and partial statistics, so that each resumes exactly.
        ranks = [None] * world
        dist.all_gather_object(ranks, {"rng": rng_state(device), "stats": stats[:2].cpu(),
                                       "wire": wire_state.state_dict() if wire_state else None})
        if rank == 0:
            save_atomically({
                "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                "epoch": epoch, "samples_done": done * world, "step": step, "epochs": args.epochs,
                "test_accuracy": accuracy, "world_size": world, "ranks": ranks,
                "args": vars(args)}, args.checkpoint)
        dist.barrier()  # nobody goes on (and may die) before the file is complete

    first_step, after_shrink = True, False
    while epoch < args.epochs:
        try:
            sampler.set_epoch(epoch)
            loader_generator.manual_seed(SEED + epoch)
            skipper.skip = done
            model.train()
            for x, y in train_loader:
                x, y = x.to(device), y.to(device)
                optimizer.zero_grad()
                with autocast:
                    loss = F.cross_entropy(model(x), y)
                if (args.die_at_step == step + 1 and rank == args.die_rank and restart == "0"
                        and first_death(f"{args.checkpoint}.died-at-{step + 1}")):
                    emit(f"rank {rank} restart {restart} dying at step {step + 1} "
                         f"time {time.time():.6f}")
                    if args.die_node:
                        kill_node()
                    os.kill(os.getpid(), signal.SIGKILL)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                stats[0] += loss.detach().double() * len(y)
                stats[1] += len(y)
                step, done = step + 1, done + len(y)
                if args.events and (first_step or after_shrink):
                    emit(f"rank {rank} restart {restart} first step "
                         f"{'after shrink ' if after_shrink else ''}{step} done "
                         f"time {time.time():.6f}")
                first_step = after_shrink = False
                if args.checkpoint_every and step % args.checkpoint_every == 0:
                    checkpoint()
            model.eval()
            with torch.no_grad(), autocast:
                predicted = model(test_x).argmax(dim=1).cpu()
            totals = stats.clone()  # stats stay this rank's own if the reduction fails
            totals[2] += (predicted == test_y).sum().item()
            totals[3] += len(test_y)
            rr.all_reduce(totals)
            loss_avg, accuracy = (totals[0] / totals[1]).item(), (totals[2] / totals[3]).item()
            if rank == 0:
                emit(f"epoch {epoch + 1}/{args.epochs}  train loss {loss_avg:.4f}  "
                     f"test accuracy {accuracy:.4f}  ({int(totals[3].item())} test images, "
                     f"{world} ranks, backend {dist.get_backend()}, hook {args.hook})")
            epoch, done = epoch + 1, 0
            stats.zero_()
            checkpoint()
            continue
        except Exception as e:
            # Survivors of a dead rank: say when we noticed.
            first_line = (str(e).strip().splitlines() or [""])[0]
            if args.events:
                emit(f"rank {rank} restart {restart} failed at step {step + 1} "
                     f"time {time.time():.6f}: {type(e).__name__}: {first_line}")
            if args.on_failure != "shrink" or not lost_rank_error(e):
                raise  # torchrun restarts the group (from the checkpoint, if any)
            lost = rr.lost_ranks()  # collective over the survivors: all agree on the list
            if not lost:
                raise
        # --on-failure shrink, out of the except block: its traceback holds the old DDP's frames.
        model = loss = None  # the old DDP (its hooks, its reducer on the old group) goes first
        gc.collect()
        old_rank, old_world = rank, world
        rr.shrink_group(lost)
        rank, world = dist.get_rank(), dist.get_world_size()
        if args.events:
            emit(f"rank {old_rank} restart {restart} shrunk at step {step + 1} "
                 f"time {time.time():.6f} (lost {lost}; now rank {rank} of {world})")
        # Every survivor failed in the same step (no step completes without every rank); say so
        # if not, rather than train on from different points.
        where = torch.tensor([epoch, done, -epoch, -done], dtype=torch.float64, device=device)
        rr.all_reduce(where, op=dist.ReduceOp.MAX)
        if where[:2].tolist() != (-where[2:]).tolist():
            raise RuntimeError(f"rank {rank}: after shrink_group the survivors are at different "
                               f"points of the data (epoch, samples done: {where.tolist()})")
        model = wrap(net)
        # Redo the failed step on the new world's shares: the epoch's permutation skips the samples
        # done so far (done * old_world of it, as a resume at another world size does), the LR
        # schedule goes where the data is. The lost ranks' partial epoch statistics are gone.
        done = done * old_world // world
        sampler, skipper, train_loader, (test_x, test_y) = cut_data(rank, world)
        steps_per_epoch = -(-len(sampler) // args.batch_size)
        total_steps = args.epochs * steps_per_epoch
        step = epoch * steps_per_epoch + done // args.batch_size
        schedule_at(step)
        after_shrink = True

    # Every rank's parameters, as a digest: DDP keeps them identical, and a test compares them.
    digest = hashlib.sha1(b"".join(p.detach().cpu().double().numpy().tobytes()
                                   for p in model.module.parameters())).hexdigest()
    if args.events:
        emit(f"rank {rank} host {os.environ.get('RINGREDUCE_HOST_ID', '-')} parameters sha1 {digest}")
    if rank == 0 and not first_step and args.checkpoint:
        emit(f"saved checkpoint to {args.checkpoint}")
    # Let DDP (and the process group it holds) go now, while the interpreter is whole: its
    # reference cycles would otherwise be collected at exit, where a Gloo group's worker threads
    # can end the process in std::terminate ("terminate called without an active exception"; CI
    # saw it once, in a relaunch that trained nothing; see tests/frameworks_train.py).
    model = optimizer = None
    gc.collect()
    rr.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
