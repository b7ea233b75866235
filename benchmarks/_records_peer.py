"""Worker of benchmarks/records.py: gather / allgather / broadcast / partition of N small dict records per
rank, in one of three implementations, each op timed from a barrier to the Python objects in hand at
every destination (the slowest rank's time) and checked.

    twisternet run -n W _records_peer.py tn N        (twisternet collectives)
    mpiexec -n W python _records_peer.py mpi N       (mpi4py lowercase: pickle)
    python _records_peer.py torch N RANK WORLD PORT  (torch.distributed *_object on gloo), once per rank
"""

import json
import sys
import time


def records(rank: int, n: int) -> list:
    return [{"id": rank * n + i, "name": f"w{i % 1000}", "score": i * 0.5} for i in range(n)]


def id_sum(recs) -> int:
    return sum(r["id"] for r in recs)


def expected(op: str, rank: int, world: int, n: int) -> tuple[int, int] | None:
    """(count, sum of ids) a rank must hold after ``op`` (None: it holds nothing)."""
    everyone = (world * n, (world * n) * (world * n - 1) // 2)
    if op == "gather":
        return everyone if rank == 0 else None
    if op == "allgather":
        return everyone
    if op == "broadcast":
        return (n, n * (n - 1) // 2)
    ids = [i for i in range(world * n) if i % world == rank]        # partition: id % world == rank
    return (len(ids), sum(ids))


def run_tn(n: int) -> None:
    import numpy as np

    import twisternet as tn
    from collectives import AllGather, AllReduce, Barrier, Broadcast, Gather, Partition
    # Everything in memory, as for the peers (the default 256 MB bound would spill 1M records to disk).
    with tn.init(timeout=900, memory_limit=4 << 30) as ctx:
        rank, world, task = ctx.rank, ctx.world, ctx.my_tasks[0]
        mine = records(rank, n)
        slowest = AllReduce(ctx, edge=9, op="max")
        times, bad = {}, []
        for k, op in enumerate(("gather", "allgather", "broadcast", "partition")):
            Barrier(ctx, f"b{k}", world).enter(rank)
            t = time.perf_counter()
            got = None
            if op == "gather":
                g = Gather(ctx, sources=ctx.tasks, edge=10 + k)
                g.send_many(task, mine, copy=False)
                g.finish(task)
                got = list(g.values()) if rank == 0 else None
            elif op == "allgather":
                g = AllGather(ctx, sources=ctx.tasks, edge=10 + k)
                g.send_many(task, mine, copy=False)
                g.finish(task)
                got = list(g.values())
            elif op == "broadcast":
                g = Broadcast(ctx, sources=[0], destinations=ctx.tasks, edge=10 + k)
                if rank == 0:
                    g.send(task, mine, copy=False)
                    g.finish(task)
                got = next(iter(g.results()))
            else:
                g = Partition(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=10 + k)
                per = [[] for _ in range(world)]
                for r in mine:
                    per[r["id"] % world].append(r)
                for d in range(world):
                    g.send(task, per[d], destination=d, copy=False)
                g.finish(task)
                got = [r for lst in g.values() for r in lst]
            dt = time.perf_counter() - t
            g.close()
            want = expected(op, rank, world, n)
            if (want is None) != (got is None) or (got is not None and (len(got), id_sum(got)) != want):
                bad.append(op)
            times[op] = float(slowest.allreduce(np.array([dt]))[0])
        bad_all = AllGather(ctx, sources=ctx.tasks, edge=20)
        bad_all.send(task, bad)
        bad_all.finish(task)
        problems = [b for _, lst in bad_all.results() for b in lst]
        if rank == 0:
            print("RECORDS " + json.dumps({"seconds": times, "bad": problems}), flush=True)


def run_mpi(n: int) -> None:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    mine = records(rank, n)
    times, bad = {}, []
    for op in ("gather", "allgather", "broadcast", "partition"):
        comm.Barrier()
        t = time.perf_counter()
        if op == "gather":
            parts = comm.gather(mine, root=0)
            got = [r for p in parts for r in p] if rank == 0 else None
        elif op == "allgather":
            got = [r for p in comm.allgather(mine) for r in p]
        elif op == "broadcast":
            got = comm.bcast(mine if rank == 0 else None, root=0)
        else:
            per = [[] for _ in range(world)]
            for r in mine:
                per[r["id"] % world].append(r)
            got = [r for p in comm.alltoall(per) for r in p]
        dt = time.perf_counter() - t
        want = expected(op, rank, world, n)
        if (want is None) != (got is None) or (got is not None and (len(got), id_sum(got)) != want):
            bad.append(op)
        times[op] = comm.allreduce(dt, op=MPI.MAX)
    problems = comm.gather(bad, root=0)
    if rank == 0:
        print("RECORDS " + json.dumps({"seconds": times, "bad": [b for p in problems for b in p]}), flush=True)


def run_torch(n: int, rank: int, world: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    mine = records(rank, n)
    times, bad = {}, []
    for op in ("gather", "allgather", "broadcast"):          # torch has no all-to-all for objects
        dist.barrier()
        t = time.perf_counter()
        if op == "gather":
            parts = [None] * world if rank == 0 else None
            dist.gather_object(mine, parts, dst=0)
            got = [r for p in parts for r in p] if rank == 0 else None
        elif op == "allgather":
            parts = [None] * world
            dist.all_gather_object(parts, mine)
            got = [r for p in parts for r in p]
        else:
            box = [mine if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            got = box[0]
        dt = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
        want = expected(op, rank, world, n)
        if (want is None) != (got is None) or (got is not None and (len(got), id_sum(got)) != want):
            bad.append(op)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times[op] = float(dt[0])
    problems = [None] * world
    dist.all_gather_object(problems, bad)
    if rank == 0:
        print("RECORDS " + json.dumps({"seconds": times, "bad": [b for p in problems for b in p]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    kind, count = sys.argv[1], int(sys.argv[2])
    if kind == "tn":
        run_tn(count)
    elif kind == "mpi":
        run_mpi(count)
    else:
        run_torch(count, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
