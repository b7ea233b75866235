"""Worker of benchmarks/sort.py: a terasort with a batch KeyedGather and a range partitioner.

    twisternet run -n W benchmarks/_sort_worker.py TOTAL_RECORDS MEMORY_LIMIT_BYTES

Each worker generates its share (not timed), then, from a common start, sends its records to the
destination owning each key's range and reads its destination's records back in key order, summarizing
them (count, checksum, order, first and last key) as it goes; the time is this worker's, from the start
to its last record read. Prints one ``SORT {json}`` line per worker.

``SORT_PROFILE=PATH`` in the environment: rank 0 runs the timed part under cProfile and writes the
stats to PATH (``python -m pstats PATH``); its time then includes the profiler's overhead.
"""

import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import twisternet as tn
from collectives import Barrier, KeyedGather

from _sort_data import generate, range_destination, summarize


def main() -> None:
    total, memory = int(sys.argv[1]), int(sys.argv[2])
    with tn.init(timeout=1800, memory_limit=memory) as ctx:
        records = generate(ctx.rank, ctx.world, total)
        # The input lives through the whole sort: move it out of the collector's way (a full
        # collection would rescan its ~5M tuples each time; the usual move for long-lived data).
        gc.collect()
        gc.freeze()
        sort = KeyedGather(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1, key_type="bytes",
                           selector=range_destination, group=False, mode="batch")
        task = ctx.my_tasks[0]
        profile_to = os.environ.get("SORT_PROFILE") if ctx.rank == 0 else None
        prof = None
        if profile_to:
            import cProfile
            prof = cProfile.Profile()
        Barrier(ctx, "start", ctx.world).enter(ctx.rank)
        t0, c0 = time.perf_counter(), time.process_time()
        if prof is not None:
            prof.enable()
        sort.send_many(task, records, copy=False)     # the input is not changed afterwards
        sort.finish(task)
        summary = summarize(sort.results(task))
        if prof is not None:
            prof.disable()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        if prof is not None:
            prof.dump_stats(profile_to)
        summary.update(rank=ctx.rank, seconds=elapsed, cpu_s=cpu, spilled_bytes=sort.spilled_bytes)
        print("SORT " + json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
