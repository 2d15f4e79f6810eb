"""Data-parallel training of a small MLP on handwritten digits, gradients reduced by ringreduce.

    torchrun --nproc-per-node=2 examples/train_ddp.py [--epochs 10] [--hook allreduce|fp16|bf16]
    torchrun --nproc-per-node=2 examples/train_ddp.py --backend ringreduce   # no hook: DDP as is

The model is the one PyTorch's DDP tutorial trains (Flatten, Linear(784, 10), ReLU, Linear(10, 10),
ReLU, Linear(10, 10)). The data is scikit-learn's bundled digits (1797 images, 8x8, no download),
upsampled to 28x28 so that they have MNIST's shape. Runs on CPU with Gloo by default (--device cuda
uses one GPU per local rank and NCCL), and DDP reduces through ringreduce's comm hook. With
--backend ringreduce the process group is ringreduce's torch.distributed backend and DDP runs
unmodified (no hook): its own bucket all-reduce goes through the ring. Every epoch prints the
training loss and the test accuracy, both averaged over all ranks with ringreduce.all_reduce; rank 0
saves a checkpoint at the end.
"""
import argparse
import hashlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import ringreduce as rr
from ringreduce import ddp as rr_ddp

HOOKS = {"allreduce": rr_ddp.allreduce_hook, "fp16": rr_ddp.fp16_compress_hook,
         "bf16": rr_ddp.bf16_compress_hook}
TEST_FRACTION = 0.2  # the last 20% of a fixed shuffle is held out


def load_digits_28x28():
    """(train, test) TensorDatasets of 1x28x28 float images in [0, 1] and int64 labels."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N,1,8,8
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    n_test = int(len(labels) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def make_model():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10), nn.ReLU(), nn.Linear(10, 10), nn.ReLU(),
                         nn.Linear(10, 10))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=8, help="per rank")
    ap.add_argument("--lr", type=float, default=0.003)
    ap.add_argument("--backend", choices=("default", "ringreduce"), default="default",
                    help="default: gloo (cpu) or nccl (cuda), gradients through the hook")
    ap.add_argument("--hook", choices=sorted(HOOKS) + ["none"], default=None,
                    help="DDP comm hook (default: allreduce, or none with --backend ringreduce)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--checkpoint", default="train_ddp_checkpoint.pt")
    args = ap.parse_args(argv)
    if args.hook is None:
        args.hook = "none" if args.backend == "ringreduce" else "allreduce"

    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("ringreduce" if args.backend == "ringreduce" else "nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("ringreduce" if args.backend == "ringreduce" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_set, test_set = load_digits_28x28()
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    # Test shard: every world-th sample, so that each test image is counted exactly once.
    test_x, test_y = test_set.tensors[0][rank::world].to(device), test_set.tensors[1][rank::world]

    torch.manual_seed(0)  # DDP broadcasts rank 0's parameters anyway
    device_ids = [device.index] if device.type == "cuda" else None
    model = DDP(make_model().to(device), device_ids=device_ids)
    if args.hook != "none":
        model.register_comm_hook(None, HOOKS[args.hook])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        # [sum of losses, samples, correct test predictions, test samples], summed over ranks.
        stats = torch.zeros(4, dtype=torch.float64, device=device)
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            stats[0] += loss.detach().double() * len(y)
            stats[1] += len(y)
        model.eval()
        with torch.no_grad():
            predicted = model(test_x).argmax(dim=1).cpu()
        stats[2] += (predicted == test_y).sum().item()
        stats[3] += len(test_y)
        rr.all_reduce(stats)
        loss_avg, accuracy = (stats[0] / stats[1]).item(), (stats[2] / stats[3]).item()
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  train loss {loss_avg:.4f}  "
                  f"test accuracy {accuracy:.4f}  ({int(stats[3].item())} test images, "
                  f"{world} ranks, backend {dist.get_backend()}, hook {args.hook})", flush=True)

    # Every rank's parameters, as a digest: DDP keeps them identical, and a test compares them.
    digest = hashlib.sha1(b"".join(p.detach().cpu().double().numpy().tobytes()
                                   for p in model.module.parameters())).hexdigest()
    # One write per line: with PYTHONUNBUFFERED, print() writes the text and its newline separately,
    # and another process sharing the pipe can land between them.
    sys.stdout.write(f"rank {rank} host {os.environ.get('RINGREDUCE_HOST_ID', '-')} "
                     f"parameters sha1 {digest}\n")
    sys.stdout.flush()
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epochs": args.epochs, "test_accuracy": accuracy}, args.checkpoint)
        print(f"saved checkpoint to {args.checkpoint}", flush=True)
    rr.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
