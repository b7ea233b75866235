"""The tables every destination of a columnar operation must get (computed with plain pyarrow in one
process from the deterministic tables of scripts/columnar_job.py), and ``check`` of results against them.
Used by the columnar tests on threads and in processes; not a test module."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from collectives.columnar import destination_index
import tests.collectives.scripts.columnar_job as J

AGG_COLUMNS = ["v_sum", "v_min", "v_count", "w_max", "w_mean"]


def sources_tables(world: int, params: dict) -> list[tuple[int, int, pa.Table]]:
    rows, calls, seed = params.get("rows", 200), params.get("calls", 2), params.get("seed", 1)
    return [(t, c, J.make_table(t, c, rows, seed)) for t in range(world) for c in range(calls)]


def expected(world: int, params: dict) -> dict[int, pa.Table]:
    """Destination task -> the table it must get, computed with plain pyarrow in this process."""
    op, key = params["op"], params.get("key", "k")
    keys = [key] if isinstance(key, str) else list(key)
    tabs = sources_tables(world, params)
    dests = list(range(world))
    out = {}
    if op in ("keyed_partition", "keyed_gather", "keyed_reduce"):
        for j, d in enumerate(dests):
            mine = pa.concat_tables([t.filter(pa.array(destination_index(t, keys, world) == j)) for _, _, t in tabs])
            if op == "keyed_gather":
                order = pc.sort_indices(mine, sort_keys=[(k, "ascending", "at_start") for k in keys])
                mine = mine.take(order)
            elif op == "keyed_reduce":
                agg = mine.group_by(keys).aggregate([("v", "sum"), ("v", "min"), ("v", "count"), ("w", "max"),
                                                     ("w", "mean")])
                agg = agg.select(keys + AGG_COLUMNS)
                mine = agg.take(pc.sort_indices(agg, sort_keys=[(k, "ascending", "at_start") for k in keys]))
            out[d] = mine
    elif op == "partition":
        for d in dests:
            out[d] = pa.concat_tables([t for s, c, t in tabs if dests[(s + c) % world] == d])
    elif op in ("gather", "allgather"):
        everything = pa.concat_tables([t for _, _, t in tabs])
        out = {world - 1: everything} if op == "gather" else {d: everything for d in dests}
    elif op == "broadcast":
        out = {d: pa.concat_tables([t for s, _, t in tabs if s == 0]) for d in dests}
    return out


def check(results: list[dict], world: int, params: dict) -> None:
    want = expected(world, params)
    assert all("error" not in r for r in results), results
    got = {int(d): J.from_b64(b64) for r in results for d, b64 in r.items() if d.isdigit()}
    assert sorted(got) == sorted(want)
    for d, table in want.items():
        g = got[d]
        if params["op"] == "keyed_reduce":
            assert g.column_names == table.column_names
            for name in table.column_names:
                if name == "w_mean":
                    a = np.array(g.column(name).to_pylist(), dtype=float)
                    b = np.array(table.column(name).to_pylist(), dtype=float)
                    np.testing.assert_allclose(a, b, rtol=1e-12, equal_nan=True)
                else:
                    assert g.column(name).to_pylist() == table.column(name).to_pylist(), name
        else:
            assert g.schema.equals(table.schema), (g.schema, table.schema)
            assert g.equals(table), f"destination {d}"
    if params["op"] in ("keyed_partition", "keyed_gather"):      # every row exactly once, somewhere
        rows = sorted(r for t in got.values() for r in zip(t.column("src").to_pylist(), t.column("row").to_pylist()))
        assert len(rows) == len(set(rows)) == sum(t.num_rows for _, _, t in sources_tables(world, params))
