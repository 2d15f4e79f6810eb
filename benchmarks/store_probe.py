"""The machine's shared-memory transfer cost between two processes, without ringreduce
(docs/benchmark-log.md, B14): builds benchmarks/store_probe.c with the system C compiler and runs it
in fresh process pairs, alternating the ways of publishing data (copy into the same buffer as a
ring's slots do, non-temporal stores, a rotation over 64 buffers).

    python benchmarks/store_probe.py [--sizes 16K,128K,1M] [--trials 8] [--rounds 300]

Each trial is a new pair of processes; a cell lists the trials' medians (us) of the write of B
bytes into the shared buffer and of the read of the peer's B bytes, sorted by write time.
"""
import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("copy", "stream", "rotate")


def size(text):
    units = {"K": 1 << 10, "M": 1 << 20}
    text = text.strip().upper()
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def build(tmp):
    exe = os.path.join(tmp, "store_probe")
    cc = os.environ.get("CC", "cc")
    subprocess.run([cc, "-O2", "-o", exe, os.path.join(HERE, "store_probe.c")], check=True)
    return exe


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16K,128K,1M")
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--rounds", type=int, default=300)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        print(f"# {args.trials} fresh process pairs per cell, {args.rounds} rounds each; "
              "us per round: write / read, sorted by write")
        for nbytes in map(size, args.sizes.split(",")):
            runs = {m: [] for m in MODES}
            for _ in range(args.trials):
                for m in MODES:
                    out = subprocess.run([exe, str(nbytes), str(args.rounds), m], check=True,
                                         capture_output=True, text=True, timeout=120).stdout
                    runs[m].append(tuple(float(x) for x in out.split()))
            for m in MODES:
                cells = " ".join(f"{w:.1f}/{r:.1f}" for w, r in sorted(runs[m]))
                print(f"{nbytes:>9} {m:>7}  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
