"""Raw mpi4py baseline of benchmarks/p2p.py: Send/Recv into a reused buffer, run under mpiexec -n 2."""

import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from benchmarks._raw_sockets import pass_reps


def main() -> None:
    sizes = [int(x) for x in sys.argv[1].split(",")]
    budget = int(sys.argv[2])
    lat_sizes = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 and sys.argv[3] else []
    passes = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    comm = MPI.COMM_WORLD
    peer = 1 - comm.rank
    ack = np.zeros(1, np.uint8)
    out = {"bandwidth": {}, "latency": {}}
    for size in sizes:
        buf = np.ones(size, np.uint8)
        reps = pass_reps(size, budget, passes)
        comm.Barrier()
        if comm.rank == 0:
            comm.Send(buf, peer)
            comm.Recv(ack, peer)
            rates = []
            for _ in range(passes):     # the median of timed passes (see PASSES in benchmarks/p2p.py)
                t = time.perf_counter()
                for _ in range(reps):
                    comm.Send(buf, peer)
                comm.Recv(ack, peer)
                rates.append(reps * size / (time.perf_counter() - t))
            out["bandwidth"][size] = statistics.median(rates)
        else:
            comm.Recv(buf, peer)
            comm.Send(ack, peer)
            for _ in range(passes):
                for _ in range(reps):
                    comm.Recv(buf, peer)
                comm.Send(ack, peer)
    for size in lat_sizes:
        buf = np.ones(size, np.uint8)
        reps = max(20, min(2000, (64 << 20) // max(size, 1)))
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(reps):
            if comm.rank == 0:
                comm.Send(buf, peer)
                comm.Recv(buf, peer)
            else:
                comm.Recv(buf, peer)
                comm.Send(buf, peer)
        out["latency"][size] = (time.perf_counter() - t) / reps / 2
    if comm.rank == 0:
        print("P2P " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
