"""Deterministic inputs, their expected results in closed form, and the check of a result.

Rank r's element i is value(r, i), built from h = (7 i + 13 r + 3) mod 17:
  sum, avg, min, max: floats (h - 8) / 8 in [-1, 1]; signed integers h mod 5 - 2; uint8 h mod 4.
  prod: 2 where i mod N == r (exactly one rank per element), else -1 where h mod 3 == 0 (not for
        uint8), else 1; every product is +-2.
All values and partial results are exact in every dtype for the rank counts a benchmark uses (sums
of N multiples of 1/8 up to N; int8 sums up to 2N), so the expected result computed here in
float64/int64 is the exact answer and the tolerance only has to cover rounding order.
"""
import torch

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def is_float(dtype):
    return dtype in FLOATS


def value(rank, index, world, dtype, op):
    """value(r, i) as float64 (float dtypes) or int64; rank is an int or a tensor like index."""
    h = (index * 7 + rank * 13 + 3) % 17
    if op == "prod":
        owner = (index % world) == rank
        neg = (h % 3 == 0) & torch.tensor(dtype != torch.uint8, device=index.device)
        v = torch.where(owner, 2, torch.where(neg, -1, 1))
    elif is_float(dtype):
        v = (h - 8).double() / 8
    elif dtype == torch.uint8:
        v = h % 4
    else:
        v = h % 5 - 2
    return v.double() if is_float(dtype) else v.long()


def reduced(index, world, dtype, op):
    """The reduction over all ranks of value(r, index), exact, in float64 or int64."""
    acc = value(0, index, world, dtype, op)
    for r in range(1, world):
        v = value(r, index, world, dtype, op)
        if op in ("sum", "avg"):
            acc = acc + v
        elif op == "prod":
            acc = acc * v
        elif op == "min":
            acc = torch.minimum(acc, v)
        else:
            acc = torch.maximum(acc, v)
    if op == "avg":
        acc = acc / world if is_float(dtype) else torch.div(acc, world, rounding_mode="trunc")
    return acc


def sentinel(dtype):
    """A value no correct result holds: outputs are filled with it before every call."""
    if is_float(dtype):
        return -1.0e4
    return torch.iinfo(dtype).max if dtype == torch.uint8 else torch.iinfo(dtype).min


def tolerance(dtype, world):
    """Allowed |result - expected| for floats: N-1 roundings of partial sums of magnitude <= N
    (values <= 1), each off by at most eps/2 of it, plus one rounding of a final division (avg)."""
    return torch.finfo(dtype).eps * (world * (world - 1) / 2 + 1) if is_float(dtype) else 0


class Reference:
    """This rank's input and expected output for one collective and element count."""

    def __init__(self, collective, count, rank, world, dtype, op, device, check=True):
        chunk = count // world
        own = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        if collective == "all_gather":
            self.input = value(rank, own, world, dtype, op).to(dtype)
        else:
            self.input = value(rank, torch.arange(count, device=device), world, dtype, op).to(dtype)
        self.expected = None
        if check:
            if collective == "all_reduce":
                exp = reduced(torch.arange(count, device=device), world, dtype, op)
            elif collective == "reduce_scatter":
                exp = reduced(own, world, dtype, op)
            else:
                idx = torch.arange(count, device=device)
                exp = value(torch.div(idx, chunk, rounding_mode="floor"), idx, world, dtype, op)
            # Floats compare in float32 (float64 for double): the rounding of expected to float32 is
            # far below the tolerance. Integers compare exactly in their own dtype.
            cmp = torch.float64 if dtype == torch.float64 else torch.float32
            self.expected = exp.to(cmp if is_float(dtype) else dtype)
        self.tol = tolerance(dtype, world)
        self.float = is_float(dtype)

    def wrong(self, result, tol=None):
        """Number of elements of result outside the tolerance (NaN counts as wrong); tol: a
        backend's own (a narrow wire's rounding) instead of the dtype's."""
        if not self.float:
            return int(torch.count_nonzero(result != self.expected))
        diff = torch.sub(result, self.expected).abs_()  # promotes half/bf16 to float32
        return int(torch.count_nonzero(~(diff <= (self.tol if tol is None else tol))))

    def max_error(self, result):
        """The largest |result - exact| (the exact result in float64; nan if any is nan)."""
        if self.expected is None or result.numel() == 0:
            return 0.0
        diff = (result.double() - self.expected.double()).abs()
        return float("nan") if bool(diff.isnan().any()) else float(diff.max())
