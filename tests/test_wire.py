"""A narrow wire with an exact sum: all_reduce / reduce_scatter_tensor(..., wire_dtype=) give the
bits of tests/reference.py's plain-torch definition, on every rank, at every world size and slice."""
import os

import pytest
import torch
import torch.distributed as dist

import ringreduce as rr
from ringreduce import _C
from dist_utils import run_ranks
from reference import WIRE_MAX, digest, wire_fold, wire_reference, wire_scatter_reference

WIRES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)
CODES = {torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
TENSOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SUM, AVG = dist.ReduceOp.SUM, dist.ReduceOp.AVG


def bits(t):
    """The tensor's bits as integers: equal bits, nan payloads included."""
    t = t.contiguous().view(-1)
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def wide_input(rank, numel, dtype, seed):
    """Values over many binades (fp8's scales and fp16's range matter), a zero block, negatives."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g) * 2)
    if numel > 300:
        x[128:256] = 0  # a block of zeros: scale 0
        x[260] = 1e-30  # a block whose absmax is tiny
    return x.clamp(-60000, 60000).to(dtype)


@pytest.mark.parametrize("wire", WIRES, ids=str)
def test_fold_kernel_matches_reference(wire):
    """The native fold (encode, rank-order fp32 sum, re-round) has the reference's bits."""
    g = torch.Generator().manual_seed(1)
    cases = 0
    for dtype in TENSOR_DTYPES:
        for op, code in ((SUM, 0), (AVG, 1)):
            for n in (1, 2, 3, 5):
                for numel in (0, 1, 127, 128, 129, 1000, 4099):
                    for round_result in (True, False):
                        rows = torch.randn(n, numel, generator=g) * \
                            torch.exp(torch.randn(n, numel, generator=g) * 3)
                        if numel > 300:
                            rows[:, 128:256] = 0
                        rows = rows.to(dtype)  # float16 rows hold infs: nan blocks (fp8), inf
                        out = torch.empty(numel, dtype=dtype)
                        _C.wire_fold(out, rows, code, CODES[wire], round_result)
                        ref = wire_fold(list(rows), wire, op, round_result).to(dtype)
                        assert torch.equal(bits(out), bits(ref)), \
                            (wire, dtype, op, n, numel, round_result)
                        cases += 1
    assert cases == 3 * 2 * 4 * 7 * 2


@pytest.mark.parametrize("wire", (torch.float8_e4m3fn, torch.float8_e5m2), ids=str)
def test_fp8_rounding_matches_torch(wire):
    """Every fp8 value, every midpoint between neighbours (ties to even) and the floats next to
    them, subnormals: the kernel's byte is torch's. A block whose absmax is the format's max has
    scale 1, so the fold of one row returns the rounded values themselves."""
    fmax = WIRE_MAX[wire]
    every = torch.arange(256, dtype=torch.uint8).view(wire).float()
    vals = every[torch.isfinite(every)].unique()
    mids = ((vals[1:].double() + vals[:-1].double()) / 2).float()
    up, down = torch.full_like(mids, 1e30), torch.full_like(mids, -1e30)
    x = torch.cat([vals, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                   torch.randn(3000, generator=torch.Generator().manual_seed(2)) * fmax / 8])
    x = x[x.abs() <= fmax]
    x = torch.cat([x, torch.zeros((-x.numel()) % 127)]).view(-1, 127)
    row = torch.cat([torch.full((x.shape[0], 1), fmax), x], 1).reshape(1, -1).contiguous()
    out = torch.empty(row.shape[1])
    _C.wire_fold(out, row, 0, CODES[wire], False)
    want = row.view(-1).to(wire).float()
    assert int((bits(out) != bits(want)).sum()) == 0
    assert row.numel() > 3 * vals.numel()


def on(device, rank):
    """The rank's device: the CPU, or its GPU (ranks share one where there is one)."""
    if device == "cpu":
        return torch.device("cpu")
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def done(device):
    if device != "cpu":  # every CUDA call finished, communicators closed while the group lives
        from ringreduce import _lifecycle
        torch.cuda.synchronize()
        _lifecycle.REGISTRY.destroy_all()


def sweep_worker(rank, world, wires, sizes, dtypes, device="cpu"):
    """all_reduce (in place, SUM and AVG; every other call async) and reduce_scatter_tensor with
    every wire: the reference's bits on this rank; returns the all_reduce digests (equal on
    every rank)."""
    dev = on(device, rank)
    failures, digests = [], []
    for wire in wires:
        for dtype in dtypes:
            for op in (SUM, AVG):
                for k, numel in enumerate(sizes):
                    tag = f"{wire} {dtype} {op} numel={numel} world={world} on {device}"
                    ins = [wide_input(r, numel, dtype, seed=numel) for r in range(world)]
                    t = ins[rank].clone().to(dev)
                    work = rr.all_reduce(t, op=op, wire_dtype=wire, async_op=k % 2 == 1)
                    if work is not None:
                        work.wait()
                    t = t.cpu()
                    if not torch.equal(bits(t), bits(wire_reference(ins, wire, op))):
                        failures.append(f"all_reduce {tag}")
                    digests.append(digest(t))
                    m = numel // world
                    big = [x[:m * world] for x in ins]
                    out = torch.empty(m, dtype=dtype, device=dev)
                    rr.reduce_scatter_tensor(out, big[rank].clone().to(dev), op=op, wire_dtype=wire)
                    if not torch.equal(bits(out.cpu()), bits(wire_scatter_reference(big, wire, op, rank))):
                        failures.append(f"reduce_scatter {tag}")
    done(device)
    return failures, digests


def check_sweep(results):
    for failures, _ in results:
        assert not failures, failures[:10]
    assert all(d == results[0][1] for _, d in results)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_wire_collectives_bits(world):
    sizes = (0, 1, 5, 127, 129, 1000, 70001)
    check_sweep(run_ranks(world, sweep_worker, WIRES, sizes, TENSOR_DTYPES[:1]))


def test_wire_collectives_half_tensors():
    """float16 and bfloat16 tensors: the input is read exactly, the result rounded to it."""
    check_sweep(run_ranks(3, sweep_worker, WIRES, (1, 129, 5000), TENSOR_DTYPES[1:]))


def test_wire_many_slices():
    """1 KiB slices (a few blocks per part): hundreds of pipelined slices, the same bits."""
    check_sweep(run_ranks(3, sweep_worker, WIRES, (3, 40000), TENSOR_DTYPES[:1],
                          env={"RINGREDUCE_SLICE_BYTES": "1024"}))


def async_worker(rank, world):
    ts = [wide_input(rank, 10000 + k, torch.float32, seed=k) for k in range(4)]
    works = [rr.all_reduce(t, async_op=True, wire_dtype=torch.bfloat16) for t in ts]
    for w in works:
        w.wait()
    ok = [torch.equal(bits(t), bits(wire_reference(
        [wide_input(r, 10000 + k, torch.float32, seed=k) for r in range(world)], torch.bfloat16,
        SUM))) for k, t in enumerate(ts)]
    # The plain path still works on the same communicator, after wire calls.
    x = torch.full((100,), float(rank + 1))
    rr.all_reduce(x)
    return ok, x[0].item()


def test_wire_async_and_plain_calls_between():
    for ok, total in run_ranks(2, async_worker):
        assert ok == [True] * 4 and total == 3.0


def overflow_worker(rank, world, device="cpu"):
    dev = on(device, rank)
    t = torch.ones(1000, device=dev)
    if rank == 1:
        t[999] = 70000.0  # beyond float16's 65504
    errors = []
    try:
        rr.all_reduce(t, wire_dtype=torch.float16)
    except OverflowError as e:  # a synchronous call: Python's error for a value out of range
        errors.append(str(e))
    # A sum beyond the range: every input fits. Asynchronous: the Work's error.
    s = torch.full((300,), 40000.0, device=dev)
    try:
        rr.all_reduce(s, wire_dtype=torch.float16, async_op=True).wait()
    except rr.RingReduceError as e:
        errors.append(str(e))
    # AVG of the same fits; and the communicator still works.
    a = torch.full((300,), 40000.0, device=dev)
    rr.all_reduce(a, op=AVG, wire_dtype=torch.float16)
    result = errors, a[0].item(), bool(torch.isinf(s).all())
    done(device)
    return result


def test_fp16_wire_overflow_raises_on_every_rank():
    for errors, avg, inf in run_ranks(3, overflow_worker):
        assert len(errors) == 2 and all("65504" in e for e in errors), errors
        assert avg == 40000.0 and inf


def mismatch_worker(rank, world):
    t = torch.ones(5000)
    try:
        rr.all_reduce(t, wire_dtype=torch.bfloat16 if rank == 0 else None)
    except rr.RingReduceError as e:
        return str(e)
    return "no error"


def test_wire_mismatch_names_both_calls():
    env = {"RINGREDUCE_TIMEOUT": "20", "RINGREDUCE_ALGO": "twoshot"}
    for msg in run_ranks(2, mismatch_worker, env=env, timeout=120):
        assert "wire_dtype=bfloat16" in msg and "mismatched" in msg, msg


def bad_args_worker(rank, world):
    msgs = []
    for call in (lambda: rr.all_reduce(torch.ones(4, dtype=torch.int32), wire_dtype=torch.bfloat16),
                 lambda: rr.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX, wire_dtype=torch.bfloat16),
                 lambda: rr.all_reduce(torch.ones(4), wire_dtype=torch.int8),
                 lambda: rr.all_reduce(torch.ones(4, dtype=torch.float64), wire_dtype=torch.float16),
                 lambda: rr.reduce_scatter_tensor(torch.ones(2), torch.ones(4),
                                                  op=dist.ReduceOp.PRODUCT,
                                                  wire_dtype=torch.float8_e4m3fn)):
        try:
            call()
            msgs.append("no error")
        except (TypeError, ValueError) as e:
            msgs.append(f"{type(e).__name__}: {e}")
    # Nothing was sent: a correct call after the bad ones pairs up.
    t = torch.ones(10)
    rr.all_reduce(t, wire_dtype=torch.bfloat16)
    return msgs, t[0].item()


def test_wire_bad_arguments():
    for msgs, v in run_ranks(2, bad_args_worker):
        assert v == 2.0
        assert msgs[0].startswith("TypeError") and "tensor is torch.int32" in msgs[0]
        assert msgs[1].startswith("ValueError") and "SUM or AVG" in msgs[1] and "MAX" in msgs[1]
        assert msgs[2].startswith("ValueError") and "torch.int8" in msgs[2]
        assert msgs[3].startswith("TypeError") and "float64" in msgs[3]
        assert msgs[4].startswith("ValueError") and "PRODUCT" in msgs[4]


def bound_worker(rank, world, numel):
    """Largest error of the bf16 wire against the float64 sum, in units of the sum's bf16 ulp."""
    ins = [wide_input(r, numel, torch.float32, seed=7) for r in range(world)]
    t = ins[rank].clone()
    rr.all_reduce(t, wire_dtype=torch.bfloat16)
    exact = sum(x.double() for x in ins)
    # The definition's bound: each input rounded once (half an ulp of itself), the sum once.
    half_ulp = lambda x: 2.0 ** (torch.frexp(x.abs().double().clamp_min(1e-38))[1] - 9).double()
    bound = sum(half_ulp(x) for x in ins) + half_ulp(exact) + \
        world * 2.0 ** -24 * sum(x.double().abs() for x in ins)  # the float32 additions
    return float(((t.double() - exact).abs() / bound).max())


@pytest.mark.parametrize("world", [2, 5])
def test_bf16_wire_error_within_two_roundings(world):
    for worst in run_ranks(world, bound_worker, 20000):
        assert worst <= 1.0, worst


def exact_inputs_worker(rank, world, numel):
    """Inputs already bfloat16 (nothing lost onto the wire): the result is the exact sum rounded
    once. Magnitudes in [0.25, 64): every input is a multiple of 2^-9 and every sum below 2^9, so
    the float32 fold (18 bits) is exact and the one rounding is the sum's."""
    def make(r):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(50 + r))
        return (x.sign() * (0.25 + (x.abs() * 8).clamp(max=63))).to(torch.bfloat16).float()
    ins = [make(r) for r in range(world)]
    t = ins[rank].clone()
    rr.all_reduce(t, wire_dtype=torch.bfloat16)
    exact = sum(x.double() for x in ins)
    return torch.equal(t, exact.to(torch.bfloat16).float())


def test_bf16_wire_of_bf16_values_is_the_correctly_rounded_sum():
    assert run_ranks(6, exact_inputs_worker, 30000) == [True] * 6


def _grads_of_every_rank(world, model_fn, seed):
    """Each rank's local gradients (a list per rank, parameter order) of one batch, computed here."""
    out = []
    for r in range(world):
        torch.manual_seed(seed)
        net = model_fn()
        g = torch.Generator().manual_seed(100 + r)
        net(torch.randn(16, 50, generator=g)).square().mean().backward()
        out.append([p.grad.clone() for p in net.parameters()])
    return out


def _net():
    return torch.nn.Sequential(torch.nn.Linear(50, 70), torch.nn.Tanh(), torch.nn.Linear(70, 3))


def hooks_worker(rank, world):
    """DDP with bf16_wire_hook and GradientBucketer(wire_dtype=bf16): each parameter's gradient is
    the wire reference of the ranks' gradients (bf16 rounds element by element, so bucket layout
    does not matter); fp8: within its rounding of the float64 average; error feedback: the
    residual is what the wire lost of this rank's gradient."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    local = _grads_of_every_rank(world, _net, seed=3)
    expect = [wire_reference([local[r][i] for r in range(world)], torch.bfloat16, AVG)
              for i in range(len(local[0]))]
    exact = [sum(local[r][i].double() for r in range(world)) / world for i in range(len(local[0]))]
    results = {}
    for name, hook, state in (("bf16", rr.ddp.bf16_wire_hook, None),
                              ("fp8", rr.ddp.fp8_wire_hook, None),
                              ("fp8-ef", rr.ddp.fp8_wire_hook, "ef")):
        torch.manual_seed(3)
        model = DDP(_net())
        if state == "ef":
            state = rr.ddp.WireState(None, error_feedback=True, params=model.module.parameters())
        model.register_comm_hook(state, hook)
        g = torch.Generator().manual_seed(100 + rank)
        model(torch.randn(16, 50, generator=g)).square().mean().backward()
        grads = [p.grad for p in model.parameters()]
        if name == "bf16":
            results[name] = all(torch.equal(bits(a), bits(b)) for a, b in zip(grads, expect))
        else:
            results[name] = max(float(((a.double() - e).abs() / e.abs().max()).max())
                                for a, e in zip(grads, exact))
        if state is not None:
            saved = state.state_dict()["residuals"]
            # The residual of parameter i is local grad - its wire rounding: nonzero, small.
            results["ef-residuals"] = sorted(saved) == list(range(len(grads))) and all(
                0 < float(saved[i].abs().max()) < 0.1 * float(local[rank][i].abs().max())
                for i in saved)
    torch.manual_seed(3)
    net = _net()
    bucketer = rr.GradientBucketer(net.parameters(), bucket_cap_mb=0.01, wire_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(100 + rank)
    net(torch.randn(16, 50, generator=g)).square().mean().backward()
    bucketer.wait()
    results["bucketer"] = all(torch.equal(bits(p.grad), bits(e))
                              for p, e in zip(net.parameters(), expect))
    return results


def test_wire_hooks_and_bucketer():
    for res in run_ranks(3, hooks_worker):
        assert res["bf16"] and res["bucketer"] and res["ef-residuals"], res
        # e4m3: 3 mantissa bits, two roundings relative to each block's largest value.
        assert 0 < res["fp8"] < 0.08 and 0 < res["fp8-ef"] < 0.08, res


# -- CUDA tensors: the symmetric workspace's wire kernel (csrc/cuda/p2p/sym_wire.cu) -------------------
# The same bits as on the CPU (the inputs have no inf or nan: a GPU's NaN bits are its own). Run where a GPU is lent (tests/gpu_suite.sh, benchmarks/gpu_lease.sh);
# the ranks of a one-GPU machine share it. CI runs the kernel on the emulated device
# (tests/native/test_p2p_wire.cpp: test_wire, test_wire_overflow, weak_wire).
P2P = {"RINGREDUCE_TRANSPORT": "p2p"}
# One-shot and two-shot forced, in pieces of 8 KiB (many barriers and both halves per call).
CUDA_WIRE_ENVS = {"auto": P2P, **{algo: {**P2P, "RINGREDUCE_CUDA_ALGO": algo,
                                          "RINGREDUCE_CUDA_CHUNK_BYTES": "8192"}
                                   for algo in ("oneshot", "twoshot")}}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("env", list(CUDA_WIRE_ENVS))
@pytest.mark.parametrize("world", [1, 2, 3])
def test_wire_on_cuda_bits(world, env):
    check_sweep(run_ranks(world, sweep_worker, WIRES, (1, 129, 1000, 70001), TENSOR_DTYPES, "cuda",
                          env=CUDA_WIRE_ENVS[env], timeout=600))


@pytest.mark.gpu
@needs_gpu
def test_fp16_wire_overflow_on_cuda():
    for errors, avg, inf in run_ranks(3, overflow_worker, "cuda", env=P2P):
        assert len(errors) == 2 and all("65504" in e for e in errors), errors
        assert avg == 40000.0 and inf


def nccl_wire_worker(rank, world):
    from test_cuda import setup_rank  # NCCL < 2.30 takes two ranks on one GPU only as two "hosts"
    dev = setup_rank(rank)
    try:
        rr.all_reduce(torch.ones(10, device=dev), wire_dtype=torch.bfloat16)
        msg = "no error"
    except NotImplementedError as e:
        msg = str(e)
    done("cuda")
    return msg


@pytest.mark.gpu
@needs_gpu
def test_wire_refused_on_nccl():
    # The first H200 run (NCCL 2.28.9) failed here with "Duplicate GPU detected" before the
    # refusal could be seen: the ranks now pose as hosts there, as test_cuda's do.
    for msg in run_ranks(2, nccl_wire_worker, env={"RINGREDUCE_TRANSPORT": "nccl"}):
        assert "p2p transport" in msg and "nccl" in msg, msg
