"""Group-by-sum of an Arrow table with a batch KeyedReduce's table path (needs pyarrow:
``pip install 'twisternet[arrow]'``).

    twisternet run -n 2 examples/groupby.py [--rows N] [--distinct K] [--check]
    mpiexec -n 2 python examples/groupby.py

Each worker generates its share of a table (int64 key ``k`` with K distinct values, float64 value
``v``), aggregates it locally (``send_table`` combines before sending), and every key's partial row goes
to the worker its stable hash selects, which merges them: each worker ends with one row per key it owns
(``k``, ``v_sum``, ``v_count``, ``v_mean``). Rank 0 gathers the small per-worker summaries and prints them
and the time taken; ``--check`` also compares every worker's result with plain pyarrow on the whole table.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

import numpy as np

import twisternet as tn
from collectives import Gather, KeyedReduce

if TYPE_CHECKING:
    import pyarrow as pa


def generated_table(rank: int, world: int, rows: int, distinct: int, seed: int = 7) -> pa.Table:
    """Worker ``rank``'s share of the deterministic ``rows``-row table (keys uniform in [0, distinct))."""
    import pyarrow as pa
    lo, hi = rows * rank // world, rows * (rank + 1) // world
    rng = np.random.default_rng([seed, rank])
    return pa.table({"k": rng.integers(0, distinct, hi - lo, dtype=np.int64),
                     "v": rng.standard_normal(hi - lo)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--distinct", type=int, default=20_000)
    ap.add_argument("--check", action="store_true", help="verify against single-process pyarrow")
    args = ap.parse_args()
    with tn.init() as ctx:
        table = generated_table(ctx.rank, ctx.world, args.rows, args.distinct)
        task = ctx.my_tasks[0]
        t0 = time.perf_counter()
        with KeyedReduce(ctx, edge=1, op="sum") as op:
            op.send_table(task, table, key="k", aggregate={"v": ["sum", "count", "mean"]})
            op.finish(task)
            mine = op.result_table(task)
        elapsed = time.perf_counter() - t0
        ok = None
        if args.check:
            import pyarrow as pa
            from collectives.columnar import destination_index
            whole = pa.concat_tables([generated_table(r, ctx.world, args.rows, args.distinct)
                                      for r in range(ctx.world)])
            ref = whole.group_by("k").aggregate([("v", "sum"), ("v", "count")]).sort_by("k")
            ref = ref.filter(pa.array(destination_index(ref, ["k"], ctx.world) == ctx.rank))
            ok = (mine.column("k").equals(ref.column("k"))
                  and mine.column("v_count").equals(ref.column("v_count"))
                  and bool(np.allclose(mine.column("v_sum").to_numpy(), ref.column("v_sum").to_numpy())))
        summary = {"rank": ctx.rank, "keys": mine.num_rows, "rows": int(np.sum(mine.column("v_count"))),
                   "seconds": elapsed, "ok": ok}
        with Gather(ctx, edge=2, destinations=[ctx.tasks[0]]) as g:
            g.send(task, summary)
            g.finish(task)
            if ctx.rank == 0:
                parts = [v for _, v in g.results()]
                for p in parts:
                    print(f"[{p['rank']}] {p['keys']} keys, {p['rows']} rows"
                          + ("" if p["ok"] is None else f", check {'passed' if p['ok'] else 'FAILED'}"))
                print(f"total: {sum(p['keys'] for p in parts)} keys, {sum(p['rows'] for p in parts)} rows; "
                      f"time taken {max(p['seconds'] for p in parts):.3f} s")
                if any(p["ok"] is False for p in parts):
                    sys.exit(1)


if __name__ == "__main__":
    main()
