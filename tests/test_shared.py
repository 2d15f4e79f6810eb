"""ringreduce.shared_empty: tensors in memory every rank maps, whose all_reduce reads the peers'
copies in place (the shm ring's "pool" algorithm). Real processes, real process groups."""
import gc
import json
import time

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from conftest import shm_entries
from dist_utils import run_ranks


pytestmark = pytest.mark.usefixtures("no_shm_leak")  # tests/conftest.py


def values(rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-100, 100, (numel,), generator=g).to(dtype)


def rank_order_sum(world, numel, dtype):
    """((x0 + x1) + x2) ... in the accumulation type (fp16/bf16: fp32), rounded once."""
    acc_t = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = values(0, numel, dtype).to(acc_t)
    for q in range(1, world):
        acc = acc + values(q, numel, dtype).to(acc_t)
    return acc.to(dtype)


def pool_mappings():
    with open("/proc/self/maps") as f:
        return sum("ringreduce-pool" in line for line in f)


CASES = [(1, torch.float32), (5, torch.float32), (1001, torch.bfloat16), (4099, torch.int32),
         (300001, torch.float32), (65536, torch.float16), (7, torch.float64)]


def exact_worker(rank, world, trace_dir):
    results = []
    for numel, dtype in CASES:
        t = rr.shared_empty(numel, dtype=dtype)
        assert t.shape == (numel,) and t.dtype == dtype and t.is_contiguous()
        t.copy_(values(rank, numel, dtype))
        rr.all_reduce(t)
        results.append(torch.equal(t, rank_order_sum(world, numel, dtype)))
    # A part of a buffer, at a different offset on every rank, and a 2-D shape; async too.
    buf = rr.shared_empty((4, 1000), dtype=torch.float32)
    part = buf.view(-1)[rank * 7: rank * 7 + 2001]
    part.copy_(values(rank, 2001, torch.float32))
    rr.all_reduce(part, async_op=True).wait()
    results.append(torch.equal(part, rank_order_sum(world, 2001, torch.float32)))
    mapped = pool_mappings()
    rr.dump_trace(trace_dir)
    del t, buf, part
    gc.collect()
    return results, mapped, pool_mappings(), shm_entries()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exact_rank_order_and_nothing_left(world, tmp_path):
    """Bits equal to the rank-order sum (every dtype kind, sizes around the world size, a part of
    a buffer at per-rank offsets, async); each rank maps every rank's buffers while they live and
    nothing after; nothing in /dev/shm at any time; the flight recorder says "pool"."""
    for rank, (results, mapped, after, entries) in enumerate(
            run_ranks(world, exact_worker, str(tmp_path), timeout=300)):
        assert all(results), (rank, results)
        assert mapped == 2 * world, (rank, mapped)  # the last two buffers, every rank's copy
        assert after == 0, (rank, after)
        assert not [e for e in entries if e.startswith("ringreduce-pool")], entries
    dumps = [json.load(open(p)) for p in tmp_path.rglob("rank0.json")]
    assert dumps, list(tmp_path.rglob("*"))
    algos = [e["algo"] for d in dumps for e in d["entries"] if e["coll"] == "all_reduce"]
    assert algos.count("pool") == len(CASES) + 1, algos


def mismatch_worker(rank, world):
    t = rr.shared_empty(64)
    t.fill_(1.0)
    rr.all_reduce(t)  # every rank in the pool: fine
    ordinary = torch.ones(64)
    t0 = time.monotonic()
    try:
        rr.all_reduce(ordinary if rank == world - 1 else t)
    except rr.RingReduceError as e:
        return "raised", str(e), time.monotonic() - t0
    return "returned", "", time.monotonic() - t0


def test_a_rank_without_a_shared_tensor_fails_every_rank():
    for rank, (what, msg, secs) in enumerate(
            run_ranks(3, mismatch_worker, env={"RINGREDUCE_TIMEOUT": "30"})):
        assert what == "raised", rank
        assert "shared_empty" in msg or "aborted" in msg, msg
        assert secs < 10, secs


def sizes_worker(rank, world):
    try:
        rr.shared_empty(100 + rank)
    except ValueError as e:
        ok = rr.shared_empty(8)  # the group still works
        ok.fill_(rank)
        rr.all_reduce(ok)
        return str(e), ok.tolist()
    return None, None


def test_different_sizes_are_an_error_on_every_rank():
    for msg, ok in run_ranks(2, sizes_worker):
        assert msg is not None and "same size and dtype" in msg and "[400, 404]" in msg, msg
        assert ok == [1.0] * 8


def bad_args_worker(rank, world):
    out = []
    for kwargs in ({"dtype": torch.complex64}, {}, {"device": "meta"}):
        try:
            rr.shared_empty(-1, **kwargs) if not kwargs else rr.shared_empty(4, **kwargs)
        except (TypeError, ValueError) as e:
            out.append(str(e))
    return out


def test_bad_arguments():
    for msgs in run_ranks(2, bad_args_worker):
        assert len(msgs) == 3, msgs
        assert "dtype torch.complex64 is not supported" in msgs[0], msgs
        assert "size must be non-negative ints, got (-1,)" in msgs[1], msgs
        assert "device must be cpu or cuda, got meta" in msgs[2], msgs


def cuda_without_gpu_worker(rank, world):
    try:
        rr.shared_empty(4, device="cuda")
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU says")
def test_cuda_buffer_without_a_gpu_is_a_clear_error():
    for msg in run_ranks(2, cuda_without_gpu_worker):
        assert "device cuda asked for, but torch sees no CUDA device" in msg, msg


def bucketer_worker(rank, world, trace_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.Tanh(), torch.nn.Linear(300, 300),
                                torch.nn.Tanh(), torch.nn.Linear(300, 4))
    bucketer = rr.GradientBucketer(model.parameters(), bucket_cap_mb=0.02)
    grads = []
    for step in range(3):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
        model.zero_grad()
        model(x).square().sum().backward()
        local = [p.grad.tolist() for p in model.parameters()]
        bucketer.wait()
        grads.append(([p.grad.tolist() for p in model.parameters()], local))
    rr.dump_trace(trace_dir)
    return grads, len(bucketer.buckets)


def test_gradient_bucketer_reduces_in_shared_buffers(tmp_path):
    """GradientBucketer's CPU buffers are shared_empty tensors: its all-reduces run "pool", and the
    gradients are the rank-order average of the ranks' gradients."""
    world = 3
    results = run_ranks(world, bucketer_worker, str(tmp_path))
    for step in range(3):
        for i in range(6):
            acc = torch.tensor(results[0][0][step][1][i])
            for q in range(1, world):
                acc = acc + torch.tensor(results[q][0][step][1][i])
            want = acc / world
            for q in range(world):
                got = torch.tensor(results[q][0][step][0][i])
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
                assert results[q][0][step][0][i] == results[0][0][step][0][i]
    assert results[0][1] >= 2, results[0][1]
    entries = [e for p in tmp_path.rglob("rank0.json") for e in json.load(open(p))["entries"]
               if e["source"] == "bucketer" and e["coll"] == "all_reduce"]
    grads_calls = [e for e in entries if e["dtype"] == "float32"]  # not the int64 bucket order
    assert len(grads_calls) >= 3 * results[0][1] - 1, entries
    assert {e["algo"] for e in grads_calls} == {"pool"}, entries
