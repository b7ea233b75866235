"""Peer of benchmarks/allreduce.py: mpi4py's Allreduce (MPICH wheel), run under mpiexec."""

import json
import sys
import time

import numpy as np
from mpi4py import MPI


def main() -> None:
    sizes = [int(x) for x in sys.argv[1].split(",")]
    reps = [int(x) for x in sys.argv[2].split(",")]
    comm = MPI.COMM_WORLD
    out = {}
    for size, n in zip(sizes, reps):
        x = np.ones(size // 4, np.float32)
        y = np.empty_like(x)
        comm.Allreduce(x, y, op=MPI.SUM)
        times = []
        for _ in range(n):
            comm.Barrier()
            t = time.perf_counter()
            comm.Allreduce(x, y, op=MPI.SUM)
            times.append(time.perf_counter() - t)
        out[size] = sorted(times)[len(times) // 2]
    if comm.rank == 0:
        print("ALLREDUCE " + json.dumps({"channel": "mpi4py", "median_s": out}), flush=True)


if __name__ == "__main__":
    main()
