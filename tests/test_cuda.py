"""The collectives on CUDA tensors over real processes: p2p (CUDA IPC) and nccl transports.

Ranks are processes on the available GPU(s) (rank r uses cuda:r % device_count; on a one-GPU
machine every rank shares cuda:0, which CUDA IPC allows; NCCL needs NCCL_MULTI_RANK_GPU_ENABLE=1
for that). Gloo is the bootstrap group. Skipped without a GPU.

    pytest -m gpu tests/test_cuda.py -v
"""
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_ranks
from reference import FLOATS, INTS, OPS, check_close, make_input
from reference import digest as _digest
from reference import reduce_reference as reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# One GPU: NCCL refuses two ranks on it unless told (NCCL >= 2.30), see DESIGN.md.
NCCL_ENV = {"RINGREDUCE_TRANSPORT": "nccl", "NCCL_MULTI_RANK_GPU_ENABLE": "1"}
P2P_ENV = {"RINGREDUCE_TRANSPORT": "p2p"}
# Test-only knobs: tiny slices / staging force many pipeline steps and pieces per chunk.
P2P_TINY = {**P2P_ENV, "RINGREDUCE_CUDA_SLICE_BYTES": "256", "RINGREDUCE_CUDA_CHANNELS": "3"}
NCCL_TINY = {**NCCL_ENV, "RINGREDUCE_NCCL_STAGING_BYTES": "4096"}


def device_of(rank):
    return torch.device("cuda", rank % torch.cuda.device_count())


def setup_rank(rank):
    """Selects the rank's GPU. NCCL older than 2.30 has no NCCL_MULTI_RANK_GPU_ENABLE: ranks that
    share a GPU then pose as separate hosts (distinct NCCL_HOSTID; NCCL's socket transport)."""
    from ringreduce import _C, _cuda
    dev = device_of(rank)
    torch.cuda.set_device(dev)
    if os.environ.get("RINGREDUCE_TRANSPORT") == "nccl" and torch.cuda.device_count() == 1 and \
            _C.nccl_version(_cuda._nccl_lib()) < 23000:
        os.environ["NCCL_HOSTID"] = f"ringreduce-test-rank-{rank}"
    return dev


def bad_count(got, expected, tol):
    return check_close(got.cpu(), expected, tol)


def digest(t):
    return _digest(t.cpu())


def finish():
    from ringreduce import _lifecycle
    torch.cuda.synchronize()
    _lifecycle.REGISTRY.destroy_all()  # while the process group (store) is alive: close's barrier


def sweep_worker(rank, world, sizes, dtypes):
    import ringreduce as rr
    dev = setup_rank(rank)
    failures, digests = [], []
    for dtype in dtypes:
        for op in OPS:
            for numel in sizes:
                tag = f"{dtype} {op} numel={numel} world={world}"
                ins = [make_input(r, numel, dtype, op, seed=numel) for r in range(world)]
                t = ins[rank].to(dev)
                rr.all_reduce(t, op=op)
                exp, tol = reference(ins, op)
                if bad_count(t, exp, tol):
                    failures.append(f"all_reduce {tag}: {bad_count(t, exp, tol)} wrong")
                digests.append(digest(t))
                ins = [make_input(r, numel * world, dtype, op, seed=numel + 1) for r in range(world)]
                out = torch.full((numel,), 7, dtype=dtype, device=dev)
                inp = ins[rank].to(dev)
                rr.reduce_scatter_tensor(out, inp, op=op)
                exp, tol = reference(ins, op)
                lo, hi = rank * numel, (rank + 1) * numel
                if bad_count(out, exp[lo:hi], None if tol is None else tol[lo:hi]) or \
                        not torch.equal(inp.cpu(), ins[rank]):
                    failures.append(f"reduce_scatter {tag}: wrong or input modified")
        for numel in sizes:
            mine = make_input(rank, numel, dtype, dist.ReduceOp.SUM, seed=7).to(dev)
            out = torch.empty(numel * world, dtype=dtype, device=dev)
            rr.all_gather_into_tensor(out, mine)
            exp = torch.cat([make_input(r, numel, dtype, dist.ReduceOp.SUM, seed=7)
                             for r in range(world)])
            if not torch.equal(out.cpu(), exp):
                failures.append(f"all_gather {dtype} numel={numel} world={world}")
            digests.append(digest(out))
    finish()
    return failures, digests


def sizes_for(world):
    return [0, 1, world - 1, world + 1, 100_003]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("env", [P2P_ENV, P2P_TINY, NCCL_ENV, NCCL_TINY],
                         ids=["p2p", "p2p_tiny_slices", "nccl", "nccl_tiny_staging"])
def test_sweep(world, env):
    results = run_ranks(world, sweep_worker, sizes_for(world), FLOATS + INTS, timeout=900, env=env)
    for rank, (failures, _) in enumerate(results):
        assert not failures, f"rank {rank}: " + "; ".join(failures[:10])
    # all_reduce and all_gather results are bitwise identical on every rank
    for rank, (_, digests) in enumerate(results[1:], start=1):
        assert digests == results[0][1], f"rank {rank} differs from rank 0"


def stream_worker(rank, world):
    import ringreduce as rr
    dev = setup_rank(rank)
    total = sum(range(1, world + 1))
    errors = []
    # Create the communicator first: its bootstrap (store rendezvous, IPC) outlasts the GPU sleep
    # below, which then no longer delays the producer, and the first case could not fail.
    rr.all_reduce(torch.zeros(1, device=dev))
    torch.cuda.synchronize()
    for side in (False, True):
        stream = torch.cuda.Stream() if side else torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            t = torch.zeros(1 << 20, device=dev)
            torch.cuda._sleep(200_000_000)  # the producer is late: the collective must wait
            t.fill_(rank + 1)
            rr.all_reduce(t)
            u = t * 2  # the consumer, on the same stream, sees the result
        stream.synchronize()
        if not torch.equal(u.cpu(), torch.full((1 << 20,), 2.0 * total)):
            errors.append(f"side={side}: consumer saw {u[:4].tolist()}")
    # async: nothing waits until wait(); then the current stream does; get_future for DDP hooks
    t = torch.full((4099,), float(rank + 1), device=dev)
    torch.cuda._sleep(100_000_000)
    work = rr.all_reduce(t, async_op=True)
    work.wait()
    v = t + 0
    fut = work.get_future()
    doubled = fut.then(lambda f: f.value()[0] * 2).wait()
    torch.cuda.synchronize()
    if not work.is_completed():
        errors.append("work not completed after synchronize")
    if not torch.equal(v.cpu(), torch.full((4099,), float(total))):
        errors.append(f"async result {v[:4].tolist()}")
    if not torch.equal(doubled.cpu(), torch.full((4099,), 2.0 * total)):
        errors.append(f"future callback saw {doubled[:4].tolist()}")
    # non-contiguous tensors go through a contiguous copy, async too
    m = torch.full((64, 64), float(rank + 1), device=dev).t()
    rr.all_reduce(m, async_op=True).wait()
    if not torch.equal(m.cpu(), torch.full((64, 64), float(total))):
        errors.append("non-contiguous async all_reduce")
    finish()
    return errors


@pytest.mark.parametrize("env", [P2P_ENV, NCCL_ENV], ids=["p2p", "nccl"])
def test_stream_semantics(env):
    for rank, errors in enumerate(run_ranks(3, stream_worker, timeout=300, env=env)):
        assert not errors, f"rank {rank}: {errors}"


def silent_worker(rank, world, silent):
    import ringreduce as rr
    dev = setup_rank(rank)
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(1 << 16, device=dev)
    rr.all_reduce(t)  # creates the communicator everywhere
    torch.cuda.synchronize()
    if rank == silent:  # never calls; stays alive (its memory mapped) until the others are done
        store.wait([f"done/{r}" for r in range(world) if r != silent])
        finish()
        return "silent"
    t0 = time.monotonic()
    try:  # the failure shows when the host waits (or at the call, if NCCL cannot even enqueue)
        rr.all_reduce(t, async_op=True).synchronize()
        first = "no error"
    except rr.RingReduceError as e:
        first = str(e)
    elapsed = time.monotonic() - t0
    try:
        rr.all_reduce(t)
        again = "no error"
    except rr.RingReduceError as e:
        again = str(e)
    store.set(f"done/{rank}", "1")
    finish()
    return first, again, elapsed


@pytest.mark.parametrize("env", [P2P_ENV, NCCL_ENV], ids=["p2p", "nccl"])
def test_silent_rank_times_out(env):
    timeout = 5.0
    results = run_ranks(3, silent_worker, 2, timeout=120,
                        env={**env, "RINGREDUCE_TIMEOUT": str(timeout)})
    for rank, res in enumerate(results[:2]):
        first, again, elapsed = res
        assert first != "no error", f"rank {rank}: the collective did not fail"
        assert "timed out" in first or "stopped because" in first, first
        assert elapsed < 3 * timeout + 10, f"rank {rank}: took {elapsed:.1f} s"
        assert again != "no error" and "broken" in again, again


def mismatch_worker(rank, world):
    import ringreduce as rr
    dev = setup_rank(rank)
    t = torch.ones(1000 + (rank == 1), device=dev)  # rank 1 calls with another numel
    try:
        rr.all_reduce(t, async_op=True).synchronize()
        msg = "no error"
    except rr.RingReduceError as e:
        msg = str(e)
    finish()
    return msg


def test_mismatched_calls_p2p():
    results = run_ranks(3, mismatch_worker, timeout=120,
                        env={**P2P_ENV, "RINGREDUCE_TIMEOUT": "5"})
    assert any("mismatched collective calls" in m for m in results), results
    assert all(m != "no error" for m in results), results


def logged_worker(rank, world):
    import logging
    import ringreduce as rr
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("ringreduce").addHandler(handler)
    logging.getLogger("ringreduce").setLevel(logging.DEBUG)
    rr.all_reduce(torch.ones(3, device=setup_rank(rank)))
    finish()
    return [r.getMessage() for r in records]


def test_transport_choice_logged():
    results = run_ranks(2, logged_worker, timeout=120,
                        env={"RINGREDUCE_TRANSPORT": "auto", "RINGREDUCE_DEBUG": "1"})
    for msgs in results:
        assert any("transport p2p" in m and "on host" in m for m in msgs), msgs


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v", *sys.argv[1:]]))
