"""ringreduce.nn.SyncBatchNorm on CPU tensors, real processes: forward, backward and running
statistics equal to one BatchNorm over the whole group's batch (1-3 ranks, uneven batches, an empty
one, channels-last, bfloat16, eval mode), one all-reduce per forward and per backward, and DDP with
ringreduce's hook training like one process on the global batch."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import ringreduce as rr
from dist_utils import run_ranks

C = 3
SIZES = {1: [4], 2: [3, 5], 3: [2, 0, 5]}  # per-rank batch sizes: uneven, one empty at world 3


def _ref_bn(seed=1):
    torch.manual_seed(seed)
    ref = nn.BatchNorm2d(C, momentum=0.3)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    return ref


def _max_diff(a, b):
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def bn_worker(rank, world):
    sizes = SIZES[world]
    start, count = sum(sizes[:rank]), sizes[rank]
    comm = rr.get_communicator()
    out = {}
    for name, dtype, fmt in (("float32", torch.float32, torch.contiguous_format),
                             ("channels_last", torch.float32, torch.channels_last),
                             ("bfloat16", torch.bfloat16, torch.contiguous_format)):
        gen = torch.Generator().manual_seed(7)
        full = (torch.randn(sum(sizes), C, 4, 5, generator=gen) * 3 + 1).to(dtype)
        gout = torch.randn(sum(sizes), C, 4, 5, generator=gen)
        ref = _ref_bn()
        sbn = rr.nn.convert_sync_batchnorm(_ref_bn())
        xr = full.float().clone().requires_grad_()  # the reference on the (rounded) inputs
        yr = ref(xr)
        (yr * gout).sum().backward()
        x = full[start:start + count].clone().to(memory_format=fmt).requires_grad_()
        seq0 = comm._native.op_seq()
        y = sbn(x)
        seq1 = comm._native.op_seq()
        (y.float() * gout[start:start + count]).sum().backward()
        seq2 = comm._native.op_seq()
        gw = torch.stack([sbn.weight.grad, sbn.bias.grad])
        dist.all_reduce(gw)  # this rank's sums, as DDP would average them
        sl = slice(start, start + count)
        out[name] = {
            "y": _max_diff(y, yr[sl]), "grad": _max_diff(x.grad, xr.grad[sl]),
            "mean": _max_diff(sbn.running_mean, ref.running_mean),
            "var": _max_diff(sbn.running_var, ref.running_var),
            "wgrad": _max_diff(gw[0], ref.weight.grad), "bgrad": _max_diff(gw[1], ref.bias.grad),
            "dtype": str(y.dtype), "channels_last": y.is_contiguous(memory_format=torch.channels_last)
            if count else None, "calls": (seq1 - seq0, seq2 - seq1),
            "batches": sbn.num_batches_tracked.item(),
        }
        sbn.eval()
        ref.eval()
        seq = comm._native.op_seq()
        with torch.no_grad():
            out[name]["eval"] = _max_diff(sbn(x), ref(xr)[sl])
        out[name]["eval_calls"] = comm._native.op_seq() - seq
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_sync_batchnorm_matches_one_batchnorm_over_the_global_batch(world):
    for rank, out in enumerate(run_ranks(world, bn_worker, timeout=180)):
        for name, r in out.items():
            tol = 3e-2 if name == "bfloat16" else 2e-5
            assert r["y"] < tol and r["grad"] < tol and r["eval"] < tol, (rank, name, r)
            assert r["mean"] < 1e-5 and r["var"] < 1e-4, (rank, name, r)  # stats from the inputs
            assert r["wgrad"] < tol * 50 and r["bgrad"] < tol * 50, (rank, name, r)  # sums of 60 x
            assert r["dtype"] == ("torch.bfloat16" if name == "bfloat16" else "torch.float32")
            if name == "channels_last" and r["channels_last"] is not None:
                assert r["channels_last"], (rank, r)
            # one fused all-reduce per forward and per backward (none at world 1: plain BatchNorm)
            assert r["calls"] == ((1, 1) if world > 1 else (0, 0)), (rank, name, r)
            assert r["eval_calls"] == 0 and r["batches"] == 1, (rank, name, r)


def _net():
    torch.manual_seed(3)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 4 * 5, 2))


def ddp_worker(rank, world):
    sizes = [3, 2, 4][:world]
    start, count = sum(sizes[:rank]), sizes[rank]
    gen = torch.Generator().manual_seed(11)
    data = [torch.randn(sum(sizes), 3, 4, 5, generator=gen) for _ in range(3)]
    total = sum(sizes)
    ref = _net()  # one process, the whole batch, plain BatchNorm
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in data:
        opt_ref.zero_grad()
        (ref(x) ** 2).sum().div(total).backward()
        opt_ref.step()
    model = torch.nn.parallel.DistributedDataParallel(rr.nn.convert_sync_batchnorm(_net()))
    model.register_comm_hook(None, rr.ddp.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data:
        opt.zero_grad()
        # DDP averages over ranks: scale so that the average is the global batch's gradient
        (model(x[start:start + count]) ** 2).sum().mul(world / total).backward()
        opt.step()
    diff = max(_max_diff(p, q) for p, q in zip(model.module.parameters(), ref.parameters()))
    bn = model.module[1]
    stats = max(_max_diff(bn.running_mean, ref[1].running_mean),
                _max_diff(bn.running_var, ref[1].running_var))
    return diff, stats, type(bn).__module__


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_with_the_hook_trains_like_one_process(world):
    for rank, (diff, stats, module) in enumerate(run_ranks(world, ddp_worker, timeout=180)):
        assert module == "ringreduce.nn", module
        assert diff < 1e-5 and stats < 1e-5, (rank, diff, stats)


def test_bad_input_and_conversion():
    bn = rr.nn.SyncBatchNorm(3)
    with pytest.raises(ValueError, match="expected at least 2D input"):
        bn(torch.ones(3))
    with pytest.raises(ValueError, match="input has 4 channels"):
        bn(torch.ones(2, 4))
    # without torch.distributed: a plain BatchNorm
    x = torch.randn(5, 3, 2)
    ref = nn.BatchNorm1d(3)
    assert torch.allclose(bn(x), ref(x)) and torch.allclose(bn.running_var, ref.running_var)
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3, affine=False), nn.Sequential(
        nn.BatchNorm2d(3)))
    net.eval()
    conv = rr.nn.convert_sync_batchnorm(net)
    assert isinstance(conv[1], rr.nn.SyncBatchNorm) and isinstance(conv[2][0], rr.nn.SyncBatchNorm)
    assert conv[1].weight is None and not conv[1].training
    assert conv[2][0].running_var is net[2][0].running_var  # buffers kept, not copied
