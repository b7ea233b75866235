"""Worker of benchmarks/sort.py, columnar: the terasort as Arrow tables through KeyedGather's table path.

    twisternet run -n W benchmarks/_sort_arrow_worker.py TOTAL_RECORDS MEMORY_LIMIT_BYTES

Each worker generates its share as an Arrow table (``benchmarks/_sort_data.py``: the records the record
worker and the peers get; not timed). From a common start: an AllGather of a sample of every worker's
keys gives the range splitters, ``send_table`` routes the rows to the destination owning each key
range, and ``result_batches`` reads this destination's rows back in key order within ``memory_limit``
(sorted runs spilled as Arrow IPC files and merged), each batch summarized as it comes (count,
checksum, order, first and last key). The time is this worker's, from the start to its last batch
summarized. Prints one ``SORT {json}`` line per worker (``phases``: seconds of this worker's steps;
``start_rss_mb``: RSS at the start, its input table, ``input_mb``, included; ``peak_rss_mb``: peak
RSS from there to the end, on Linux).

``SORT_PROFILE=PATH`` in the environment: rank 0 runs the timed part under cProfile and writes the
stats to PATH (``python -m pstats PATH``); its time then includes the profiler's overhead.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np

import twisternet as tn
from collectives import AllGather, Barrier, KeyedGather
from collectives.columnar import splitters_from_sample

from _sort_data import BatchSummary, generate_table

SAMPLE = 10_000         # keys sampled per worker for the splitters


def _status_mb(field: str) -> float | None:
    """``field`` (e.g. ``VmRSS``, ``VmHWM``) of /proc/self/status in MB, None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1e3
    except OSError:
        pass
    return None


def _reset_peak() -> None:
    """Start VmHWM (peak RSS) over from the current RSS (Linux), so it covers the sort alone."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main() -> None:
    total, memory = int(sys.argv[1]), int(sys.argv[2])
    with tn.init(timeout=1800, memory_limit=memory) as ctx:
        task = ctx.my_tasks[0]
        table = generate_table(ctx.rank, ctx.world, total)
        sample = AllGather(ctx, edge=1)
        sort = KeyedGather(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=2)
        table.slice(0, 1).take(np.zeros(1, dtype=np.int64))   # pyarrow's lazy imports (pandas), not timed
        profile_to = os.environ.get("SORT_PROFILE") if ctx.rank == 0 else None
        prof = None
        if profile_to:
            import cProfile
            prof = cProfile.Profile()
        _reset_peak()
        start_rss = _status_mb("VmRSS")
        Barrier(ctx, "start", ctx.world).enter(ctx.rank)
        t0, c0 = time.perf_counter(), time.process_time()
        if prof is not None:
            prof.enable()
        step = max(1, table.num_rows // SAMPLE)
        sample.send_table(task, table.select(["key"]).take(np.arange(0, table.num_rows, step)))
        sample.finish(task)
        splitters = splitters_from_sample(sample.result_table(task), ["key"], len(ctx.tasks))
        t1 = time.perf_counter()
        sort.send_table(task, table, key="key", splitters=splitters)
        sort.finish(task)
        t2 = time.perf_counter()
        summary = BatchSummary()
        checking = 0.0
        for batch in sort.result_batches(task, memory_limit=memory):
            c = time.perf_counter()
            summary.add(batch)
            checking += time.perf_counter() - c
        if prof is not None:
            prof.disable()
        t3 = time.perf_counter()
        elapsed, cpu = t3 - t0, time.process_time() - c0
        if prof is not None:
            prof.dump_stats(profile_to)
        out = summary.result()
        out.update(rank=ctx.rank, seconds=elapsed, cpu_s=cpu, spilled_bytes=sort.spilled_bytes,
                   input_mb=table.nbytes / 1e6, start_rss_mb=start_rss, peak_rss_mb=_status_mb("VmHWM"),
                   spilled_runs=sort.spilled_runs,
                   phases={"splitters": t1 - t0, "send": t2 - t1, "receive+merge": t3 - t2 - checking,
                           "summary": checking})
        print("SORT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
