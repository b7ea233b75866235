"""Peer of benchmarks/streaming.py: the same records as per-message pickled mpi4py isend / recv.

Each rank sends its M records ``(key, 1)`` to the rank that owns the key (by a stable hash, one message
each, lowercase pickled isend) and receives and sums the records addressed to it, in one loop that
polls for incoming messages between sends. Prints the slowest rank's messages per second.
"""

import json
import sys
import time
import zlib

from mpi4py import MPI


def main() -> None:
    m = int(sys.argv[1])
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    keys = [f"k{(i * 7 + rank) % 5000:05d}" for i in range(m)]
    owner = [zlib.crc32(k.encode()) % world for k in keys]
    # how many records each rank will receive: everyone's counts, exchanged up front
    mine = [0] * world
    for o in owner:
        mine[o] += 1
    expect = sum(comm.alltoall(mine))
    sums: dict[str, int] = {}
    got = 0
    comm.Barrier()
    t = time.perf_counter()
    reqs = []
    status = MPI.Status()
    for k, o in zip(keys, owner):
        if o == rank:
            sums[k] = sums.get(k, 0) + 1
            got += 1
        else:
            reqs.append(comm.isend((k, 1), dest=o, tag=7))
        while comm.iprobe(source=MPI.ANY_SOURCE, tag=7, status=status):
            kk, v = comm.recv(source=status.Get_source(), tag=7)
            sums[kk] = sums.get(kk, 0) + v
            got += 1
    while got < expect:
        kk, v = comm.recv(source=MPI.ANY_SOURCE, tag=7)
        sums[kk] = sums.get(kk, 0) + v
        got += 1
    MPI.Request.Waitall(reqs)
    dt = time.perf_counter() - t
    rates = comm.gather(m / dt, root=0)
    total = comm.reduce(sum(sums.values()), root=0)
    if rank == 0:
        print("STREAM " + json.dumps({"min_rate": min(rates), "rates": rates, "total": total}), flush=True)


if __name__ == "__main__":
    main()
