"""Less common columnar keys: dictionary, decimal and boolean keys, user metadata that may differ while
the key choice may not, and fixed-size binary keys sorted with numpy like Arrow."""

from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.compute as pc

from collectives.columnar import destination_index, sort_by_keys
from twisternet.errors import TableSchemaError
from twisternet.testing import run_local


@pytest.mark.parametrize("key", ["d", "dec", "b", ["d", "b"]])
def test_dictionary_decimal_and_boolean_keys(key):
    """Keys Arrow cannot sort a table by directly (dictionary) and other less common key types."""
    import decimal

    import collectives as C
    keys = [key] if isinstance(key, str) else key

    def make(rank):
        rng = np.random.default_rng(rank)
        n = 300
        return pa.table({"d": pa.array([["b", "a", None, "c"][i] for i in rng.integers(0, 4, n)]).dictionary_encode(),
                         "dec": pa.array([decimal.Decimal(int(x)) / 4 for x in rng.integers(-9, 9, n)],
                                         pa.decimal128(10, 2)),
                         "b": pa.array(rng.random(n) < 0.5), "v": np.arange(n) + rank * 1000})

    def body(ctx):
        task = ctx.my_tasks[0]
        with C.KeyedGather(ctx, edge=18) as g:
            g.send_table(task, make(ctx.rank), key=key)
            g.finish(task)
            gathered = g.result_table()
        with C.KeyedReduce(ctx, edge=19, op="sum") as r:
            r.send_table(task, make(ctx.rank), key=key, aggregate={"v": ["sum", "count"]})
            r.finish(task)
            reduced = r.result_table()
        return gathered, reduced
    res = run_local(3, body, timeout=120)
    whole = pa.concat_tables([make(r) for r in range(3)]).unify_dictionaries()

    def decoded(t):
        return t.set_column(0, "d", t.column("d").cast(pa.string()))
    plain = decoded(whole)
    for j, (gathered, reduced) in enumerate(res):
        mine = whole.filter(pa.array(destination_index(whole, keys, 3) == j))
        order = pc.sort_indices(plain.filter(pa.array(destination_index(whole, keys, 3) == j)),
                                sort_keys=[(k, "ascending", "at_start") for k in keys])
        assert decoded(gathered).equals(decoded(mine.take(order)))
        want = mine.group_by(keys).aggregate([("v", "sum"), ("v", "count")])
        got = {tuple(r[k] for k in keys): (r["v_sum"], r["v_count"]) for r in reduced.to_pylist()}
        assert got == {tuple(r[k] for k in keys): (r["v_sum"], r["v_count"]) for r in want.to_pylist()}


def test_user_metadata_may_differ_but_key_choice_may_not():
    import collectives as C

    def body(ctx):
        task = ctx.my_tasks[0]
        t = pa.table({"k": [1, 2, 3], "j": [3, 2, 1]}).replace_schema_metadata({"who": str(ctx.rank)})
        with C.Gather(ctx, edge=23, destinations=[0]) as g:
            g.send_table(task, t)
            g.finish(task)
            rows = g.result_table().num_rows if ctx.rank == 0 else None
        with C.KeyedGather(ctx, edge=24, destinations=[0]) as kg:
            kg.send_table(task, t, key="k" if ctx.rank == 0 else "j")
            kg.finish(task)
            if ctx.rank == 0:
                with pytest.raises(TableSchemaError, match="different key= or aggregate="):
                    kg.result_table()
        return rows
    assert run_local(2, body, timeout=60)[0] == 6


@pytest.mark.parametrize("width", [4, 8, 10, 17])
@pytest.mark.parametrize("distinct", [3, 256])
def test_fixed_size_binary_keys_sort_with_numpy_like_arrow(monkeypatch, width, distinct):
    """A single fixed-size binary key (TeraSort's) is sorted on its bytes with numpy, not Arrow's
    per-value comparison sort: same stable order, nulls first, on slices too, ties and all."""
    rng = np.random.default_rng(width * distinct)
    n = 3000
    raw = rng.integers(0, distinct, (n, width), dtype=np.uint8)
    nulls = rng.random(n) < 0.05
    keys = pa.array([None if m else bytes(r) for r, m in zip(raw, nulls)], pa.binary(width))
    table = pa.table({"k": keys, "i": np.arange(n)})
    expected = {}
    for name, t in (("whole", table), ("slice", table.slice(7, n - 20))):
        idx = pc.sort_indices(t, sort_keys=[("k", "ascending", "at_start"), ("i", "ascending")])
        expected[name] = t.take(idx)

    def no_arrow_sort(*a, **k):
        raise AssertionError("Arrow's sort_indices used for a fixed-size binary key")
    monkeypatch.setattr(pc, "sort_indices", no_arrow_sort)
    assert sort_by_keys(table, ["k"]).equals(expected["whole"])
    assert sort_by_keys(table.slice(7, n - 20), ["k"]).equals(expected["slice"])


@pytest.mark.parametrize("key", ["fixed4", "fixed10", "int"])
def test_tiebreak_column_orders_equal_keys(key):
    """sort_by_keys(..., tiebreak=col): equal keys ordered by the tie-break column, then row order,
    nulls first (ordered by it too), on the numpy path (fixed-size binary) and Arrow's alike."""
    rng = np.random.default_rng(7)
    n = 2000
    width = {"fixed4": 4, "fixed10": 10, "int": 0}[key]
    nulls = rng.random(n) < 0.05
    if width:
        raw = rng.integers(0, 3, (n, width), dtype=np.uint8)
        keys = pa.array([None if m else bytes(r) for r, m in zip(raw, nulls)], pa.binary(width))
    else:
        keys = pa.array(rng.integers(0, 5, n), mask=nulls)
    tb = rng.integers(0, 4, n).astype(np.uint64)
    table = pa.table({"k": keys, "o": tb, "i": np.arange(n)})
    idx = pc.sort_indices(table, sort_keys=[("k", "ascending", "at_start"), ("o", "ascending"),
                                            ("i", "ascending")])
    assert sort_by_keys(table, ["k"], tiebreak="o").equals(table.take(idx))
    assert sort_by_keys(table.slice(5, n - 9), ["k"], tiebreak="o").equals(
        table.slice(5, n - 9).take(pc.sort_indices(table.slice(5, n - 9), sort_keys=[
            ("k", "ascending", "at_start"), ("o", "ascending"), ("i", "ascending")])))
