"""Soak and stress: thousands of random collectives on random subgroups against the reference,
with file descriptors and RSS not growing; more ranks than cores."""
import os
import random

import torch
import torch.distributed as dist

import ringreduce as rr
from dist_utils import run_ranks
from reference import DTYPES, OPS, check_close, make_input, reduce_reference


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak_worker(rank, world, iters):
    groups = [None] + [dist.new_group(list(pair)) for pair in ((0, 1), (1, 2), (0, 2))]
    members = [list(range(world)), [0, 1], [1, 2], [0, 2]]
    rng = random.Random(1234)  # the same choices on every rank
    failures, fds, rss = [], [], []
    for it in range(iters):
        gi = rng.randrange(len(groups))
        dtype = rng.choice(DTYPES)
        op = rng.choice(OPS)
        coll = rng.choice(["all_reduce", "reduce_scatter", "all_gather"])
        numel = rng.choice([0, 1, 2, 3, rng.randrange(1, 5000), rng.randrange(1, 70000)])
        if it == 300:
            fds.append(len(os.listdir("/proc/self/fd")))
            rss.append(rss_bytes())
        if rank not in members[gi]:
            continue
        ranks = members[gi]
        n, me = len(ranks), ranks.index(rank)
        ins = [make_input(r, numel if coll != "reduce_scatter" else numel * n, dtype, op, seed=it)
               for r in range(n)]
        if coll == "all_reduce":
            t = ins[me].clone()
            rr.all_reduce(t, op=op, group=groups[gi])
            exp, tol = reduce_reference(ins, op)
            bad = check_close(t, exp, tol)
        elif coll == "reduce_scatter":
            out = torch.empty(numel, dtype=dtype)
            rr.reduce_scatter_tensor(out, ins[me], op=op, group=groups[gi])
            exp, tol = reduce_reference(ins, op)
            sl = slice(me * numel, (me + 1) * numel)
            bad = check_close(out, exp[sl], None if tol is None else tol[sl])
        else:
            out = torch.empty(numel * n, dtype=dtype)
            rr.all_gather_into_tensor(out, ins[me], group=groups[gi])
            bad = int((out != torch.cat(ins)).sum())
        if bad:
            failures.append(f"iter {it}: {coll} {dtype} {op} numel={numel} group={ranks}: {bad}")
    fds.append(len(os.listdir("/proc/self/fd")))
    rss.append(rss_bytes())
    return failures, fds, rss


def test_soak_random_collectives():
    for failures, fds, rss in run_ranks(3, soak_worker, 2000, timeout=600):
        assert failures == []
        assert fds[1] <= fds[0], f"file descriptors grew: {fds}"
        assert rss[1] - rss[0] < 32 << 20, f"RSS grew by {(rss[1] - rss[0]) >> 20} MiB"


def stress_worker(rank, world):
    failures = []
    for numel in (0, 1, 5, 6, 7, 4099, 300007):
        for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX):
            ins = [make_input(r, numel, torch.float32, op, seed=numel) for r in range(world)]
            t = ins[rank].clone()
            rr.all_reduce(t, op=op)
            exp, tol = reduce_reference(ins, op)
            if check_close(t, exp, tol):
                failures.append(f"numel={numel} op={op}")
    return failures


def test_more_ranks_than_cores():
    world = max(6, 3 * len(os.sched_getaffinity(0)))
    for failures in run_ranks(world, stress_worker, timeout=300):
        assert failures == []
