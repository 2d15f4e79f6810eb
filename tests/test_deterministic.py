"""Deterministic mode (RINGREDUCE_DETERMINISTIC=1, rr.set_deterministic): every element of every
all_reduce and reduce_scatter is, bit for bit, the rank-order fold ((x0 op x1) op x2) ... in the
dtype's accumulation type (fp16/bf16: fp32) rounded once, whatever the size, slicing, forced
algorithm or plan (flat shared memory, two simulated hosts)."""
import copy
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from dist_utils import run_ranks
from reference import digest

SUM, AVG, MIN, MAX, PROD = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MIN,
                            dist.ReduceOp.MAX, dist.ReduceOp.PRODUCT)
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32}
MiB = 1 << 20
# Powers of two of det_input's small values and of its cancelling pairs.
SCALE = {torch.float32: (0, 30), torch.float64: (0, 60), torch.float16: (-8, 15),
         torch.bfloat16: (0, 40)}


def bits(t):
    return t.contiguous().view(BITS[t.element_size()])


def det_input(rank, numel, dtype, op, seed=0, world=4):
    """Rank's data. For sums, half the elements are +B on one rank and -B on the next (a pair drawn
    per element, the same on every rank) with B far above the other values in the accumulation
    type: any other order or grouping of the additions loses the small values there, so a result
    that is not the rank-order fold shows in the bits. The other half: mixed magnitudes. Near 1 for
    products; small integers."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int64).to(dtype)
    if op == PROD:
        return (torch.rand(numel, generator=g, dtype=torch.float64) + 0.5).to(dtype)
    small, big = SCALE[dtype]
    x = torch.randn(numel, generator=g, dtype=torch.float64) * torch.pow(
        2.0, torch.randint(small - 4, small + 5, (numel,), generator=g).to(torch.float64))
    shared = torch.Generator().manual_seed(seed * 7919 + 104729)
    pair = torch.randint(0, max(1, world - 1), (numel,), generator=shared)
    cancel = torch.rand(numel, generator=shared) < 0.5
    x[cancel & (pair == rank)] = 2.0 ** big
    x[cancel & (pair + 1 == rank)] = -(2.0 ** big)
    return x.to(dtype)


def fold(xs, op, order=None):
    """The rank-order fold of xs in the accumulation type, rounded once: the contract."""
    dtype, n = xs[0].dtype, len(xs)
    acc_t = ACC.get(dtype, dtype)
    order = list(range(n)) if order is None else order
    acc = xs[order[0]].to(acc_t)
    for q in order[1:]:
        x = xs[q].to(acc_t)
        if op in (SUM, AVG):
            acc = acc + x
        elif op == PROD:
            acc = acc * x
        elif op == MIN:
            acc = torch.minimum(acc, x)
        else:
            acc = torch.maximum(acc, x)
    if op == AVG:
        if dtype.is_floating_point:
            acc = acc / torch.full_like(acc, n)  # a tensor: no multiply-by-reciprocal shortcut
        else:
            acc = torch.div(acc, n, rounding_mode="trunc")
    return acc.to(dtype)


# (numel, dtype, op). 1 element to 16 MiB; sizes below and around the world size, odd sizes, sizes
# spanning many slices of both the default (128 KiB) and the small (4 KiB) communicator.
CASES = (
    [(n, torch.float32, SUM) for n in (1, 2, 3, 7, 1000, 65537, 1048583)]
    + [(4 * MiB, torch.float32, SUM)]  # 16 MiB
    + [(n, dt, op) for n in (5, 4099, 300001) for dt in (torch.float16, torch.bfloat16)
       for op in (SUM, AVG)]
    + [(3001, torch.float64, SUM), (70001, torch.float32, AVG), (3001, torch.int32, AVG),
       (20001, torch.int64, SUM), (513, torch.float32, PROD), (513, torch.bfloat16, MIN),
       (513, torch.float16, MAX)]
)
RS_CASES = [(c, dt, op) for c in (1, 1000, 70001) for dt in (torch.float32, torch.bfloat16)
            for op in (SUM, AVG)]
# Communicators on their own groups: another slice size, and every forced algorithm (deterministic
# mode overrides the ring and keeps the rank-order ones).
VARIANTS = [dict(slice_bytes=4096, algo="ring"), dict(slice_bytes=4096, algo="oneshot"),
            dict(algo="twoshot"), dict(slice_bytes=1 << 20, algo="auto"),
            dict(slice_bytes=4096, algo="cma")]


def _simulated_hosts(rank, world, hier):
    if hier:  # two simulated hosts: the hierarchical plan
        os.environ["RINGREDUCE_HOST_ID"] = f"host{rank * 2 // world}"


def sweep_worker(rank, world, hier, variants, max_numel):
    _simulated_hosts(rank, world, hier)
    rr.set_deterministic(True)
    groups = [None] + [dist.new_group() for _ in variants]
    for g, opts in zip(groups[1:], variants):
        rr.get_communicator(g, **opts)
    failures, algos, digests = [], set(), []
    for i, (numel, dtype, op) in enumerate(CASES):
        if numel > max_numel:
            continue
        # The callers check that every rank's digests are equal, so one rank per case (round
        # robin) builds every input and the fold: on every rank, that was most of the time.
        checker = i % world == rank
        xs = [det_input(q, numel, dtype, op, world=world) for q in range(world)] if checker \
            else None
        mine = xs[rank] if checker else det_input(rank, numel, dtype, op, world=world)
        want = bits(fold(xs, op)) if checker else None
        for g in groups:
            t = mine.clone()
            rr.all_reduce(t, op=op, group=g)
            if checker and not torch.equal(bits(t), want):
                failures.append(f"all_reduce {numel} {dtype} {op} group {groups.index(g)}: "
                                f"{int((bits(t) != want).sum())} elements differ")
            digests.append(digest(t))
            if not hier:
                algos.add(rr.get_communicator(g).algo_for(numel, dtype))
    for c, dtype, op in RS_CASES:
        xs = [det_input(q, c * world, dtype, op, seed=1, world=world) for q in range(world)]
        want = bits(fold(xs, op)[rank * c:(rank + 1) * c])
        for g in groups:
            out = torch.empty(c, dtype=dtype)
            rr.reduce_scatter_tensor(out, xs[rank].clone(), op=op, group=g)
            if not torch.equal(bits(out), want):
                failures.append(f"reduce_scatter {c} {dtype} {op} group {groups.index(g)}")
    return failures, sorted(algos), digests


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_rank_order_bits_flat(world):
    """Worlds 2-5 on one host (shared memory): one-shot and two-shot, any slice size, any forced
    algorithm: the bits of the rank-order fold."""
    variants = VARIANTS if world in (3, 4) else VARIANTS[:1]
    results = run_ranks(world, sweep_worker, False, variants, 4 * MiB, timeout=600)
    for failures, algos, digests in results:
        assert failures == []
        want = ["cma", "oneshot", "twoshot"] if world in (3, 4) else ["oneshot", "twoshot"]
        assert algos == want, algos
        assert digests == results[0][2]


def test_rank_order_bits_two_simulated_hosts():
    """2 x 2 hierarchical layout: the same bits as the flat fold (not the hosts' partial sums)."""
    results = run_ranks(4, sweep_worker, True, [], 4 * MiB, timeout=600,
                        env={"OMP_NUM_THREADS": "1"})
    for failures, _, digests in results:
        assert failures == []
        assert digests == results[0][2]


def test_inputs_tell_orders_apart():
    """The test inputs would catch another order or one rounding per step."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        xs = [det_input(q, 4099, dtype, SUM) for q in range(4)]
        want = bits(fold(xs, SUM))
        assert not torch.equal(bits(fold(xs, SUM, order=[2, 3, 0, 1])), want)
        pairs = (fold(xs[:2], SUM).to(ACC.get(dtype, dtype))
                 + fold(xs[2:], SUM).to(ACC.get(dtype, dtype))).to(dtype)  # host partials
        assert not torch.equal(bits(pairs), want)
        if dtype in ACC:  # rounding after every step
            step = xs[0]
            for x in xs[1:]:
                step = (step.float() + x.float()).to(dtype)
            assert not torch.equal(bits(step), want)


def ddp_worker(rank, world, caps, backend_group):
    """Gradients of one DDP step for each bucket size, with the hook or through the backend."""
    # One intra-op thread: the reference backward below must sum as DDP's did. With more, a GEMM's
    # split can follow the threads the BLAS takes under load (3 ranks on CI's 2 cores): CI saw
    # 32,752 of 32,768 elements of the first weight's gradient differ from the rank-order fold of
    # the ranks' own gradients by amounts no fold of those inputs explains: the inputs (a rank's
    # backward) differed between the two passes.
    torch.set_num_threads(1)
    rr.set_deterministic(True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 300),
                                torch.nn.Tanh(), torch.nn.Linear(300, 10))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(32, 64, generator=g) * 8
    y = torch.randint(0, 10, (32,), generator=g)
    pg = dist.new_group(backend="ringreduce") if backend_group else None
    grads = {}
    for cap in caps:
        m = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=cap,
                                                      process_group=pg)
        if not backend_group:
            m.register_comm_hook(None, rr.ddp.allreduce_hook)
        m.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        grads[cap] = [p.grad.numpy().copy() for p in m.parameters()]  # by value through the queue
    # Each rank's own gradients (no communication), for the rank-order reference.
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return grads, [p.grad.numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize("backend_group", [False, True], ids=["hook", "backend"])
def test_ddp_gradients_do_not_move_with_bucket_cap(backend_group):
    """The user's story: a DDP step's averaged gradients have the same bits for any bucket_cap_mb,
    and they are the rank-order average of the ranks' own gradients."""
    world, caps = 3, (0.01, 0.1, 25)
    results = run_ranks(world, ddp_worker, caps, backend_group, timeout=300)
    local = [[torch.from_numpy(g) for g in r[1]] for r in results]
    if backend_group:  # DDP's own reducer multiplies each rank's gradient by 1/world, then sums
        local = [[g * torch.full_like(g, 1.0 / world) for g in gs] for gs in local]
    op = SUM if backend_group else AVG  # the hook averages in one pass
    want = [bits(fold([local[q][i] for q in range(world)], op)) for i in range(len(local[0]))]
    for rank, (grads, _) in enumerate(results):
        for cap in caps:
            for i, g in enumerate(grads[cap]):
                got = torch.from_numpy(g)
                assert torch.equal(bits(got), want[i]), \
                    f"rank {rank}, cap {cap}, parameter {i}: " + explain(got, [local[q][i] for q in range(world)], op)


def explain(got, xs, op):
    """What a wrong result matches (this test failed twice in CI before its workers ran one
    thread): how many elements differ and by how much, and whether another order or a missing rank gives its bits."""
    want = fold(xs, op)
    bad = (bits(got) != bits(want)).view(-1)
    rel = ((got.double() - want.double()).abs() / want.double().abs().clamp_min(1e-30)).view(-1)[bad]
    text = f"{int(bad.sum())} of {bad.numel()} elements differ, largest relative {float(rel.max()):.3g}"
    n = len(xs)
    candidates = {f"order {list(reversed(range(n)))}": fold(xs, op, order=list(reversed(range(n))))}
    for q in range(n):
        rest = [x for k, x in enumerate(xs) if k != q]
        candidates[f"rank {q} missing"] = fold(rest, op)
    matches = [name for name, t in candidates.items() if torch.equal(bits(t), bits(got))]
    return text + (f"; equals the fold with {', '.join(matches)}" if matches else "; matches no other fold tried")


def toggle_worker(rank, world):
    big = 1 << 18
    rr.all_reduce(torch.ones(4))
    comm = rr.get_communicator()
    before = (rr.is_deterministic(), comm.algo_for(big, torch.float32))
    rr.set_deterministic(True)
    during = (rr.is_deterministic(), comm.algo_for(big, torch.float32),
              comm.algo_for(16, torch.float32))
    rr.set_deterministic(False)
    return before, during, comm.algo_for(big, torch.float32)


def test_set_deterministic_switches_algorithms():
    for before, during, after in run_ranks(2, toggle_worker, timeout=120):
        assert before == (False, "ring")
        assert during == (True, "twoshot", "oneshot")
        assert after == "ring"


def mismatch_worker(rank, world):
    rr.set_deterministic(rank == 0)
    t = torch.ones(1 << 18)
    try:
        rr.all_reduce(t)
    except rr.RingReduceError as e:
        return str(e)
    return "no error"


def test_mismatched_setting_is_an_error_on_every_rank(tmp_path):
    """One rank deterministic (two-shot), the other not (ring): both raise at once, naming the
    setting, instead of hanging or returning different bits."""
    for msg in run_ranks(2, mismatch_worker, timeout=120,
                         env={"RINGREDUCE_TIMEOUT": "30", "RINGREDUCE_TRACE_DIR": str(tmp_path)}):
        assert "RINGREDUCE_DETERMINISTIC" in msg or "aborted the group" in msg, msg
        assert "timed out" not in msg, msg


def test_environment_variable():
    code = "import ringreduce; print(ringreduce.is_deterministic())"
    for value, want in (("1", "True"), ("0", "False"), ("", "False")):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=dict(os.environ, RINGREDUCE_DETERMINISTIC=value), timeout=120)
        assert p.stdout.strip() == want, (value, p.stderr)


def hier_mismatch_worker(rank, world):
    _simulated_hosts(rank, world, True)
    rr.set_deterministic(rank != 3)
    t = torch.ones(1 << 16)
    t0 = time.monotonic()
    try:
        rr.all_reduce(t)
    except rr.RingReduceError as e:
        return time.monotonic() - t0, str(e)
    return time.monotonic() - t0, "no error"


def test_mismatched_setting_across_hosts_fails_within_the_timeout(tmp_path):
    """Two simulated hosts, rank 3 not deterministic: every rank raises within the timeout (the
    others wait for it to join the all-ranks group), none hangs; the deterministic ranks' errors
    name the setting or the abort it caused."""
    results = run_ranks(4, hier_mismatch_worker, timeout=180,
                        env={"RINGREDUCE_TIMEOUT": "8", "OMP_NUM_THREADS": "1",
                             "RINGREDUCE_TRACE_DIR": str(tmp_path)})
    for rank, (secs, msg) in enumerate(results):
        assert msg != "no error", rank
        assert secs < 8 * 3, (rank, secs, msg)
    assert any("RINGREDUCE_DETERMINISTIC" in msg for _, msg in results[:3]), results


def test_bad_environment_value():
    p = subprocess.run([sys.executable, "-c", "import ringreduce"], capture_output=True, text=True,
                       env=dict(os.environ, RINGREDUCE_DETERMINISTIC="maybe"), timeout=120)
    assert p.returncode != 0
    assert ("RINGREDUCE_DETERMINISTIC must be one of 1, true, yes, on (on) or 0, false, no, off (off), "
            "got 'maybe'") in p.stderr, p.stderr[-2000:]


def test_reduce_rows_kernel():
    """The fold every CPU path uses, against the reference, in place too."""
    from ringreduce import _C
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8):
        for op, code in ((SUM, 0), (AVG, 1), (MIN, 2), (MAX, 3), (PROD, 4)):
            xs = [det_input(q, 2500, dtype, op, seed=3) for q in range(5)]
            rows = torch.stack(xs)
            out = torch.empty(2500, dtype=dtype)
            _C.reduce_rows(out, rows, code)
            assert torch.equal(bits(out), bits(fold(xs, op))), (dtype, op)
            _C.reduce_rows(rows[2], rows, code)  # the output is one of the sources
            assert torch.equal(bits(rows[2]), bits(fold(xs, op))), (dtype, op)
    with pytest.raises(ValueError, match="out must be a contiguous CPU tensor of 3 elements"):
        _C.reduce_rows(torch.empty(4), torch.ones(2, 3), 0)


def test_debug_log_describes_the_plan_that_will_run():
    """RINGREDUCE_DEBUG's line about the shared-memory plan follows deterministic mode (issue 73):
    it names the rank-order algorithms choose() runs then, not auto's normal steps."""
    import types
    from ringreduce import _C, _shm
    comm = types.SimpleNamespace(algo="auto", oneshot_max_bytes=16384, auto_steps=[(4 << 20, "cma")])
    was = _C.deterministic()
    try:
        _C.set_deterministic(False)
        assert _shm.Communicator._plan_text(comm) == ("algo auto, one-shot up to 16384 B, then "
                                                      "[(4194304, 'cma')]")
        _C.set_deterministic(True)
        assert _shm.Communicator._plan_text(comm) == (
            "deterministic mode: all_reduce one-shot up to 16384 B, then two-shot (cma from where "
            "the steps pick it); reduce_scatter two-shot")
        comm.algo, comm.auto_steps = "ring", []
        assert "then two-shot; reduce_scatter two-shot" in _shm.Communicator._plan_text(comm)
        comm.algo = "oneshot"
        assert _shm.Communicator._plan_text(comm) == ("deterministic mode: all_reduce one-shot, "
                                                      "reduce_scatter two-shot")
    finally:
        _C.set_deterministic(was)
