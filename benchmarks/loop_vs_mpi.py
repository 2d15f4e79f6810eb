"""rr.all_reduce vs MPI's Allreduce (mpi4py) back to back in the same processes, no barrier between
calls: the per-call floor of each, without the suite's per-iteration barrier (whose skew adds to
small sizes when ranks outnumber cores). Run under mpirun, e.g.:

  mpirun -n 4 --oversubscribe --bind-to none --allow-run-as-root python benchmarks/loop_vs_mpi.py

Prints, per size, the median over 9 batches of 200 in-place float32 SUM calls, slowest rank.
"""
import os
import time

import torch
import torch.distributed as dist
from mpi4py import MPI

import ringreduce as rr

SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)
CALLS, BATCHES = 200, 9


def per_call_us(comm, fn):
    for _ in range(CALLS):
        fn()
    times = []
    for _ in range(BATCHES):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        times.append((time.perf_counter() - t0) / CALLS * 1e6)
    return comm.allreduce(sorted(times)[BATCHES // 2], op=MPI.MAX)


def main():
    comm = MPI.COMM_WORLD
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29677")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    if comm.rank == 0:
        print(f"# world {comm.size}: size, MPI us, ringreduce us (in-place float32 SUM, per call)")
    for size in SIZES:
        t = torch.ones(size // 4)
        a = t.numpy()
        mpi = per_call_us(comm, lambda: comm.Allreduce(MPI.IN_PLACE, [a, MPI.FLOAT]))
        ours = per_call_us(comm, lambda: rr.all_reduce(t))
        if comm.rank == 0:
            print(f"{size:>9} {mpi:>9.1f} {ours:>9.1f}", flush=True)
    rr.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
