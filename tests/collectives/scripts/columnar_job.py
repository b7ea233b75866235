"""Columnar operations as a job: every source sends deterministic tables (``make_table``) with
``send_table``; every destination prints its ``result_table`` as base64 Arrow IPC in one JSON line
``{"rank": r, "result": {task: ipc, "spilled": bytes}}``. The tests compute the expected tables from ``make_table``
with plain pyarrow in one process. Run as ``python tests/collectives/scripts/columnar_job.py OP JSON``
under ``twisternet run`` or ``mpiexec``; the tests also call :func:`scenario` on local threads."""

from __future__ import annotations

import base64
import json
import os
import sys
from typing import Any

import numpy as np


OPS = ("keyed_partition", "keyed_gather", "keyed_reduce", "partition", "gather", "allgather", "broadcast")
AGGREGATE = {"v": ["sum", "min", "count"], "w": ["max", "mean"]}


def make_table(src: int, call: int, rows: int, seed: int, schema_variant: int = 0) -> Any:
    """The table source task ``src`` sends in its ``call``-th send_table: int, string, fixed-binary keys
    (some null), an int64 and a float64 value (integer-valued, so sums are exact in any order)."""
    import pyarrow as pa
    rng = np.random.default_rng([seed, src, call])
    k = rng.integers(-20, 20, rows)
    kmask = rng.random(rows) < 0.05
    s = np.array([f"key-{x:03d}" for x in rng.integers(0, 30, rows)], dtype=object)
    fb = [int(x).to_bytes(10, "big") for x in rng.integers(0, 1 << 40, rows)]
    cols = {
        "k": pa.array(k, pa.int64(), mask=kmask),
        "s": pa.array(s, pa.string()),
        "f": pa.array(fb, pa.binary(10)),
        "v": pa.array(rng.integers(-1000, 1000, rows), pa.int64()),
        "w": pa.array(rng.integers(-1000, 1000, rows).astype(np.float64), mask=rng.random(rows) < 0.1),
        "src": pa.array(np.full(rows, src), pa.int32()),
        "row": pa.array(np.arange(rows) + call * 1_000_000, pa.int64()),
    }
    if schema_variant:
        cols["v"] = pa.array(rng.integers(-1000, 1000, rows).astype(np.float64))
    return pa.table(cols)


def to_b64(table: Any) -> str:
    import pyarrow as pa
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return base64.b64encode(sink.getvalue().to_pybytes()).decode()


def from_b64(text: str) -> Any:
    import pyarrow as pa
    return pa.ipc.open_stream(pa.py_buffer(base64.b64decode(text))).read_all()


def scenario(ctx: Any, params: dict) -> dict:
    """Run one columnar operation; ``{dest_task: base64 IPC of result_table}`` for local destinations."""
    import collectives as C
    op_name = params["op"]
    key = params.get("key", "k")
    rows, calls, seed = params.get("rows", 200), params.get("calls", 2), params.get("seed", 1)
    bad = params.get("bad_rank")               # this rank's tasks send a different schema
    tasks = ctx.plan.tasks
    limit = params.get("memory_limit")
    if limit:
        ctx.config.memory_limit = limit
    if op_name == "join":
        return _join(ctx, params, key, rows, calls, seed)
    kind = {"keyed_partition": C.KeyedPartition, "keyed_gather": C.KeyedGather, "keyed_reduce": C.KeyedReduce,
            "partition": C.Partition, "gather": C.Gather, "allgather": C.AllGather,
            "broadcast": C.Broadcast}[op_name]
    kw: dict = {"op": "sum"} if op_name == "keyed_reduce" else {}
    if op_name == "gather":
        kw["destinations"] = [tasks[-1]]
    out: dict = {}
    with kind(ctx, edge=3, **kw) as op:
        for t in op.local_sources:
            for c in range(calls):
                table = make_table(t, c, rows, seed, 1 if ctx.rank == bad else 0)
                if op_name in ("keyed_partition", "keyed_gather"):
                    op.send_table(t, table, key=key)
                elif op_name == "keyed_reduce":
                    op.send_table(t, table, key=key, aggregate=AGGREGATE)
                elif op_name == "partition":
                    dests = op.destinations
                    op.send_table(t, table, destination=dests[(t + c) % len(dests)])
                else:
                    op.send_table(t, table)
            op.finish(t)
        for d in op.local_destinations:
            out[str(d)] = to_b64(op.result_table(d))
        out["spilled"] = getattr(op, "spilled_bytes", 0)
    return out


def _join(ctx: Any, params: dict, key: Any, rows: int, calls: int, seed: int) -> dict:
    """Join of every source's make_table rows (left) with its calls' tables under another seed (right)."""
    import collectives as C
    out: dict = {}
    with C.Join(ctx, edge=3, key=key, how=params.get("how", "inner")) as j:
        for t in j.local_sources:
            for c in range(calls):
                j.send_left(t, make_table(t, c, rows, seed).select(["k", "s", "v"]))
                j.send_right(t, make_table(t, c, rows // 2, seed + 1).select(["k", "s", "w"]))
            j.finish(t)
        for d in j.local_destinations:
            out[str(d)] = to_b64(j.result_table(d))
    return out


def main(argv: list[str]) -> int:
    import twisternet as tn
    params = json.loads(argv[1]) if len(argv) > 1 else {}
    params["op"] = argv[0]
    with tn.init() as ctx:
        try:
            result: Any = scenario(ctx, params)
        except Exception as e:  # noqa: BLE001 - reported to the test as this rank's result
            result = {"error": f"{type(e).__name__}: {e}"}
        line = json.dumps({"rank": ctx.rank, "result": result})
        if params.get("out_dir"):      # large results: a file per rank (stdout lines of ranks interleave)
            with open(os.path.join(params["out_dir"], f"{ctx.rank}.json"), "w") as f:
                f.write(line)
        else:
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
