"""Groups across hosts (issue 14): simulated hosts on this machine, each in a mount namespace with a
private /dev/shm (tests/sim_hosts.py), so shared memory cannot cross a host boundary."""
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from reference import DTYPES, OPS
from sim_hosts import run
from test_collectives import sweep_worker

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="simulated hosts need root and unshare (mount namespaces); CI runs as root")


def plan_worker(rank, world):
    comm = rr.get_communicator()
    return comm.transport, getattr(comm, "plan", "flat")


def sweep(hosts, dtypes, ops, sizes):
    results, leftovers = run(hosts, "test_collectives:sweep_worker", sizes, dtypes, ops,
                             timeout=600)
    for r, (failures, _) in results.items():
        assert failures == [], (r, failures[:5])
    for r in results:  # every rank ends with bitwise-identical all_reduce results
        assert results[r][1] == results[0][1], r
    assert all(v == [] for v in leftovers.values()), leftovers


def sizes_for(world):
    return sorted({0, 1, world - 1, world + 1, 2 * world + 3, 100003})


@pytest.mark.parametrize("hosts,plan", [
    (["a", "a", "b", "b"], "two-level"),
    (["a", "b", "a", "b"], "two-level"),              # interleaved ranks
    (["a", "a", "b", "b", "c", "c"], "two-level"),    # 3 hosts x 2
    (["a", "a", "a", "b", "b", "b"], "two-level"),    # 2 hosts x 3
    (["a", "a", "b", "a"], "leaders"),                # uneven 3 + 1
    (["a", "b", "c", "c"], "leaders"),                # uneven 1 + 1 + 2
])
def test_plans_and_results(hosts, plan):
    got, _ = run(hosts, "test_hosts:plan_worker")
    assert set(got.values()) == {("hier", plan)}
    world = len(hosts)
    few = (torch.float32, torch.int32) if world > 4 else (torch.float32, torch.bfloat16, torch.int8)
    sweep(hosts, few, OPS, sizes_for(world))


def test_every_dtype_two_hosts():
    sweep(["a", "a", "b", "b"], DTYPES, (dist.ReduceOp.SUM, dist.ReduceOp.AVG), sizes_for(4))


def test_one_host_stays_flat():
    got, _ = run(["a", "a"], "test_hosts:plan_worker")
    assert set(got.values()) == {("shm", "flat")}
