"""Training script for tests/test_frameworks.py: a tiny MLP trained on 2 CPU processes by a framework
(PyTorch Lightning or Hugging Face Accelerate), on Gloo, on the ringreduce backend, or with the
ringreduce DDP hook. Not a test module itself (pytest collects test_*.py only).

    python tests/frameworks_train.py lightning {gloo,ringreduce,hook} OUT_DIR
        Lightning's DDP launcher re-runs this same command line for rank 1.
    torchrun --nproc-per-node=2 tests/frameworks_train.py accelerate {gloo,ringreduce,hook} OUT_DIR
        (or accelerate launch --multi_gpu --num_processes=2 ...: a torchrun; the script asks for the
        CPU itself. `accelerate launch --cpu` starts one process unless mpirun is set up)

Every rank writes OUT_DIR/rank<R>.pt (its final parameters) and OUT_DIR/rank<R>.json (what served
the gradients: the process group's backend, the ring's call counts, the hooks DDP had, the flight
recorder's calls by source). The parent process compares them.
"""
import collections
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import ringreduce as rr
from ringreduce.backend import backend_of

IN, HIDDEN, OUT = 16, 128, 4
SAMPLES, BATCH, EPOCHS, LR = 192, 16, 2, 0.1  # 2 ranks: 6 steps an epoch, 12 in all
# ~20 KB buckets: after DDP's first step the 75 KiB of parameters sit in 2 buckets, the 64 KiB
# middle weight (over the one-shot limit the test sets, 16 KiB: the ring) and the other 11 KiB
# (one-shot), so both of ringreduce's all-reduce algorithms serve DDP.
BUCKET_CAP_MB = 0.02


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def make_dataset():
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, IN, generator=g)
    w = torch.randn(IN, OUT, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(SAMPLES, OUT, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def counted_allreduce_hook():
    """rr.ddp.allreduce_hook, counting its calls (proof that DDP really called it). A function, as
    DDP's register_comm_hook wants (it reads the hook's __name__ and signature)."""

    def allreduce_hook(state, bucket):
        allreduce_hook.calls += 1
        return rr.ddp.allreduce_hook(state, bucket)

    allreduce_hook.calls = 0
    return allreduce_hook


def comm_hook_names(ddp_model):
    return [getattr(h, "__qualname__", type(h).__name__) for h, _ in getattr(ddp_model, "_comm_hooks", [])]


def report(out_dir, ddp_model, module, hook, extra):
    """Writes this rank's parameters and what served its collectives."""
    rank = dist.get_rank()
    impl = backend_of()
    trace_dir = os.path.join(out_dir, f"trace-rank{rank}")
    sources = collections.Counter()
    for path in rr.dump_trace(trace_dir):
        with open(path) as f:
            for call in json.load(f)["entries"]:
                sources[f"{call['source']} {call['coll']} {call['algo']}"] += 1
    info = {
        "rank": rank,
        "world": dist.get_world_size(),
        "backend": str(dist.get_backend()),
        "ring_calls": dict(impl.calls) if impl is not None else None,
        "hook_calls": hook.calls if hook is not None else None,
        "comm_hooks": comm_hook_names(ddp_model),
        "trace_sources": dict(sources),
        **extra,
    }
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()},
               os.path.join(out_dir, f"rank{rank}.pt"))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(info, f)


# -- PyTorch Lightning ------------------------------------------------------------------------
def run_lightning(variant, out_dir):
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = make_model()

        def training_step(self, batch, _):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            # sync_dist: Lightning all-reduces the logged value over the process group
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    hook = counted_allreduce_hook() if variant == "hook" else None

    class Probe(L.Callback):
        """After DDP wraps the model (strategy.setup) and before the first step: records the hooks
        Lightning registered; in the hook variant registers rr.ddp.allreduce_hook if Lightning did
        not (DDPStrategy registers ddp_comm_hook only when the root device is CUDA). At the end of
        training (the model still wrapped): writes the report."""

        def on_fit_start(self, trainer, pl_module):
            self.by_lightning = comm_hook_names(trainer.strategy.model)
            if hook is not None and not trainer.strategy.model._comm_hooks:
                trainer.strategy.model.register_comm_hook(None, hook)

        def on_train_end(self, trainer, pl_module):
            metric = trainer.callback_metrics["train_loss"]
            report(out_dir, trainer.strategy.model, pl_module.net, hook,
                   {"hooks_registered_by_lightning": self.by_lightning,
                    "train_loss": metric.item(), "steps": trainer.global_step,
                    "lightning": L.__version__})

    backend = "ringreduce" if variant == "ringreduce" else "gloo"
    strategy = DDPStrategy(process_group_backend=backend, ddp_comm_hook=hook,
                           bucket_cap_mb=BUCKET_CAP_MB)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, deterministic=True, callbacks=[Probe()])
    loader = torch.utils.data.DataLoader(make_dataset(), batch_size=BATCH, shuffle=False)
    trainer.fit(Module(), loader)


# -- Hugging Face Accelerate ------------------------------------------------------------------
def run_accelerate(variant, out_dir):
    import accelerate
    from accelerate import Accelerator

    if variant == "ringreduce":
        # Accelerate picks "gloo" (or "mpi") for CPU processes and refuses any other backend
        # (InitProcessGroupKwargs(backend="ringreduce") raises); it keeps a default group that
        # already exists, so make that group first.
        dist.init_process_group("ringreduce")
    from accelerate.utils import DistributedDataParallelKwargs
    accelerator = Accelerator(cpu=True, kwargs_handlers=[
        DistributedDataParallelKwargs(bucket_cap_mb=BUCKET_CAP_MB)])
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = torch.utils.data.DataLoader(make_dataset(), batch_size=BATCH, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    hook = None
    if variant == "hook":
        # DistributedDataParallelKwargs(comm_hook=...) takes only Accelerate's enum of torch's own
        # hooks; a custom hook is registered on the prepared (DDP) model.
        hook = counted_allreduce_hook()
        model.register_comm_hook(None, hook)
    for _ in range(EPOCHS):
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
    total = accelerator.reduce(loss.detach().clone(), reduction="mean")  # a metric over the group
    report(out_dir, model, accelerator.unwrap_model(model), hook,
           {"train_loss": total.item(), "accelerate": accelerate.__version__,
            "accelerate_backend": accelerator.state.backend,
            "distributed_type": str(accelerator.distributed_type)})
    accelerator.end_training()


if __name__ == "__main__":
    framework, variant, out = sys.argv[1:4]
    assert variant in ("gloo", "ringreduce", "hook"), variant
    os.makedirs(out, exist_ok=True)
    {"lightning": run_lightning, "accelerate": run_accelerate}[framework](variant, out)
    if variant == "gloo":
        # The Gloo-only baseline (no ringreduce communicator) leaves without Python's finalization:
        # DDP keeps torch's Gloo group, and its worker threads, alive past destroy_process_group,
        # and such a process once ended in std::terminate at exit on a loaded CI machine
        # ("terminate called without an active exception"; see pytorch/pytorch#190489). Its report
        # is written; ringreduce's variants exit normally, since their exit is part of the test.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
