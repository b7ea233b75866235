"""Columnar operations: the stable key hash, vectorized routing, and send_table/result_table of every
operation on local threads, checked exactly against single-process pyarrow computations."""

from __future__ import annotations

import struct

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.compute as pc  # noqa: E402

from collectives.columnar import (destination_index, row_hashes, sort_by_keys, split_rows,  # noqa: E402
                                  to_table)
from twisternet.errors import TableSchemaError, TwisternetError  # noqa: E402
from twisternet.testing import run_local  # noqa: E402

import tests.collectives.scripts.columnar_job as J  # noqa: E402

MASK = (1 << 64) - 1
G = 0x9E3779B97F4A7C15


# ------------------------------------------------------------------- the documented hash, in plain Python
def mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def value_hash(v) -> int:
    if isinstance(v, bool):
        return mix(int(v))
    if isinstance(v, int):
        return mix(v & MASK)
    if isinstance(v, float):
        if v == 0.0:
            v = 0.0
        bits = 0x7FF8000000000000 if v != v else struct.unpack("<Q", struct.pack("<d", v))[0]
        return mix(bits)
    raw = v.encode() if isinstance(v, str) else bytes(v)
    h = mix((len(raw) + G) & MASK)
    for i in range(0, len(raw), 8):
        h = mix(h ^ int.from_bytes(raw[i:i + 8].ljust(8, b"\0"), "little"))
    return h


def row_hash(values) -> int:
    h = 0
    for v in values:
        h = mix(h ^ value_hash(v))
    return h


def test_hash_is_pinned():
    """Fixed inputs, fixed hashes: a change of the routing function (which would send keys to other
    destinations than a peer running the old version) fails here."""
    t = pa.table({"i": pa.array([0, 1, -1, 2 ** 62], pa.int64()),
                  "s": ["", "a", "abcdefgh", "abcdefghi"],
                  "f": pa.array([1.5, -0.0, float("nan"), None])})
    assert [hex(x) for x in row_hashes(t, ["i"])[0].tolist()] == [
        "0x0", "0x7ab40e090f363a7d", "0x4bffd802ebfb15e4", "0x56451be349e0883f"]
    assert [hex(x) for x in row_hashes(t, ["s"])[0].tolist()] == [
        "0x48218226ff3cd4bf", "0xc55cb0205a68155c", "0x7db02c005bb88b11", "0x5f980d803b83011e"]
    assert [hex(x) for x in row_hashes(t, ["i", "s"])[0].tolist()] == [
        "0x48218226ff3cd4bf", "0x2f2dd09d4bdef515", "0xbb43f252bc32d9ff", "0xeb619a0d743efbdb"]
    h, nulls = row_hashes(t, ["f"])
    assert hex(int(h[0])) == "0xf16c38690e67bf1c" and nulls.tolist() == [False, False, False, True]


def test_hash_matches_the_documented_definition():
    rng = np.random.default_rng(5)
    ints = [int(x) for x in rng.integers(-(1 << 63), (1 << 63) - 1, 50)]
    strs = ["".join(chr(c) for c in rng.integers(32, 0x2FF, int(n))) for n in rng.integers(0, 30, 50)]
    floats = [float(x) for x in rng.normal(size=46)] + [-0.0, 0.0, float("nan"), float("inf")]
    t = pa.table({"i": ints, "s": strs, "f": floats, "b": [s.encode() for s in strs],
                  "x": [bool(i % 2) for i in range(50)]})
    for keys in (["i"], ["s"], ["f"], ["b"], ["x"], ["s", "i"], ["i", "f", "x"]):
        got = row_hashes(t, keys)[0].tolist()
        want = [row_hash([t.column(k)[r].as_py() for k in keys]) for r in range(50)]
        assert got == want, keys


def test_hash_depends_on_values_not_layout_or_width():
    vals = ["alpha", "b", "", "a much longer key that spans words", "ü-ñ"]
    base = row_hashes(pa.table({"k": vals}), ["k"])[0]
    for arr in (pa.array(vals, pa.large_string()), pa.array([v.encode() for v in vals], pa.binary()),
                pa.array(vals).dictionary_encode(),
                pa.chunked_array([pa.array(vals[:2]), pa.array(vals[2:])])):
        assert row_hashes(pa.table({"k": arr}), ["k"])[0].tolist() == base.tolist()
    # a slice hashes like the same values unsliced
    big = pa.array(["pad"] * 7 + vals)
    assert row_hashes(pa.table({"k": big.slice(7)}), ["k"])[0].tolist() == base.tolist()
    # integer widths and signedness agree on equal values; -0.0 == 0.0
    ints = [0, 5, -3, 127]
    h64 = row_hashes(pa.table({"k": pa.array(ints, pa.int64())}), ["k"])[0].tolist()
    assert row_hashes(pa.table({"k": pa.array(ints, pa.int8())}), ["k"])[0].tolist() == h64
    f = row_hashes(pa.table({"k": pa.array([0.0, -0.0], pa.float32())}), ["k"])[0]
    assert f[0] == f[1]
    # fixed-size binary hashes like variable binary of the same bytes
    fixed = [b"0123456789", b"abcdefghij"]
    assert row_hashes(pa.table({"k": pa.array(fixed, pa.binary(10))}), ["k"])[0].tolist() == \
        row_hashes(pa.table({"k": pa.array(fixed, pa.binary())}), ["k"])[0].tolist()


def test_null_keys_go_to_the_first_destination_and_sort_first():
    t = pa.table({"a": pa.array([1, None, 3, 4]), "b": pa.array(["x", "y", None, "z"])})
    idx = destination_index(t, ["a", "b"], 5)
    assert idx[1] == 0 and idx[2] == 0
    out = sort_by_keys(t, ["a"])
    assert out.column("a").to_pylist()[0] is None


def test_split_rows_keeps_order_with_one_take():
    t = pa.table({"i": np.arange(1000)})
    idx = np.random.default_rng(1).integers(0, 4, 1000)
    parts = split_rows(t, idx, 4)
    for d in range(4):
        assert parts[d].column("i").to_pylist() == np.flatnonzero(idx == d).tolist()


def test_unsupported_key_type_is_a_clear_error():
    t = pa.table({"k": pa.array([[1], [2]])})
    with pytest.raises(TableSchemaError, match="not supported"):
        row_hashes(t, ["k"])


def test_to_table_converts_batches_structured_arrays_and_dataframes():
    rb = pa.record_batch({"a": [1, 2]})
    assert to_table(rb).equals(pa.table({"a": [1, 2]}))
    arr = np.zeros(3, dtype=[("k", "<i8"), ("v", "<f8")])
    arr["k"] = [1, 2, 3]
    t = to_table(arr)
    assert t.column_names == ["k", "v"] and t.column("k").to_pylist() == [1, 2, 3]
    with pytest.raises(TypeError, match="pyarrow Table"):
        to_table([1, 2])
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"k": [3, 4], "s": ["a", "b"]}, index=[10, 11])
    # the index is dropped; pandas >= 3 stores strings as large_string, which the table keeps
    assert to_table(df).to_pydict() == {"k": [3, 4], "s": ["a", "b"]}


# ------------------------------------------------------------------------------------- expected results
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


def test_one_huge_send_travels_as_bounded_pieces():
    """A table far larger than table_piece_bytes in one send_table call: routed and sent slice by
    slice, so no message (and no extra copy at the sender) is larger than about one slice."""
    import collectives as C

    def body(ctx):
        with C.KeyedGather(ctx, edge=13, group=False) as op:
            op.table_piece_bytes = 16 << 10
            t = pa.table({"k": np.arange(50_000) % 1000, "v": np.arange(50_000, dtype=np.float64)})
            for task in op.local_sources:
                op.send_table(task, t, key="k")
                op.finish(task)
            pieces = [v for _, v in op.results()]
        return len(pieces), max(p.nbytes for p in pieces), sum(p.num_rows for p in pieces)
    res = run_local(2, body, timeout=120)
    assert sum(r[2] for r in res) == 100_000
    for count, biggest, _ in res:
        assert count > 20 and biggest <= 16 << 10


@pytest.mark.parametrize("op", ["keyed_partition", "partition", "gather", "allgather", "broadcast", "keyed_reduce",
                                "keyed_gather"])
def test_result_batches_stream_the_same_rows(op):
    """result_batches yields exactly result_table's rows in the same order, for every operation."""
    import collectives as C
    kinds = {"keyed_partition": C.KeyedPartition, "partition": C.Partition, "gather": C.Gather,
             "allgather": C.AllGather, "broadcast": C.Broadcast, "keyed_reduce": C.KeyedReduce,
             "keyed_gather": C.KeyedGather}

    def body(ctx):
        out = []
        for edge, method in ((14, "table"), (15, "batches")):
            kw = {"op": "sum"} if op == "keyed_reduce" else {}
            with kinds[op](ctx, edge=edge, **kw) as o:
                for t in o.local_sources:
                    for c in range(3):
                        table = J.make_table(t, c, 300, 5)
                        if op in ("keyed_partition", "keyed_gather"):
                            o.send_table(t, table, key="k")
                        elif op == "keyed_reduce":
                            o.send_table(t, table, key="k", aggregate=J.AGGREGATE)
                        elif op == "partition":
                            o.send_table(t, table, destination=o.destinations[c % len(o.destinations)])
                        else:
                            o.send_table(t, table)
                    o.finish(t)
                for d in o.local_destinations:
                    if method == "table":
                        out.append(o.result_table(d))
                    else:
                        batches = list(o.result_batches(d))
                        assert all(isinstance(b, pa.RecordBatch) for b in batches)
                        out.append(pa.Table.from_batches(batches, schema=out[len(out) // 2].schema)
                                   if batches else out[len(out) // 2].slice(0, 0))
        half = len(out) // 2
        return all(a.equals(b) for a, b in zip(out[:half], out[half:])), half
    for same, _n in run_local(2, body, timeout=120):
        assert same


@pytest.mark.parametrize("op", ["keyed_partition", "keyed_gather", "gather", "allgather", "broadcast"])
def test_streaming_tables_arrive_whole_and_in_send_order_per_source(op):
    import collectives as C
    kinds = {"keyed_partition": C.KeyedPartition, "keyed_gather": C.KeyedGather, "gather": C.Gather,
             "allgather": C.AllGather, "broadcast": C.Broadcast}

    def body(ctx):
        with kinds[op](ctx, edge=16, mode="streaming") as o:
            for t in o.local_sources:
                for c in range(3):
                    table = J.make_table(t, c, 200, 9)
                    if op.startswith("keyed"):
                        o.send_table(t, table, key="k")
                    else:
                        o.send_table(t, table)
                o.finish(t)
            got = {}
            for d in o.local_destinations:
                batches = list(o.result_batches(d))
                got[d] = pa.Table.from_batches(batches) if batches else None
            return got
    res = run_local(3, body, timeout=120)
    got = {d: t for r in res for d, t in r.items()}
    sources = [0] if op == "broadcast" else [0, 1, 2]
    every = pa.concat_tables([J.make_table(s, c, 200, 9) for s in sources for c in range(3)])
    if op.startswith("keyed"):
        tables = [t for t in got.values() if t is not None]
        assert sum(t.num_rows for t in tables) == every.num_rows
        want_rows = sorted(zip(every.column("src").to_pylist(), every.column("row").to_pylist()))
        got_rows = sorted(r for t in tables for r in zip(t.column("src").to_pylist(), t.column("row").to_pylist()))
        assert got_rows == want_rows
    else:
        for t in got.values():
            assert t.num_rows == every.num_rows
            assert sorted(t.column("row").to_pylist()) == sorted(every.column("row").to_pylist())
    for t in got.values():                 # send order within each source
        if t is None:
            continue
        for s in sources:
            rows = [r for src, r in zip(t.column("src").to_pylist(), t.column("row").to_pylist()) if src == s]
            assert rows == sorted(rows)


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


def _small_gathers(ctx, batch_bytes):
    import collectives as C
    out = {}
    for edge in (5, 6):            # results are read once: batches from one Gather, a table from another
        with C.Gather(ctx, edge=edge) as op:
            for task in op.local_sources:
                for i in range(200):
                    op.send_table(task, pa.table({"src": [task] * 10, "i": np.arange(i * 10, i * 10 + 10)}))
                op.finish(task)
            for d in op.local_destinations:
                if edge == 5:
                    out[d] = [b.num_rows for b in op.result_batches(d)]
                else:
                    out[f"table{d}"] = op.result_table(d)
    return out


@pytest.mark.parametrize("batch_bytes", [0, 64 << 10])
def test_many_small_pieces_reach_the_reader_as_few_large_batches(batch_bytes):
    """config.table_batch_bytes re-chunks a batch destination's small pieces (400 sends of 10 rows
    here) into batches of about that size, keeping every row and its order; 0 keeps them as sent."""
    res = run_local(2, _small_gathers, batch_bytes, timeout=120, table_batch_bytes=batch_bytes)
    got = next(r for r in res if 0 in r)
    expected = pa.concat_tables([pa.table({"src": [s] * 2000, "i": np.arange(2000)}) for s in (0, 1)])
    assert got["table0"].equals(expected)
    assert sum(got[0]) == 4000
    if batch_bytes:
        # 4000 rows x 16 bytes = 64000 bytes: under one target, so one batch
        assert len(got[0]) == 1 and got["table0"].column(0).num_chunks == 1
    else:
        assert len(got[0]) == 400


def _streaming_reduce(ctx, _):
    import collectives as C
    out = {}
    for edge, how in ((7, "batches"), (8, "table")):
        with C.KeyedReduce(ctx, edge=edge, mode="streaming") as op:
            for task in op.local_sources:
                for call in range(3):
                    k = (np.arange(40) * (task + 1) + call) % 13
                    op.send_table(task, pa.table({"k": k, "v": np.arange(40, dtype=np.float64) + call}),
                                  key="k", aggregate={"v": ["sum", "count", "mean", "max"]})
                op.finish(task)
            for d in op.local_destinations:
                if how == "batches":
                    out[d] = [pa.Table.from_batches([b]) for b in op.result_batches(d)]
                else:
                    out[f"table{d}"] = op.result_table(d)
    return out


def test_streaming_keyed_reduce_of_tables_yields_updated_aggregates():
    """Streaming KeyedReduce takes tables: each received piece yields the updated aggregates of the
    keys it touched (so a key's last update is its final aggregate), and result_table, once every
    source finished, equals the batch answer."""
    res = run_local(2, _streaming_reduce, None, timeout=120)
    rows = []
    for task in (0, 1):
        for call in range(3):
            k = (np.arange(40) * (task + 1) + call) % 13
            rows.append(pa.table({"k": k, "v": np.arange(40, dtype=np.float64) + call}))
    whole = pa.concat_tables(rows)
    ref = whole.group_by("k").aggregate([("v", "sum"), ("v", "count"), ("v", "mean"), ("v", "max")])
    ref = ref.select(["k", "v_sum", "v_count", "v_mean", "v_max"]).sort_by("k")
    n_dest = 2
    for j, r in enumerate(res):
        mine = ref.filter(pa.array(destination_index(ref, ["k"], n_dest) == j))
        assert r[f"table{j}"].equals(mine)
        updates = r[j]
        assert 1 <= len(updates) <= 6                # one per non-empty piece (3 calls x 2 sources)
        last = {}
        for u in updates:
            assert u.column_names == ["k", "v_sum", "v_count", "v_mean", "v_max"]
            assert u.column("k").to_pylist() == sorted(u.column("k").to_pylist())
            for row in u.to_pylist():
                assert row["v_count"] >= last.get(row["k"], {}).get("v_count", 0)
                last[row["k"]] = row
        assert sorted(last.values(), key=lambda x: x["k"]) == mine.to_pylist()
