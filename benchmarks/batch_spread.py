"""How one all-reduce's time spreads over seconds: the suite reports a median of ten batches, this
keeps every batch (docs/benchmark-log.md, B14). float32 SUM in place, one process per rank.

    OMP_NUM_THREADS=1 python benchmarks/batch_spread.py --bytes 1M --world 2 --calls 50 --seconds 5

Prints rank 0's batches: their number, median, deciles (us per call), and how many took more than
twice the median. Environment variables (RINGREDUCE_STREAM, RINGREDUCE_ALGO, ...) reach the ranks.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from dist_utils import run_ranks  # noqa: E402


def size(text):
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def worker(rank, world, nbytes, calls, batches):
    import torch
    import ringreduce as rr
    t = torch.ones(max(1, nbytes // 4))
    for _ in range(3):
        rr.all_reduce(t)
    out = []
    for _ in range(batches):  # a count, not a clock: every rank stops after the same call
        s = time.perf_counter()
        for _ in range(calls):
            rr.all_reduce(t)
        out.append((time.perf_counter() - s) / calls * 1e6)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bytes", type=size, default=1 << 20)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--calls", type=int, default=50, help="calls per batch")
    p.add_argument("--seconds", type=float, default=5.0, help="about this long (from a first batch)")
    args = p.parse_args()
    first = run_ranks(args.world, worker, args.bytes, args.calls, 1, timeout=600)[0][0]
    batches = max(10, int(args.seconds * 1e6 / (first * args.calls)))
    times = run_ranks(args.world, worker, args.bytes, args.calls, batches, timeout=600)[0]
    med = statistics.median(times)
    deciles = " ".join(f"{x:.0f}" for x in statistics.quantiles(times, n=10))
    slow = sum(x > 2 * med for x in times)
    print(f"{args.bytes} B, world {args.world}: {len(times)} batches of {args.calls} calls, "
          f"median {med:.1f} us, deciles {deciles}, {slow} batches above 2x the median")
    return 0


if __name__ == "__main__":
    sys.exit(main())
