"""The communicator lifecycle that every transport shares (ringreduce/_lifecycle.py), exercised on
the CPU with real processes, and the CUDA path's policy decisions that need no GPU: the transport
choice and the CUDA_DEVICE_MAX_CONNECTIONS guard. What this cannot show without a GPU (the CUDA
communicators on that lifecycle, their futures) is in tests/test_cuda.py."""
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from dist_utils import run_ranks
from ringreduce import _cuda, _lifecycle


def concurrent_worker(rank, world):
    group = dist.new_group(list(range(world)))
    got, errors = [None, None], []
    start = threading.Barrier(2)

    def first_use(i):
        try:
            start.wait()
            got[i] = rr.get_communicator(group, timeout=20)
        except Exception as e:  # reported below
            errors.append(repr(e))
    threads = [threading.Thread(target=first_use, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t = torch.full((10,), float(rank + 1))
    rr.all_reduce(t, group=group)
    live = [c for c in _lifecycle.REGISTRY.live(("shm",)) if c.group is group]
    return errors, got[0] is got[1], len(live), t[0].item()


def test_concurrent_first_use_creates_one_communicator():
    """Two threads meeting a group first (a DDP hook's thread and the main thread) must get one
    communicator: two would each run the collective setup and split the ranks between them."""
    for errors, same, live, value in run_ranks(3, concurrent_worker, timeout=120):
        assert errors == [] and same and live == 1, (errors, same, live)
        assert value == 6.0


def async_failure_worker(rank, world):
    t = torch.ones(12)
    rr.all_reduce(t)  # the communicator exists everywhere
    work = rr.all_reduce(torch.ones(13 if rank == 1 else 12), async_op=True)
    fut = work.get_future()
    try:
        fut.wait()
        fut_error = "no error"
    except Exception as e:
        fut_error = type(e).__name__ + ": " + str(e)
    try:
        work.wait()
        wait_error = "no error"
    except rr.RingReduceError as e:
        wait_error = str(e)
    exc = work.exception()
    # the communicator is broken: the next call raises at once, naming the first failure
    try:
        rr.all_reduce(torch.ones(12))
        again = "no error"
    except rr.RingReduceError as e:
        again = str(e)
    return fut_error, wait_error, type(exc).__name__, work.is_completed(), work.is_success(), again


def test_async_failure_reaches_future_wait_and_next_call():
    for rank, (fut_error, wait_error, exc, done, ok, again) in enumerate(
            run_ranks(3, async_failure_worker, env={"RINGREDUCE_TIMEOUT": "20"})):
        assert fut_error.startswith("RingReduceError") and "mismatched" in fut_error, fut_error
        assert "mismatched" in wait_error, wait_error
        assert exc == "RingReduceError" and done and not ok
        assert "broken by an earlier failure" in again and "mismatched" in again, again


def reinit_worker(rank, world, store_dir):
    """A process that destroys its process groups with torch.distributed alone (no rr.destroy) and
    initialises again, as a notebook or an in-process restart does."""
    import os.path
    sub = dist.new_group(list(range(world)))
    t = torch.ones(8)
    rr.all_reduce(t)
    rr.all_reduce(t, group=sub)
    old = list(_lifecycle.REGISTRY.live(("shm",)))
    dist.destroy_process_group(sub)
    dist.destroy_process_group()
    store = dist.FileStore(os.path.join(store_dir, "second-store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    t = torch.full((8,), float(rank + 1))
    rr.all_reduce(t)  # the first creation after the destroy closes the communicators left behind
    return len(old), [c.closed for c in old], len(_lifecycle.REGISTRY.live(("shm",))), t[0].item()


def test_destroyed_groups_communicators_are_closed(tmp_path):
    for n_old, closed, live, value in run_ranks(2, reinit_worker, str(tmp_path), timeout=120):
        assert n_old == 2 and closed == [True, True], (n_old, closed)
        assert live == 1 and value == 3.0, (live, value)


def test_decide_transport():
    host = "node1/boot-a"
    assert _cuda.policy.decide_transport([host] * 4, ["ok"] * 4)[0] == "p2p"
    assert _cuda.policy.decide_transport([host], ["ok"])[0] == "p2p"
    # across hosts (issue 74): the two-level plan where each host's ranks map each other
    transport, why = _cuda.policy.decide_transport([host, "node2/boot-b"], ["ok", "ok"])
    assert transport == "hier" and "2 hosts" in why
    two_by_two = [host, host, "node2/boot-b", "node2/boot-b"]
    assert _cuda.policy.decide_transport(two_by_two, ["ok"] * 4)[0] == "hier"
    # the flat ring: deterministic mode (rank order), unequal hosts, a host's pair without P2P
    transport, why = _cuda.policy.decide_transport(two_by_two, ["ok"] * 4, deterministic=True)
    assert transport == "nccl" and "deterministic" in why
    transport, why = _cuda.policy.decide_transport([host] * 3 + ["node2/boot-b"], ["ok"] * 4)
    assert transport == "nccl" and "unequal" in why and "[3, 1]" in why
    transport, why = _cuda.policy.decide_transport(two_by_two, ["ok", "ok", "ok", "no peer access"])
    assert transport == "nccl" and "rank 3" in why and "host's ranks" in why
    # one pair of neighbours without peer access (PCIe without P2P): nccl, naming the rank and why
    transport, why = _cuda.policy.decide_transport(
        [host] * 3, ["ok", "devices 1 and 2 (0000:41:00.0) have no peer access", "ok"])
    assert transport == "nccl" and "rank 1" in why and "no peer access" in why


def test_connections_warning():
    assert _cuda.policy.connections_warning("32", 2) is None
    assert _cuda.policy.connections_warning(None, 1) is None  # one communicator: nothing to collide with
    for value in (None, "8", "1"):
        msg = _cuda.policy.connections_warning(value, 2)
        assert msg and "CUDA_DEVICE_MAX_CONNECTIONS=32" in msg, msg


@pytest.mark.parametrize("preset", [None, "1"])
def test_import_raises_cuda_device_max_connections(preset):
    """Imported before CUDA starts, ringreduce raises the limit to 32 unless the user set one
    (Megatron-LM sets 1 on purpose)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}
    if preset is not None:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = preset
    out = subprocess.run([sys.executable, "-c", "import os, ringreduce; "
                          "print(os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS'))"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == (preset or "32")
