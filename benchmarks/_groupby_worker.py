"""Worker of benchmarks/groupby.py: group-by-sum of this worker's share of the generated table with
KeyedReduce.send_table; writes its result table (Arrow IPC) for the driver to verify."""

import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import pyarrow as pa
import pyarrow.compute  # loaded before the clock starts, as the peers load theirs

import twisternet as tn
from collectives import Barrier, KeyedReduce
from groupby import generated_table


def main() -> None:
    rows, distinct, out_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    with tn.init(timeout=1800) as ctx:
        table = generated_table(ctx.rank, ctx.world, rows, distinct)
        gc.collect()
        task = ctx.my_tasks[0]
        op = KeyedReduce(ctx, edge=1, op="sum")
        Barrier(ctx, "start", ctx.world).enter(ctx.rank)     # every worker has its input: start together
        t0 = time.perf_counter()
        op.send_table(task, table, key="k", aggregate={"v": "sum"})
        op.finish(task)
        mine = op.result_table(task)
        elapsed = time.perf_counter() - t0
        op.close()
        with pa.OSFile(os.path.join(out_dir, f"{ctx.rank}.arrow"), "wb") as f, \
                pa.ipc.new_file(f, mine.schema) as w:
            w.write_table(mine)
        print("GB " + json.dumps({"rank": ctx.rank, "seconds": elapsed, "keys": mine.num_rows}), flush=True)


if __name__ == "__main__":
    main()
