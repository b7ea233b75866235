"""Range partitioning of tables: destinations in key order, KeyedGather with splitters globally sorted,
and a wrong number of splitters refused."""

from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.compute as pc

from twisternet.testing import run_local


def _fixed_keys(n: int, seed: int) -> pa.Array:
    raw = np.random.default_rng(seed).integers(0, 4, (n, 10), dtype=np.uint8)   # many equal keys
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(10), n, [None, pa.py_buffer(raw.tobytes())])


@pytest.mark.parametrize("key", [["f"], ["i"], ["s"], ["i", "s"], ["d"]])
def test_range_partition_orders_destinations(key):
    from collectives.columnar import range_index, splitters_from_sample
    rng = np.random.default_rng(3)
    n = 3000
    t = pa.table({"f": _fixed_keys(n, 4), "i": pa.array(rng.integers(0, 40, n), mask=rng.random(n) < 0.02),
                  "s": [f"s{x}" for x in rng.integers(0, 300, n)],
                  "d": pa.array(rng.integers(0, 10, n).astype("datetime64[D]"))})
    splitters = splitters_from_sample(t.slice(0, 500), key, 4)
    assert splitters.num_rows == 3
    idx = range_index(t, key, splitters)
    assert np.bincount(idx, minlength=4).min() > n // 10          # the sample spreads the keys

    def as_key(row):
        return tuple((0,) if v is None else (1, v) for v in row)
    maxes = []
    for d in range(4):
        part = t.filter(pa.array(idx == d))
        rows = [as_key(r) for r in zip(*[part.column(k).to_pylist() for k in key])]
        maxes.append((min(rows), max(rows)))
    for (_, hi), (lo, _) in zip(maxes, maxes[1:]):
        assert hi <= lo
    # the binary-search path and the general sort path agree
    if key in (["f"], ["i"], ["d"]):
        dup = pa.table({key[0]: t.column(key[0]), "_": pa.array(np.zeros(n, dtype=np.int8))})
        general = range_index(dup, [key[0], "_"], splitters.append_column("_", pa.array(np.zeros(3, np.int8))))
        assert np.array_equal(general, idx)


def test_keyed_gather_with_splitters_is_globally_sorted():
    import collectives as C
    from collectives.columnar import splitters_from_sample

    def body(ctx):
        t = pa.table({"k": _fixed_keys(2000, ctx.rank), "src": np.full(2000, ctx.rank)})
        task = ctx.my_tasks[0]
        with C.AllGather(ctx, edge=8) as ag:
            ag.send_table(task, t.slice(0, 200).select(["k"]))
            ag.finish(task)
            spl = splitters_from_sample(ag.result_table(), ["k"], 3)
        with C.KeyedGather(ctx, edge=9) as op:
            op.send_table(task, t, key="k", splitters=spl)
            op.finish(task)
            return op.result_table()
    res = run_local(3, body, timeout=120)
    whole = pa.concat_tables(res)
    want = pa.concat_tables([pa.table({"k": _fixed_keys(2000, r), "src": np.full(2000, r)}) for r in range(3)])
    order = pc.sort_indices(want, sort_keys=[("k", "ascending")])
    assert whole.equals(want.take(order))           # globally sorted, and stable by source


def test_wrong_number_of_splitters_is_refused():
    import collectives as C

    def body(ctx):
        with C.KeyedGather(ctx, edge=10) as op:
            with pytest.raises(ValueError, match="need 1 splitter rows, got 2"):
                op.send_table(op.local_sources[0], pa.table({"k": [1, 2]}), key="k",
                              splitters=pa.table({"k": [1, 2]}))
            for t in op.local_sources:
                op.finish(t)
            return op.result_table().num_rows
    assert run_local(2, body, timeout=60) == [0, 0]
