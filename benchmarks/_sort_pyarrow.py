"""The sort suite's physical reference: one process sorting the whole input in memory with pyarrow.

    python benchmarks/_sort_pyarrow.py TOTAL_RECORDS WORLD

Generates the ``WORLD`` shares of the input (``benchmarks/_sort_data.py``, the records every
implementation sorts; not timed) as one Arrow table, then times ``Table.sort_by("key")`` (Arrow's own
sort, no spill) and the summary of the sorted table (the same :class:`BatchSummary` the twisternet
columnar worker uses). Prints one ``PYARROW {json}`` line: the summary, ``seconds`` (sort and summary)
and ``sort_s`` (the sort alone).
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pyarrow as pa

from _sort_data import BatchSummary, generate_table


def main() -> None:
    total, world = int(sys.argv[1]), int(sys.argv[2])
    table = pa.concat_tables([generate_table(r, world, total) for r in range(world)]).combine_chunks()
    table.slice(0, 2).sort_by("key")                 # lazy imports of the sort path, before the clock
    t0, c0 = time.perf_counter(), time.process_time()
    ordered = table.sort_by("key")
    t1 = time.perf_counter()
    summary = BatchSummary()
    for batch in ordered.to_batches():
        summary.add(batch)
    t2 = time.perf_counter()
    out = summary.result()
    out.update(seconds=t2 - t0, sort_s=t1 - t0, cpu_s=time.process_time() - c0)
    print("PYARROW " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
