"""Worker of benchmarks/wordcount.py (and of the cluster suite's word count): batch KeyedReduce word count
over generated Zipf text.

    _wordcount_worker.py WORDS                      (benchmarks/wordcount.py)
    _wordcount_worker.py WORDS TREES                (benchmarks/cluster.py: TREES "host" or "flat", the
                                                     reduce trees; also prints this host's eth0 bytes sent
                                                     during the reduce and this rank's distinct words)
"""

import gc
import json
import socket
import sys
import time
from collections import Counter
from pathlib import Path

import twisternet as tn
from collectives import Barrier, KeyedReduce, routing

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from wordcount import generated_words


def tx_bytes() -> int:
    """Bytes this host's eth0 sent so far (the testbed's link; 0 without one)."""
    try:   # /proc/net/dev is per network namespace (/sys/class/net is the mounting process's)
        for line in Path("/proc/self/net/dev").read_text().splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == "eth0":
                return int(fields.split()[8])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def main() -> None:
    total = int(sys.argv[1])
    trees = sys.argv[2] if len(sys.argv) > 2 else None
    if trees is not None:
        routing.HOST_TREES = trees == "host"
    with tn.init(timeout=900) as ctx:
        words = generated_words(ctx.rank, ctx.world, total)   # this worker's share of the input
        gc.collect()   # the input's first full collection is not part of counting (as for the baseline)
        counts = KeyedReduce(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1, op="sum",
                             key_type="str", mode="batch")
        task = ctx.my_tasks[0]
        Barrier(ctx, "start", ctx.world).enter(ctx.rank)   # every worker has its input: start together
        sent0 = tx_bytes()
        t0, c0 = time.perf_counter(), time.process_time()
        local = Counter(words)
        counts.send_many(task, local)   # map-side combine, then route and reduce by key
        counts.finish(task)
        mine = dict(counts.results(task))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        Barrier(ctx, "end", ctx.world).enter(ctx.rank)     # every key has reached its destination
        sent = tx_bytes() - sent0
        row = {"rank": ctx.rank, "seconds": elapsed, "cpu_s": cpu, "keys": len(mine), "words": sum(mine.values()),
               "counts": mine}
        if trees is not None:
            row = {"rank": ctx.rank, "host": socket.gethostname(), "seconds": elapsed, "cpu_s": cpu, "tx_bytes": sent,
                   "words": sum(mine.values()), "distinct": sorted(local), "counts": mine}
        print("WC " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
