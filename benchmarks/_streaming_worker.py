"""Worker of benchmarks/streaming.py: small records through a streaming KeyedReduce (twisternet run).

Each worker sends M records ``(key, 1)`` (keys of 6 characters: ~16-byte messages) routed by key to every
worker, and consumes the running-sum updates of the keys it owns as they form. Prints the slowest
worker's rate and checks that every record produced exactly one update and the final sums are right.
"""

import json
import sys
import threading
import time

import twisternet as tn
from collectives import Barrier, KeyedReduce


def main() -> None:
    m, batch = int(sys.argv[1]), int(sys.argv[2])
    with tn.init(timeout=600) as ctx:
        keys = [f"k{(i * 7 + ctx.rank) % 5000:05d}" for i in range(m)]
        kr = KeyedReduce(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1, op="sum", key_type="str",
                         mode="streaming")
        task = ctx.my_tasks[0]
        final: dict[str, int] = {}
        updates = [0]

        def consume() -> None:
            for k, v in kr.results(task):
                updates[0] += 1
                final[k] = v
        Barrier(ctx, "start", ctx.world).enter(ctx.rank)
        th = threading.Thread(target=consume)
        th.start()
        t = time.perf_counter()
        if batch > 1:
            for i in range(0, m, batch):
                kr.send_many(task, [(k, 1) for k in keys[i:i + batch]])
        else:
            for k in keys:
                kr.send(task, k, 1)
        kr.finish(task)
        th.join()
        dt = time.perf_counter() - t
        rates = AllGatherRates(ctx, m / dt)
        if ctx.rank == 0:
            print("STREAM " + json.dumps({"min_rate": min(rates), "rates": rates}), flush=True)
        print("CHECK " + json.dumps({"rank": ctx.rank, "updates": updates[0], "sum": sum(final.values())}),
              flush=True)


def AllGatherRates(ctx, rate: float) -> list:  # a tiny helper, named for what it does
    from collectives import AllGather
    with AllGather(ctx, sources=ctx.tasks, edge=2) as ag:
        ag.send(ctx.my_tasks[0], rate)
        ag.finish(ctx.my_tasks[0])
        return [v for _, v in ag.results()]


if __name__ == "__main__":
    main()
