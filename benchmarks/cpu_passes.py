"""Where the bytes go in a CPU all_reduce at world 2: each algorithm's passes over memory, timed
one pass at a time on this machine, against the measured call (docs/cpu-passes.md explains).

    python benchmarks/cpu_passes.py [--sizes 1M,4M,16M] [--bench bench.json]

Two processes, one per core as the ranks of an all_reduce run, time the three kinds of pass a
call is made of, on half the tensor each (a rank's chunk at world 2), at the same moment:
  copy  memcpy of the chunk into another buffer (a slot, a copy-out): read 1, write 1
  fold  a += b over the chunk (the reduction, in place): read 2, write 1
  cma   process_vm_readv of the chunk from the other process (Open MPI's single copy; our cma)
Each algorithm's time is then modelled as the sum of its passes (PASSES below, counted from
csrc/shm/protocol.cpp; Open MPI 4.1.4's from its source: Rabenseifner's reduce-scatter and
all-gather, each message one process_vm_readv). With --bench (a `ringreduce.bench --json` run at
world 2 with the forced algorithms and mpi/openmpi), the measured in-place medians print beside
the model. Medians of 15 timed repetitions after 3 warm-ups; sizes in bytes of the whole tensor.
"""
import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNITS = {"K": 1 << 10, "M": 1 << 20}

# Passes of half the tensor per rank at world 2, in place (counts from the code; see the docs page).
PASSES = {
    "ring": {"copy": 3, "fold": 1},      # put own half; fold; put the result; copy the peer's out
    "twoshot": {"copy": 3, "fold": 1},   # the same copies at world 2, in wide messages
    "oneshot": {"copy": 2, "fold": 2},   # put the whole tensor; fold the whole tensor
    "cma": {"cma": 2, "fold": 1},        # read the peer's half; fold; read the peer's result
    "openmpi": {"cma": 2, "fold": 1},    # the same passes; its receive buffer is a fresh malloc
    "pool": {"fold": 1, "copy": 1},      # rr.shared_empty: fold in the shared tensors; write the peer's copy
}


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def parse_size(text):
    t = text.strip().upper().rstrip("B").rstrip("I")
    return int(float(t[:-1]) * UNITS[t[-1]]) if t[-1] in UNITS else int(t)


def timed(fn, reps=15, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def rank(r, half, barrier, addrs, out):
    import torch
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[r % len(os.sched_getaffinity(0))]})
    n = half // 4
    a, b, dst = torch.ones(n), torch.ones(n), torch.empty(n)
    addrs[r] = a.data_ptr()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.process_vm_readv.restype = ctypes.c_ssize_t
    barrier.wait()
    peer_pid, peer_addr = out[f"pid{1 - r}"], addrs[1 - r]

    def cma():
        local, remote = IoVec(dst.data_ptr(), half), IoVec(peer_addr, half)
        got = libc.process_vm_readv(peer_pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got != half:
            raise OSError(ctypes.get_errno(), "process_vm_readv")

    res = {}
    for name, fn in (("copy", lambda: dst.copy_(a)), ("fold", lambda: a.add_(b)), ("cma", cma)):
        barrier.wait()  # both ranks on the same pass at the same time, as in a call
        res[name] = timed(fn)
    barrier.wait()
    out[f"res{r}"] = res


def measure(size):
    ctx = mp.get_context("fork")
    with ctx.Manager() as m:
        barrier, addrs, out = m.Barrier(2), m.dict(), m.dict()
        procs = [ctx.Process(target=rank, args=(r, size // 2, barrier, addrs, out)) for r in range(2)]
        for p in procs:
            p.start()
        for r, p in enumerate(procs):
            out[f"pid{r}"] = p.pid
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit("cpu_passes.py: a rank failed (process_vm_readv needs ptrace permission)")
        return {k: max(out["res0"][k], out["res1"][k]) for k in out["res0"]}  # the slower rank


def measured_calls(path):
    with open(path) as f:
        doc = json.load(f)
    t = {}
    for run in doc["runs"]:
        for row in run["rows"]:
            if row["collective"] == "all_reduce" and row["inplace"] and row["nranks"] == 2:
                name = row["backend"].split("/")[-1].replace("shm", "auto")
                t[(name, int(row["size_bytes"]))] = row["time_us"]
    return t


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1M,4M,16M")
    p.add_argument("--bench", metavar="JSON", help="a ringreduce.bench --json run at world 2")
    a = p.parse_args(argv)
    calls = measured_calls(a.bench) if a.bench else {}
    print("# one pass over half the tensor, both ranks at once, slower rank's median, us (GB/s of the half)")
    print(f"# {'size':>8} {'copy':>14} {'fold':>14} {'cma':>14}")
    models = {}
    for size in (parse_size(s) for s in a.sizes.split(",")):
        t = measure(size)
        half = size / 2
        print(f"  {size >> 10:>6}K " + " ".join(f"{t[k]:8.1f} ({half / t[k] / 1e3:4.1f})" for k in ("copy", "fold", "cma")))
        models[size] = {alg: sum(n * t[k] for k, n in ps.items()) for alg, ps in PASSES.items()}
    print("\n# the model (sum of the passes) and, with --bench, the measured call, in place, us")
    print(f"# {'algorithm':<9} {'passes':<16} " + " ".join(f"{s >> 10:>14}K" for s in models))
    for alg, ps in PASSES.items():
        cells = []
        for s, m in models.items():
            got = calls.get((alg, s)) or (calls.get(("openmpi", s)) if alg == "openmpi" else None)
            cells.append(f"{m[alg]:7.0f}" + (f" / {got:6.0f}" if got else " " * 9))
        print(f"  {alg:<9} {'+'.join(f'{n} {k}' for k, n in ps.items()):<16} " + " ".join(cells))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
