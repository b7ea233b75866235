"""Worker of benchmarks/cluster.py: float32 allreduce timings on one rank of an emulated-cluster job.

    _cluster_worker.py tn VIA[@THRESHOLD] SIZES REPS  (twisternet, under `twisternet worker`; THRESHOLD:
                                                      the operation's ring_threshold in bytes)
    _cluster_worker.py mpi4py SIZES REPS              (MPICH through mpi4py, under mpiexec)
    _cluster_worker.py gloo SIZES REPS RANK WORLD ADDR:PORT   (torch.distributed, gloo backend)
    _cluster_worker.py rawtcp SIZES REPS RANK ADDR:PORT       (two processes, no library: a ping-pong of
                                                      plain sendall / recv_into over one TCP connection)

Every rank prints ``CLUSTER {"rank": r, "host": hostname, "median_s": {size: seconds}}``: the median
of REPS timed calls after one checked warm-up call, each call started after a barrier. For rawtcp a
call is one round trip of SIZE bytes each way, which the two ranks start in turn (so each times REPS).
"""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Callable

import numpy as np


def timed(sizes: list[int], reps: list[int], call: Callable[[np.ndarray, np.ndarray], None],
          barrier: Callable[[], None], world: int) -> dict[int, float]:
    out = {}
    for size, n in zip(sizes, reps):
        x = np.ones(size // 4, np.float32)
        y = np.empty_like(x)
        call(x, y)
        assert (y == world).all(), y[:4]
        times = []
        for _ in range(n):
            barrier()
            t = time.perf_counter()
            call(x, y)
            times.append(time.perf_counter() - t)
        out[size] = sorted(times)[len(times) // 2]
    return out


def raw_round_trips(sizes: list[int], reps: list[int], rank: int, addr: str) -> dict[int, float]:
    """The raw baseline of a small collective: the median round trip of a TCP ping-pong between rank 0
    (listening at ``addr``) and rank 1, started in turn by each (TCP_NODELAY, written payloads)."""
    from benchmarks._raw_sockets import _recv_exact     # (the testbed puts the repository on PYTHONPATH)
    host, _, port = addr.rpartition(":")
    if rank == 0:
        with socket.create_server((host, int(port))) as ls:
            ls.settimeout(120)
            s, _ = ls.accept()
    else:
        deadline = time.monotonic() + 120
        while True:
            try:
                s = socket.create_connection((host, int(port)), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    s.settimeout(None)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = {}
    with s:
        for size, n in zip(sizes, reps):
            data, buf = b"\x01" * size, memoryview(bytearray(size))
            times = []
            for i in range(2 * n + 2):          # a warm-up round trip each, then n each, in turn
                if i % 2 == rank:
                    t = time.perf_counter()
                    s.sendall(data)
                    _recv_exact(s, buf)
                    if i >= 2:
                        times.append(time.perf_counter() - t)
                else:
                    _recv_exact(s, buf)
                    s.sendall(buf)
            assert bytes(buf[:1]) == b"\x01"
            out[size] = sorted(times)[len(times) // 2]
    return out


def main() -> None:
    kind = sys.argv[1]
    if kind == "tn":
        import twisternet as tn
        from collectives import AllReduce
        via, sizes, reps = sys.argv[2], sys.argv[3], sys.argv[4]
        via, _, threshold = via.partition("@")
        extra = {"ring_threshold": int(threshold)} if threshold else {}
        with tn.init(timeout=900) as ctx:
            ar = AllReduce(ctx, edge=1, op="sum", via=via, **extra)
            # the barrier before each timed call: "auto" (hierarchical, recursive doubling between the
            # hosts) lets every rank out at about the same time; a tree's root and first children left
            # it hundreds of microseconds before the last leaf, and timed that skew into small calls
            bar = AllReduce(ctx, edge=2, op="sum", via="auto")
            one = np.ones(1, np.int64)
            rank, world = ctx.rank, ctx.world
            res = timed([int(s) for s in sizes.split(",")], [int(r) for r in reps.split(",")],
                        lambda x, y: ar.allreduce(x, out=y), lambda: bar.allreduce(one), world)
    elif kind == "mpi4py":
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, world = comm.rank, comm.size
        res = timed([int(s) for s in sys.argv[2].split(",")], [int(r) for r in sys.argv[3].split(",")],
                    lambda x, y: comm.Allreduce(x, y, op=MPI.SUM), comm.Barrier, world)
    elif kind == "gloo":
        import torch
        import torch.distributed as dist
        sizes, reps, rank, world, addr = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://{addr}", rank=rank, world_size=world)

        def call(x: np.ndarray, y: np.ndarray) -> None:
            t = torch.from_numpy(y)
            t.copy_(torch.from_numpy(x))
            dist.all_reduce(t)
        res = timed([int(s) for s in sizes.split(",")], [int(r) for r in reps.split(",")], call, dist.barrier,
                    world)
        dist.destroy_process_group()
    elif kind == "rawtcp":
        rank, addr = int(sys.argv[4]), sys.argv[5]
        res = raw_round_trips([int(s) for s in sys.argv[2].split(",")], [int(r) for r in sys.argv[3].split(",")],
                              rank, addr)
    else:
        raise SystemExit(f"unknown kind {kind!r}")
    print("CLUSTER " + json.dumps({"rank": rank, "host": socket.gethostname(), "median_s": res}), flush=True)


if __name__ == "__main__":
    main()
