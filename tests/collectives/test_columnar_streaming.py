"""Columnar results as a stream: a huge send travels as bounded pieces, result_batches yields
result_table's rows, streaming tables arrive whole and in send order, small pieces reach the reader as
few large batches, and a streaming KeyedReduce yields updated aggregates."""

from __future__ import annotations

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from collectives.columnar import destination_index
from twisternet.testing import run_local

import tests.collectives.scripts.columnar_job as J


def test_one_huge_send_travels_as_bounded_pieces():
    """A table far larger than table_piece_bytes in one send_table call: routed and sent slice by
    slice, so no message (and no extra copy at the sender) is larger than about one slice (seen as
    the pieces a streaming destination receives; a batch one gets the same rows, sorted)."""
    import collectives as C

    def body(ctx):
        t = pa.table({"k": np.arange(50_000) % 1000, "v": np.arange(50_000, dtype=np.float64)})
        with C.KeyedGather(ctx, edge=13, group=False, mode="streaming") as op:
            op.table_piece_bytes = 16 << 10
            for task in op.local_sources:
                op.send_table(task, t, key="k")
                op.finish(task)
            pieces = [v for _, v in op.results()]
        with C.KeyedGather(ctx, edge=17, group=False) as op:
            op.table_piece_bytes = 16 << 10
            for task in op.local_sources:
                op.send_table(task, t, key="k")
                op.finish(task)
            rows = op.result_table().num_rows
        return len(pieces), max(p.nbytes for p in pieces), sum(p.num_rows for p in pieces), rows
    res = run_local(2, body, timeout=120)
    assert sum(r[2] for r in res) == 100_000 == sum(r[3] for r in res)
    for count, biggest, _, _ in res:
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
