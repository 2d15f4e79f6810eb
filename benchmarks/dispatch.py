"""The cost of one all-reduce call from Python when there is nothing to move: world 1, 4 KiB
float32, in place. What is left is dispatch (argument checks, finding the communicator, entering
native code). Median of --reps batches of --calls calls, us per call.

    OMP_NUM_THREADS=1 python benchmarks/dispatch.py

Rows: ringreduce.all_reduce (the fast path), the fast path's C function alone (each with the
flight recorder on, the default, and off: RINGREDUCE_TRACE_BUFFER=0), the full path
(a call the fast path does not take: every check, the communicator
lookup, the pybind11 call), torch.distributed.all_reduce
on Gloo, and mpi4py's Allreduce (singleton MPI, if mpi4py loads).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def per_call(fn, calls, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter_ns() - t0) / calls / 1000)
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--calls", type=int, default=50_000)
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args()
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    import ringreduce as rr
    from ringreduce import collectives
    t = torch.ones(1024)
    rr.all_reduce(t)  # the first call fills the fast path
    fast = collectives._fast[None][2]
    # The same on a group whose communicator has the flight recorder off (its size is read when
    # the communicator is made): the recorder's cost is the difference.
    # Both on groups of their own, passed the same way.
    on, off = dist.new_group([0]), dist.new_group([0])
    rr.all_reduce(t, group=on)
    os.environ["RINGREDUCE_TRACE_BUFFER"] = "0"
    rr.all_reduce(t, group=off)
    del os.environ["RINGREDUCE_TRACE_BUFFER"]
    assert not rr.get_communicator(off).recorder.on and rr.get_communicator(on).recorder.on
    fast_on, fast_off = collectives._fast[on][2], collectives._fast[off][2]
    op = dist.ReduceOp.SUM
    other_op = dist.ReduceOp(dist.ReduceOp.SUM)  # equal, not the same object: the full path
    rows = [
        ("ringreduce.all_reduce", lambda: rr.all_reduce(t)),
        ("  its C function alone", lambda: fast(t, op)),
        ("  on a group, flight recorder on", lambda: rr.all_reduce(t, group=on)),
        ("  on a group, flight recorder off", lambda: rr.all_reduce(t, group=off)),
        ("  C function, flight recorder on", lambda: fast_on(t, op)),
        ("  C function, flight recorder off", lambda: fast_off(t, op)),
        ("ringreduce full path (every check)", lambda: rr.all_reduce(t, other_op)),
        ("torch.distributed.all_reduce (Gloo)", lambda: dist.all_reduce(t)),
    ]
    try:
        from mpi4py import MPI
        buf = t.numpy()
        lib = " ".join(MPI.Get_library_version().splitlines()[0].split(",")[0].split())
        rows.append((f"mpi4py Allreduce ({lib})",
                     lambda: MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf)))
    except Exception as e:  # not installed, or no MPI library
        print(f"# mpi4py row skipped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
    print(f"# world 1, 4 KiB float32 in place, median of {a.reps} x {a.calls} calls; torch "
          f"{torch.__version__}, python {sys.version.split()[0]}")
    print(f"# {'call':<44}{'us/call':>10}")
    for name, fn in rows:
        calls = a.calls if "Gloo" not in name else max(1, a.calls // 20)
        print(f"  {name:<44}{per_call(fn, calls, a.reps):>10.2f}", flush=True)
    rr.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
