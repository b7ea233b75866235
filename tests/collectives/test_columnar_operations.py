"""Columnar operations on local threads: send_table/result_table of every operation, keys of several
types, spilling, large tables in pieces, and the errors (schema mismatch, missing key column,
records mixed with tables, bad aggregations), checked exactly against single-process pyarrow."""

from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from collectives.columnar import destination_index
from tests.collectives.columnar_expected import check
from twisternet.errors import TableSchemaError, TwisternetError
from twisternet.testing import run_local

import tests.collectives.scripts.columnar_job as J


@pytest.mark.parametrize("op", J.OPS)
def test_every_operation_on_threads(op):
    params = {"op": op, "rows": 150, "calls": 3}
    check(run_local(3, J.scenario, params, timeout=120), 3, params)


@pytest.mark.parametrize("key", ["s", "f", ["s", "k"], ["k", "f", "s"]])
@pytest.mark.parametrize("op", ["keyed_gather", "keyed_reduce"])
def test_keys_of_several_types_and_columns(op, key):
    params = {"op": op, "rows": 120, "key": key}
    check(run_local(2, J.scenario, params, timeout=120), 2, params)


def test_keyed_gather_spills_tables_past_the_memory_limit():
    params = {"op": "keyed_gather", "rows": 2000, "calls": 4}
    results = run_local(2, J.scenario, params, timeout=120, memory_limit=32 << 10)
    check(results, 2, params)
    assert all(r["spilled"] > 0 for r in results)


def test_large_table_is_sent_in_pieces():
    """A table far beyond table_piece_bytes goes as several slices and arrives whole and in order."""
    import collectives as C

    def body(ctx):
        with C.KeyedPartition(ctx, edge=4) as op:
            op.table_piece_bytes = 4096
            t = pa.table({"k": np.arange(20000) % 97, "v": np.arange(20000)})
            for task in op.local_sources:
                op.send_table(task, t, key="k")
                op.finish(task)
            return {d: op.result_table(d) for d in op.local_destinations}
    res = run_local(2, body, timeout=120)
    t = pa.table({"k": np.arange(20000) % 97, "v": np.arange(20000)})
    for j, r in enumerate(res):
        mine = t.filter(pa.array(destination_index(t, ["k"], 2) == j))
        assert r[j].equals(pa.concat_tables([mine, mine]))


def _caught(ctx, params):
    try:
        return J.scenario(ctx, params)
    except Exception as e:  # noqa: BLE001 - the test looks at every rank's error
        return {"error": f"{type(e).__name__}: {e}"}


@pytest.mark.parametrize("op", ["keyed_gather", "keyed_partition", "keyed_reduce", "allgather", "partition"])
def test_schema_mismatch_fails_on_every_destination(op):
    res = run_local(3, _caught, {"op": op, "bad_rank": 1, "rows": 50}, timeout=120)
    errors = [r.get("error") for r in res if "error" in r]
    dests = 3
    assert len(errors) == dests, res
    for e in errors:
        assert e.startswith("TableSchemaError") and "rank 1" in e, e
        assert "column 'v'" in e and "int64 vs double" in e, e


def test_missing_key_column_is_an_error_at_send():
    import collectives as C

    def body(ctx):
        with C.KeyedGather(ctx, edge=5) as op:
            with pytest.raises(TableSchemaError, match=r"\['nope'\].*columns are \['k'\]"):
                op.send_table(op.local_sources[0], pa.table({"k": [1]}), key="nope")
            for t in op.local_sources:
                op.finish(t)
            return op.result_table().num_rows
    assert run_local(2, body, timeout=60) == [0, 0]


def test_records_and_tables_do_not_mix():
    import collectives as C

    def body(ctx):
        with C.Gather(ctx, edge=6, destinations=[0]) as op:
            for t in op.local_sources:
                op.send(t, {"a": 1})
                op.finish(t)
            if op.local_destinations:
                with pytest.raises(TwisternetError, match="not a table"):
                    op.result_table()
        return True
    assert run_local(2, body, timeout=60) == [True, True]


def test_bad_aggregation_is_refused():
    import collectives as C

    def body(ctx):
        with C.KeyedReduce(ctx, edge=7, op="sum") as op:
            with pytest.raises(ValueError, match="median"):
                op.send_table(op.local_sources[0], pa.table({"k": [1], "v": [2]}), key="k",
                              aggregate={"v": "median"})
            with pytest.raises(TableSchemaError, match="aggregated column"):
                op.send_table(op.local_sources[0], pa.table({"k": [1], "v": [2]}), key="k",
                              aggregate={"w": "sum"})
            for t in op.local_sources:
                op.finish(t)
            return op.result_table().num_rows
    assert run_local(2, body, timeout=60) == [0, 0]
