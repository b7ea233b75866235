"""Job for test_columnar_processes: how many bytes Python allocates while a rank sends a 32 MB table
through Gather / AllGather / Broadcast / KeyedReduce (tracemalloc traces Python's allocations, such as a
``bytes`` join of the table's buffers, not Arrow's own memory): a copy at the sender shows as a peak
of at least one 8 MiB piece."""

from __future__ import annotations

import json
import os
import sys
import tracemalloc

import numpy as np

import pyarrow as pa

import twisternet as tn
import collectives as C


def main() -> None:
    op_name, out_dir = sys.argv[1], sys.argv[2]
    rows = 4 << 20
    with tn.init(timeout=240) as ctx:
        task = ctx.my_tasks[0]
        cls = {"gather": C.Gather, "allgather": C.AllGather, "broadcast": C.Broadcast}[op_name]
        sender = 0 if op_name == "broadcast" else 1
        # only the measured rank sends rows (32 MB): receiving another rank's table meanwhile would
        # allocate receive buffers in this process and blur the measurement
        table = pa.table({"v": np.arange(rows if ctx.rank == sender else 0, dtype=np.int64)})
        with cls(ctx, edge=1) as op:
            if task in op.local_sources:
                tracemalloc.start()
                op.send_table(task, table)
                op.finish(task)
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            else:
                peak = None
            rows_got = {d: op.result_table(d).num_rows for d in op.local_destinations}
        with open(os.path.join(out_dir, f"{ctx.rank}.json"), "w") as f:
            json.dump({"result": {"peak": peak if ctx.rank == sender else None, "rows": rows_got}}, f)


if __name__ == "__main__":
    main()
