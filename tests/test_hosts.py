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


def plan_sweep_worker(rank, world, sizes, dtypes, ops):
    """sweep_worker, then the plan the communicator chose (one launch of the hosts for both)."""
    failures, digests = sweep_worker(rank, world, sizes, dtypes, ops)
    return failures, digests, plan_worker(rank, world)


def sweep(hosts, dtypes, ops, sizes):
    """Returns {rank: (transport, plan)}."""
    results, leftovers = run(hosts, "test_hosts:plan_sweep_worker", sizes, dtypes, ops,
                             timeout=600)
    for r, (failures, _, _) in results.items():
        assert failures == [], (r, failures[:5])
    for r in results:  # every rank ends with bitwise-identical all_reduce results
        assert results[r][1] == results[0][1], r
    assert all(v == [] for v in leftovers.values()), leftovers
    return {r: plan for r, (_, _, plan) in results.items()}


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
    world = len(hosts)
    few = (torch.float32, torch.int32) if world > 4 else (torch.float32, torch.bfloat16, torch.int8)
    got = sweep(hosts, few, OPS, sizes_for(world))
    assert set(got.values()) == {("hier", plan)}


def test_every_dtype_two_hosts():
    sweep(["a", "a", "b", "b"], DTYPES, (dist.ReduceOp.SUM, dist.ReduceOp.AVG), sizes_for(4))


def test_one_host_stays_flat():
    got, _ = run(["a", "a"], "test_hosts:plan_worker")
    assert set(got.values()) == {("shm", "flat")}


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_simulated_nodes(tmp_path):
    """Two `torchrun --nnodes=2` commands as users launch them, one per simulated host (its own
    mount namespace and /dev/shm), training examples/train_ddp.py with the ringreduce hook: every
    rank of both nodes ends with the same parameters, and nothing is left in either /dev/shm."""
    import re
    import subprocess
    import sys
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = _free_port()
    nodes = []
    for k in range(2):
        torchrun = (f'"$0" -m torch.distributed.run --nnodes=2 --node-rank={k} --nproc-per-node=2 '
                    f'--rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:{port} --rdzv-id=rr-hosts '
                    f'{repo}/examples/train_ddp.py --epochs 1 --events --checkpoint {tmp_path}/ck{k}.pt')
        script = (f"mount -t tmpfs -o size=1g tmpfs /dev/shm && {torchrun} && "
                  f"echo leftover: $(ls /dev/shm)")
        env = dict(os.environ, OMP_NUM_THREADS="1", RINGREDUCE_HOST_ID=f"node{k}", RINGREDUCE_DEBUG="1",
                   TORCH_CPP_LOG_LEVEL="ERROR")
        nodes.append(subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script, sys.executable],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path))
    outs = []
    try:
        for p in nodes:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, out in zip(nodes, outs):
        assert p.returncode == 0, out[-4000:]
    text = "\n".join(outs)
    digests = dict(re.findall(r"rank (\d) host node\d parameters sha1 ([0-9a-f]{40})\b", text))
    assert sorted(digests) == ["0", "1", "2", "3"], text[-4000:]
    assert len(set(digests.values())) == 1, digests
    assert re.search(r"epoch 1/1 .* 4 ranks, backend gloo, hook allreduce", text), text[-4000:]
    assert len(re.findall(r"^leftover: *$", text, re.M)) == 2, text[-4000:]
    # the hook's all-reduces took the two-level plan (RINGREDUCE_DEBUG=1 logs the choice)
    assert len(re.findall(r"CPU plan two-level \(2 hosts x 2 ranks\)", text)) == 4, text[-4000:]


def victim_worker(rank, world, victim, timeout):
    """Reduces 16 MiB again and again; the victim kills itself during its fourth call."""
    import signal
    import threading
    import time
    comm = rr.get_communicator(timeout=timeout)
    t = torch.ones(4 << 20)
    for i in range(1000):
        if rank == victim and i == 3:
            threading.Timer(0.005, os.kill, (os.getpid(), signal.SIGKILL)).start()
        start = time.monotonic()
        try:
            rr.all_reduce(t)
        except Exception as e:
            first = type(e).__name__, str(e), time.monotonic() - start, comm.plan
            break
        t.fill_(1)
    else:
        return None
    start = time.monotonic()  # a later call on the broken group raises at once
    try:
        rr.all_gather_into_tensor(torch.empty(4 * world), torch.ones(4))
        return first + ("no error", 0.0)
    except Exception as e:
        return first + (str(e), time.monotonic() - start)


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "a", "a", "b"]])
def test_rank_killed_on_other_host(hosts):
    """A rank on host b killed mid-collective: every survivor on both hosts raises within the
    timeout (none hangs), the inter-host step's error names the phase and the group, and neither
    host's /dev/shm keeps anything."""
    victim, timeout = len(hosts) - 1, 10.0
    results, leftovers = run(hosts, "test_hosts:victim_worker", victim, timeout,
                             expect_dead={victim}, timeout=120)
    assert sorted(results) == [r for r in range(len(hosts)) if r != victim]
    for r, res in results.items():
        assert res is not None, f"rank {r} never failed"
        name, msg, took, _, again, again_took = res
        assert name == "RingReduceError", (r, name, msg)
        assert took < timeout + 5, (r, took, msg)
        assert "is broken by an earlier failure" in again and again_took < 1.0, (r, again)
    gloo = [res[1] for res in results.values() if "inter-host step" in res[1]]
    assert gloo, results
    assert all("failed in group" in m and "Gloo" in m for m in gloo), gloo
    assert all(v == [] for v in leftovers.values()), leftovers


def api_worker(rank, world):
    """Async handles, a subgroup and the torch.distributed backend on simulated hosts. Flat shared
    memory cannot work across these hosts (private /dev/shm), so a right answer is the hierarchy's."""
    out = {}
    t = torch.full((1001,), float(rank + 1))
    rr.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True).wait()
    out["async"] = t.unique().tolist()
    sub = dist.new_group([0, 2, 3])
    if rank in (0, 2, 3):
        s = torch.full((7,), float(rank))
        rr.all_reduce(s, group=sub, op=dist.ReduceOp.MAX)
        out["sub"] = (s.unique().tolist(), rr.get_communicator(sub).plan)
    pg = dist.new_group(backend="ringreduce")
    b = torch.full((33,), float(rank))
    dist.all_reduce(b, group=pg)
    out["backend"] = b.unique().tolist()
    return out


def test_async_subgroup_and_backend():
    got, leftovers = run(["a", "a", "b", "b"], "test_hosts:api_worker")
    for r, out in got.items():
        assert out["async"] == [2.5], (r, out)
        assert out["backend"] == [6.0], (r, out)
        if r != 1:
            assert out["sub"] == ([3.0], "leaders"), (r, out)  # ranks 0 | 2, 3: 1 + 2
    assert all(v == [] for v in leftovers.values()), leftovers


def wire_hosts_worker(rank, world, hosts, sizes, dtypes):
    """all_reduce (in place, SUM and AVG, every other call async) and reduce_scatter_tensor with
    every wire on a group across hosts: the bits of tests/reference.py's hosts references (the
    wire on the inter-host leg: each host's partial sum rounded once), then the plan."""
    from reference import wire_hosts_reference, wire_hosts_scatter_reference, wire_scatter_reference
    from test_wire import WIRES, bits, wide_input
    failures, digests = [], []
    two_level = plan_worker(rank, world)[1] == "two-level"
    for wire in WIRES:
        for dtype in dtypes:
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                for k, numel in enumerate(sizes):
                    tag = f"{wire} {dtype} {op} numel={numel} hosts={hosts}"
                    ins = [wide_input(r, numel, dtype, seed=numel) for r in range(world)]
                    t = ins[rank].clone()
                    work = rr.all_reduce(t, op=op, wire_dtype=wire, async_op=k % 2 == 1)
                    if work is not None:
                        work.wait()
                    if not torch.equal(bits(t), bits(wire_hosts_reference(ins, hosts, wire, op))):
                        failures.append(f"all_reduce {tag}")
                    digests.append(bits(t).sum().item())
                    m = numel // world
                    big = [x[:m * world] for x in ins]
                    out = torch.empty(m, dtype=dtype)
                    rr.reduce_scatter_tensor(out, big[rank].clone(), op=op, wire_dtype=wire)
                    want = (wire_hosts_scatter_reference(big, hosts, wire, op, rank) if two_level
                            else wire_scatter_reference(big, wire, op, rank))  # uneven: flat
                    if not torch.equal(bits(out), bits(want)):
                        failures.append(f"reduce_scatter {tag}")
    return failures, digests, plan_worker(rank, world)


@pytest.mark.parametrize("hosts,plan", [
    (["a", "a", "b", "b"], "two-level"),   # 2 hosts x 2 ranks
    (["a", "b", "a", "b"], "two-level"),   # interleaved
    (["a", "b"], "two-level"),             # 2 hosts x 1 rank
    (["a", "a", "b", "c"], "leaders"),     # uneven: the wire on the leaders' leg
    (["a", "a", "b", "b", "c", "c"], "two-level"),  # 3 hosts: two steps above 256 KiB
])
def test_wire_across_hosts(hosts, plan):
    """wire_dtype between hosts: the tensor's dtype inside each host, each host's partial sum
    rounded onto the wire once between hosts; the reference's bits, every wire and op, on every
    rank."""
    dtypes = (torch.float32, torch.bfloat16) if hosts == ["a", "a", "b", "b"] else (torch.float32,)
    sizes = (1, 129, 5000, 70001) if len(hosts) < 6 else (129, 70001, 200003)
    results, leftovers = run(hosts, "test_hosts:wire_hosts_worker", hosts, sizes, dtypes,
                             timeout=600)
    for r, (failures, digests, got) in results.items():
        assert failures == [], (r, failures[:5])
        assert digests == results[0][1]
        assert got == ("hier", plan), got
    assert all(v == [] for v in leftovers.values()), leftovers


def hosts_overflow_worker(rank, world):
    from test_wire import overflow_worker
    return overflow_worker(rank, world)


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "a", "b", "c"]])
def test_fp16_wire_overflow_across_hosts(hosts):
    """A float16 wire's overflow on one rank's part of the call (a value beyond 65504 in one
    host's partial sum, or a sum beyond it) is an error on every rank of every host; AVG divides
    each host's partial sum first, so the average of values that fit fits."""
    results, leftovers = run(hosts, "test_hosts:hosts_overflow_worker", timeout=300)
    for r, (errors, avg, inf) in results.items():
        assert len(errors) == 2 and all("65504" in e for e in errors), (r, errors)
        assert avg == 40000.0 and inf, (r, avg, inf)
    assert all(v == [] for v in leftovers.values()), leftovers


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "a", "b", "b", "c", "c"]])
def test_wire_across_hosts_in_many_pieces(hosts):
    """The pipeline with many pieces in flight (RINGREDUCE_HIER_PIECE_KB=16: pieces of 16 KiB):
    the same bits as in one piece, on every rank, for the one-step exchange (2 hosts) and the
    two steps (3 hosts, above 256 KiB)."""
    results, leftovers = run(hosts, "test_hosts:wire_hosts_worker", hosts, (70001, 200003),
                             (torch.float32,), timeout=600,
                             env={"RINGREDUCE_HIER_PIECE_KB": "16"})
    for r, (failures, digests, got) in results.items():
        assert failures == [], (r, failures[:5])
        assert digests == results[0][1]
    assert all(v == [] for v in leftovers.values()), leftovers
