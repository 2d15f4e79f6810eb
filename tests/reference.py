"""Inputs from seeds and float64/exact references for the collective tests."""
import hashlib

import torch
import torch.distributed as dist

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.uint8, torch.int32, torch.int64)
DTYPES = FLOATS + INTS
OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MIN, dist.ReduceOp.MAX,
       dist.ReduceOp.PRODUCT)
EPS = {torch.float32: 2.0 ** -23, torch.float64: 2.0 ** -52, torch.float16: 2.0 ** -10,
       torch.bfloat16: 2.0 ** -7}


def make_input(rank, numel, dtype, op, seed=0):
    """Rank's data, deterministic in (seed, rank). Products stay bounded: values near 1."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if dtype in FLOATS:
        if op == dist.ReduceOp.PRODUCT:
            x = torch.rand(numel, generator=g, dtype=torch.float64) + 0.5
        else:
            x = torch.randn(numel, generator=g, dtype=torch.float64)
        return x.to(dtype)
    lo, hi = (-3, 4) if dtype != torch.uint8 else (0, 7)
    if op != dist.ReduceOp.PRODUCT and dtype in (torch.int32, torch.int64):
        lo, hi = -1000, 1000
    if op != dist.ReduceOp.PRODUCT and dtype in (torch.int8, torch.uint8):
        lo, hi = (-100, 100) if dtype == torch.int8 else (0, 200)  # sums wrap: tested
    return torch.randint(lo, hi, (numel,), generator=g, dtype=torch.int64).to(dtype)


def reduce_reference(inputs, op):
    """(expected, tolerance tensor) for reducing the ranks' inputs (all the same dtype)."""
    dtype, n = inputs[0].dtype, len(inputs)
    if dtype in INTS:
        xs = [x.to(torch.int64) for x in inputs]
        acc = xs[0].clone()
        for x in xs[1:]:
            if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
                acc = acc + x
            elif op == dist.ReduceOp.PRODUCT:
                acc = acc * x
            elif op == dist.ReduceOp.MIN:
                acc = torch.minimum(acc, x)
            else:
                acc = torch.maximum(acc, x)
        acc = acc.to(dtype)  # wraps like the ring does
        if op == dist.ReduceOp.AVG:
            acc = torch.div(acc.to(torch.int64), n, rounding_mode="trunc").to(dtype)
        return acc, None
    xs = [x.to(torch.float64) for x in inputs]
    eps = EPS[dtype]
    if op in (dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        f = torch.minimum if op == dist.ReduceOp.MIN else torch.maximum
        acc = xs[0]
        for x in xs[1:]:
            acc = f(acc, x)
        return acc, torch.zeros_like(acc)
    if op == dist.ReduceOp.PRODUCT:
        acc = xs[0].clone()
        for x in xs[1:]:
            acc = acc * x
        return acc, 2 * n * eps * acc.abs()
    acc = sum(xs)
    mag = sum(x.abs() for x in xs)
    if op == dist.ReduceOp.AVG:
        acc, mag = acc / n, mag / n
    # n - 1 roundings of partial sums plus the final one, each at most eps * magnitude
    return acc, 2 * n * eps * mag + 1e-300


def check_close(got, expected, tol):
    """Number of elements outside tolerance (exact for integers)."""
    if tol is None:
        return int((got != expected).sum())
    diff = (got.to(torch.float64) - expected).abs()
    return int((diff > tol).sum())


def digest(t):
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


# -- narrow wire (rr.all_reduce(..., wire_dtype=)): the definition, in plain torch ---------------
WIRE_BLOCK = 128
WIRE_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FLT_MAX = torch.finfo(torch.float32).max


def wire_round(x, wire):
    """x (float32) rounded onto the wire and back: bf16/fp16 by a cast; fp8 in blocks of 128
    elements from x[0], each with scale = absmax / max and q = x * (max / absmax) cast to fp8
    (round to nearest even); a block that is all zeros (or too small to scale) is zeros, one with
    inf or nan is nan."""
    x = x.reshape(-1).to(torch.float32)
    if wire in (torch.bfloat16, torch.float16):
        return x.to(wire).to(torch.float32)
    n = x.numel()
    fmax = torch.tensor(WIRE_MAX[wire], dtype=torch.float32)
    xb = torch.cat([x, x.new_zeros((-n) % WIRE_BLOCK)]).view(-1, WIRE_BLOCK)
    amax = xb.abs().amax(dim=1, keepdim=True)
    inv, scale = fmax / amax, amax / fmax
    bad, tiny = ~(amax <= _FLT_MAX), ~(inv <= _FLT_MAX)
    zero = torch.zeros_like(inv)
    inv = torch.where(bad | tiny, zero, inv)
    scale = torch.where(bad, torch.full_like(scale, float("nan")), torch.where(tiny, zero, scale))
    q = (xb * inv).to(wire).to(torch.float32)
    return (q * scale).reshape(-1)[:n]


def wire_fold(rows, wire, op, round_result):
    """The rank-order float32 fold of the rows, each rounded onto the wire first; AVG divides by
    the row count; round_result rounds the sum onto the wire once more."""
    acc = wire_round(rows[0], wire).clone()
    for x in rows[1:]:
        acc = acc + wire_round(x, wire)
    if op == dist.ReduceOp.AVG:
        acc = acc / len(rows)
    return wire_round(acc, wire) if round_result else acc


def wire_reference(inputs, wire, op):
    """What every rank's tensor holds after all_reduce(..., op, wire_dtype=wire)."""
    return wire_fold(inputs, wire, op, True).to(inputs[0].dtype).reshape(inputs[0].shape)


def host_partials(inputs, hosts):
    """Each host's partial sum of its ranks' inputs, in host order (first appearance), as the
    shared-memory transport computes it inside a host: float32 accumulation rounded to the
    inputs' dtype. Exact for hosts of at most two ranks (one addition, in either order)."""
    order = list(dict.fromkeys(hosts))
    out = []
    for h in order:
        acc = None
        for x, hx in zip(inputs, hosts):
            if hx == h:
                acc = x.to(torch.float32) if acc is None else acc + x.to(torch.float32)
        out.append(acc.to(inputs[0].dtype))
    return out


def _host_rows(inputs, hosts, op):
    """The host partial sums as they go onto the wire: AVG divides each by the number of ranks
    first (in the inputs' dtype), so that the wire carries the average's range."""
    rows = host_partials(inputs, hosts)
    if op == dist.ReduceOp.AVG:
        rows = [p / len(inputs) for p in rows]
    return rows


def wire_hosts_reference(inputs, hosts, wire, op):
    """all_reduce(..., wire_dtype=wire) on a group across hosts (not deterministic mode): each
    host's partial sum (AVG: divided by the number of ranks) rounded onto the wire once, folded
    in host order in float32, rounded once more."""
    rows = _host_rows(inputs, hosts, op)
    return (wire_fold(rows, wire, dist.ReduceOp.SUM, True).to(inputs[0].dtype)
            .reshape(inputs[0].shape))


def wire_hosts_scatter_reference(inputs, hosts, wire, op, rank):
    """reduce_scatter_tensor(..., wire_dtype=wire) on a two-level group: rank's chunk of the host
    partial sums (blocks from the chunk's start), folded as wire_hosts_reference, not rounded."""
    m = inputs[0].numel() // len(inputs)
    rows = [p.reshape(-1)[rank * m:(rank + 1) * m] for p in _host_rows(inputs, hosts, op)]
    return wire_fold(rows, wire, dist.ReduceOp.SUM, False).to(inputs[0].dtype)


def wire_scatter_reference(inputs, wire, op, rank):
    """Rank's output of reduce_scatter_tensor(..., op, wire_dtype=wire): its chunk of the float32
    fold (blocks of 128 from the chunk's start), rounded to the input dtype."""
    m = inputs[0].numel() // len(inputs)
    rows = [x.reshape(-1)[rank * m:(rank + 1) * m] for x in inputs]
    return wire_fold(rows, wire, op, False).to(inputs[0].dtype)
