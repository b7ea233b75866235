"""Worker of benchmarks/wordcount.py: batch KeyedReduce word count over generated Zipf text."""

import gc
import json
import sys
import time
from collections import Counter

import twisternet as tn
from collectives import Barrier, KeyedReduce

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "examples"))
from wordcount import generated_words  # noqa: E402


def main() -> None:
    total = int(sys.argv[1])
    with tn.init(timeout=900) as ctx:
        words = generated_words(ctx.rank, ctx.world, total)   # this worker's share of the input
        gc.collect()   # the input's first full collection is not part of counting (as for the baseline)
        counts = KeyedReduce(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1, op="sum",
                             key_type="str", mode="batch")
        task = ctx.my_tasks[0]
        Barrier(ctx, "start", ctx.world).enter(ctx.rank)   # every worker has its input: start together
        t0 = time.perf_counter()
        counts.send_many(task, Counter(words))   # map-side combine, then route and reduce by key
        counts.finish(task)
        mine = dict(counts.results(task))
        elapsed = time.perf_counter() - t0
        print("WC " + json.dumps({"rank": ctx.rank, "seconds": elapsed, "keys": len(mine),
                                  "words": sum(mine.values()), "counts": mine}), flush=True)


if __name__ == "__main__":
    main()
