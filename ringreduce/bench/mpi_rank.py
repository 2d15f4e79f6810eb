"""One rank of a benchmark run whose ranks mpirun starts (--backends mpi):
python -m ringreduce.bench.mpi_rank TMPDIR (the launcher writes TMPDIR/args.pkl)."""
import sys

from .launch import mpi_rank_main

if __name__ == "__main__":
    mpi_rank_main(sys.argv[1])
