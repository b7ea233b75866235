"""Worker of benchmarks/tables.py: gather / allgather / broadcast / partition of the records suite's data
(``id``, ``name``, ``score`` for N records per worker) as one Arrow table per worker, with send_table /
result_table; prints the slowest rank's seconds per op after ``TABLES``."""

import json
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from benchmarks._records_peer import expected


def table(rank: int, n: int) -> pa.Table:
    """The records suite's ``records(rank, n)`` as columns."""
    i = np.arange(n)
    names = pa.array([f"w{k}" for k in range(1000)]).take(pa.array(i % 1000))
    return pa.table({"id": rank * n + i, "name": names, "score": i * 0.5})


def main(n: int) -> None:
    import twisternet as tn
    from collectives import AllGather, AllReduce, Barrier, Broadcast, Gather, Partition
    from collectives.columnar import split_rows
    with tn.init(timeout=900, memory_limit=4 << 30) as ctx:
        rank, world, task = ctx.rank, ctx.world, ctx.my_tasks[0]
        mine = table(rank, n)
        slowest = AllReduce(ctx, edge=9, op="max")
        times, bad = {}, []
        for k, op in enumerate(("gather", "allgather", "broadcast", "partition")):
            Barrier(ctx, f"b{k}", world).enter(rank)
            t = time.perf_counter()
            got = None
            if op == "gather":
                g = Gather(ctx, sources=ctx.tasks, edge=10 + k)
                g.send_table(task, mine)
                g.finish(task)
                got = g.result_table() if rank == 0 else None
            elif op == "allgather":
                g = AllGather(ctx, sources=ctx.tasks, edge=10 + k)
                g.send_table(task, mine)
                g.finish(task)
                got = g.result_table()
            elif op == "broadcast":
                g = Broadcast(ctx, sources=[0], destinations=ctx.tasks, edge=10 + k)
                if rank == 0:
                    g.send_table(task, mine)
                    g.finish(task)
                got = g.result_table()
            else:
                g = Partition(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=10 + k)
                parts = split_rows(mine, (mine.column("id").to_numpy() % world).astype(np.int64), world)
                for d in range(world):
                    g.send_table(task, parts[d], destination=d)
                g.finish(task)
                got = g.result_table()
            dt = time.perf_counter() - t
            g.close()
            want = expected(op, rank, world, n)
            have = None if got is None else (got.num_rows, pc.sum(got.column("id")).as_py() or 0)
            if have != want:
                bad.append(op)
            times[op] = float(slowest.allreduce(np.array([dt]))[0])
        bad_all = AllGather(ctx, sources=ctx.tasks, edge=20)
        bad_all.send(task, bad)
        bad_all.finish(task)
        problems = [b for _, lst in bad_all.results() for b in lst]
        if rank == 0:
            print("TABLES " + json.dumps({"seconds": times, "bad": problems}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
