"""Sorting tables larger than memory: sorted Arrow IPC runs merged back by key (stable), through
SortedRuns and KeyedGather.result_batches, with memory that does not grow with the data."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.compute as pc

from collectives.columnar_spill import SortedRuns
from tests.jobs import job_env
from twisternet.testing import run_local



def stable_sorted(table, keys):
    return table.take(pc.sort_indices(table, sort_keys=[(k, "ascending", "at_start") for k in keys]))


def tables(n_tables: int, rows: int, distinct: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for j in range(n_tables):
        out.append(pa.table({
            "k": pa.array(rng.integers(0, distinct, rows), mask=rng.random(rows) < 0.02),
            "s": [f"s{v}" for v in rng.integers(0, 5, rows)],
            "f": rng.integers(-3, 3, rows).astype(np.float64),
            "i": np.arange(rows) + j * rows,           # arrival order, to check stability
            # fixed-size binary keys (the TeraSort kind: merged by numpy binary search), one with nulls
            "b": pa.array([bin_keys[v % 64] for v in rng.integers(0, max(1, distinct), rows)], pa.binary(10)),
            "c": pa.array([bin_keys[v % 64][:3] for v in rng.integers(0, max(1, distinct), rows)], pa.binary(3),
                          mask=rng.random(rows) < 0.02),
        }))
    return out


bin_keys = [bytes(np.random.default_rng(100 + v).integers(0, 4, 10, dtype=np.uint8)) for v in range(64)]


@pytest.mark.parametrize("keys,distinct", [(["k"], 50), (["k"], 1), (["s", "k"], 20), (["f"], 6),
                                           (["s"], 5), (["b"], 40), (["b"], 1), (["c"], 30)])
@pytest.mark.parametrize("compression", [None, "lz4"])
def test_sorted_runs_merge_is_sorted_and_stable(tmp_path, keys, distinct, compression):
    if compression and not pa.Codec.is_available(compression):
        pytest.skip(f"{compression} not built into this pyarrow")
    data = tables(9, 3000, distinct)
    runs = SortedRuns(keys, 60_000, str(tmp_path), compression=compression, batch_rows=500)
    for t in data:
        runs.add(t)
    out = pa.Table.from_batches(list(runs.batches()))
    assert runs.runs >= 5
    assert out.equals(stable_sorted(pa.concat_tables(data), keys))
    assert os.listdir(tmp_path) == []                   # run files removed once merged


@pytest.mark.parametrize("keys,distinct", [(["k"], 50), (["s", "k"], 20), (["b"], 60)])
def test_many_runs_are_merged_in_passes_sorted_and_stable(tmp_path, keys, distinct):
    """More runs than MERGE_FAN_IN: groups of them are merged first (each in place of its runs) until
    MERGE_FAN_IN are left; the result is still every row, sorted, equal keys in the order added, and
    no run was rewritten twice; no file is left."""
    from collectives.columnar_spill import MERGE_FAN_IN
    data = tables(2 * MERGE_FAN_IN + 6, 1000, distinct, seed=3)
    runs = SortedRuns(keys, 20_000, str(tmp_path), batch_rows=700)
    for t in data:
        runs.add(t)
    assert runs.runs > 2 * MERGE_FAN_IN
    written = runs.spilled_bytes
    out = pa.Table.from_batches(list(runs.batches()))
    assert out.equals(stable_sorted(pa.concat_tables(data), keys))
    assert written < runs.spilled_bytes < 2 * written     # merged runs written, each run at most once more
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("width", [3, 8, 10, 17])
def test_count_below_words_is_bisect_on_the_bytes(width):
    """The merge's numpy binary search over a fixed-size binary key agrees with bisect on the bytes,
    for bounds that are keys, between keys and beyond them, with long runs of equal keys."""
    import bisect

    from collectives.columnar.sorting import binary_key_words, bytes_words, count_below_words
    rng = np.random.default_rng(width)
    pool = [bytes(rng.integers(0, 3, width, dtype=np.uint8)) for _ in range(40)]
    keys = sorted(pool[i] for i in rng.integers(0, len(pool), 500))
    words = binary_key_words(pa.table({"k": pa.array(keys, pa.binary(width))}), ["k"])
    assert words is not None and len(words) == (width + 7) // 8
    for bound in pool + [bytes(width), b"\xff" * width, keys[0], keys[-1]]:
        assert count_below_words(words, bytes_words(bound, width)) == bisect.bisect_left(keys, bound)
    assert binary_key_words(pa.table({"k": pa.array([b"abc", None], pa.binary(3))}), ["k"]) is None


def test_take_rows_from_many_chunks_is_arrows_take() -> None:
    """take_rows gathers fixed-width columns itself (numbers, fixed-size binary, from sliced chunks)
    and hands the rest to Arrow: the result is Arrow's take, for any indices, in one chunk."""
    from collectives.columnar.sorting import take_rows
    rng = np.random.default_rng(7)

    def part(n: int, j: int):
        t = pa.table({
            "i8": rng.integers(-100, 100, n).astype(np.int8), "u16": rng.integers(0, 9999, n).astype(np.uint16),
            "f32": rng.random(n).astype(np.float32), "i64": np.arange(n) + 1000 * j,
            "fb": pa.array([bytes(rng.integers(0, 256, 5, dtype=np.uint8)) for _ in range(n)], pa.binary(5)),
            "flag": rng.random(n) < 0.5,                                   # bit-packed: Arrow's take
            "ts": pa.array(rng.integers(0, 10**9, n), pa.timestamp("s")),   # not gathered: Arrow's take
            "nul": pa.array(rng.random(n), mask=rng.random(n) < 0.3),     # nulls: Arrow's take
            "s": [f"r{j}-{x}" for x in range(n)],
        })
        return t.slice(j % 3, n - 3)                                     # chunks with offsets
    table = pa.concat_tables([part(int(rng.integers(3, 40)), j) for j in range(25)])
    assert table.column("i64").num_chunks == 25
    n = table.num_rows
    for idx in (rng.permutation(n), rng.integers(0, n, 3 * n), np.array([n - 1, 0, n - 1]), np.array([], np.int64)):
        got = take_rows(table, idx)
        assert got.equals(table.take(idx))
        assert all(c.num_chunks <= 1 for c in got.columns)
    assert take_rows(table, pa.array([4, 2, 2])).equals(table.take([4, 2, 2]))
    single = table.combine_chunks()
    assert take_rows(single, np.array([3, 1])).equals(single.take([3, 1]))
    for bad in (np.array([n]), np.array([0, -1])):
        with pytest.raises(IndexError):
            take_rows(table, bad)


def test_freed_memory_goes_back_only_past_twice_the_budget(tmp_path, monkeypatch):
    """Runs and merge blocks hand Arrow's freed memory back once RSS has grown by twice the budget
    since the runs started (or when RSS cannot be read), not after every one of them."""
    import collectives.columnar_spill as cs
    rss = [1000 << 20]
    released = []
    monkeypatch.setattr(cs, "_rss_bytes", lambda: rss[0])
    monkeypatch.setattr(cs, "_release", lambda: released.append(rss[0]))
    runs = SortedRuns(["k"], 10 << 20, str(tmp_path))
    rss[0] += 20 << 20
    runs._trim()
    assert released == []
    rss[0] += 1
    runs._trim()
    assert len(released) == 1
    monkeypatch.setattr(cs, "_rss_bytes", lambda: None)
    runs._trim()
    assert len(released) == 2
    small = SortedRuns(["k"], 20_000, str(tmp_path))
    for t in tables(6, 2000, 30):                  # writing runs and merging them trims too
        small.add(t)
    list(small.batches())
    assert small.runs >= 2 and len(released) > 2 + small.runs


def test_sorted_runs_in_memory_and_close(tmp_path):
    data = tables(2, 100, 10)
    runs = SortedRuns(["k"], 1 << 30, str(tmp_path))
    for t in data:
        runs.add(t)
    assert runs.runs == 0
    assert pa.Table.from_batches(list(runs.batches())).equals(stable_sorted(pa.concat_tables(data), ["k"]))
    runs = SortedRuns(["k"], 1000, str(tmp_path))
    for t in data:
        runs.add(t)
    assert os.listdir(tmp_path)
    runs.close()
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bound", ["config", "result_batches"])
def test_keyed_gather_result_batches_spill_and_match_result_table(bound):
    """Past config.memory_limit the pieces are kept as sorted runs as they arrive; result_batches'
    memory_limit spills the rows still held; either way the result is the stable sort of every
    source's rows (equal keys by source task, then send order) that result_table returns."""
    import collectives as C
    from collectives.columnar import destination_index

    def body(ctx):
        data = tables(4, 4000, 200, seed=ctx.rank)
        out = {}
        for method in ("batches", "table"):
            with C.KeyedGather(ctx, edge=11 if method == "batches" else 12) as op:
                task = ctx.my_tasks[0]
                for t in data:
                    op.send_table(task, t.append_column("src", pa.array([task] * t.num_rows)), key=["s", "k"])
                op.finish(task)
                if method == "batches":
                    limit = 50_000 if bound == "result_batches" else None
                    got = list(op.result_batches(task, memory_limit=limit, batch_rows=1000))
                    out[method] = (pa.Table.from_batches(got), op.spilled_runs, op.spilled_bytes)
                else:
                    out[method] = op.result_table(task)
        return out
    config = {"memory_limit": 50_000} if bound == "config" else {}
    res = run_local(2, body, timeout=180, **config)
    sent = pa.concat_tables([t.append_column("src", pa.array([r] * t.num_rows))
                             for r in range(2) for t in tables(4, 4000, 200, seed=r)])
    for j, r in enumerate(res):
        table, spilled, spilled_bytes = r["batches"]
        assert spilled > 3 if bound == "config" else spilled == 1
        assert spilled_bytes > 0
        mine = sent.filter(pa.array(destination_index(sent, ["s", "k"], 2) == j))
        assert table.equals(stable_sorted(mine, ["s", "k"]))
        assert table.equals(r["table"])


def test_keyed_gather_tables_and_records_are_read_apart():
    """A batch KeyedGather that received tables does not hand them to results() (they are sorted
    runs, read with result_table/result_batches), and records among tables are an error there."""
    import collectives as C
    from twisternet.errors import TwisternetError

    def body(ctx):
        task = ctx.my_tasks[0]
        with C.KeyedGather(ctx, edge=13, destinations=[0]) as op:
            op.send_table(task, pa.table({"k": [3, 1, 2]}), key="k")
            op.finish(task)
            if ctx.rank == 0:
                with pytest.raises(TwisternetError, match="result_table"):
                    list(op.results(task))
        with C.KeyedGather(ctx, edge=14, destinations=[0]) as op:
            if ctx.rank == 0:
                op.send_table(task, pa.table({"k": [3, 1, 2]}), key="k")
            else:
                op.send(task, 5, "a record")
            op.finish(task)
            if ctx.rank == 0:
                with pytest.raises(TwisternetError, match="not a table"):
                    op.result_table(task)
        return True
    assert run_local(2, body, timeout=60) == [True, True]


#: A chunk of TeraSort-like rows (10-byte random keys, 90-byte values) in the memory tests' jobs.
CHUNK = """def chunk(i, rows):
            raw = np.random.default_rng(i).integers(0, 256, (rows, 10), dtype=np.uint8)
            val = np.full(rows * 90, 120, np.uint8)
            fsb = pa.FixedSizeBinaryArray.from_buffers
            return pa.table({"key": fsb(pa.binary(10), rows, [None, pa.py_buffer(raw)]),
                             "value": fsb(pa.binary(90), rows, [None, pa.py_buffer(val)])})"""


def peak_growths(code: str, limit: int, factors: tuple[int, ...], tmp_path, *, own_dirs: bool = True) -> dict:
    """Run ``code`` (a job printing its peak RSS growth and counts) once per data factor, with
    ``limit`` and ``factor * limit`` bytes; {factor: the integers it printed}."""
    out = {}
    for factor in factors:
        spill = str(tmp_path / f"spill{factor}") if own_dirs else str(tmp_path)
        p = subprocess.run([sys.executable, "-c", code, str(limit), str(factor * limit), spill],
                           capture_output=True, text=True, timeout=600, env=job_env())
        assert p.returncode == 0, p.stderr
        out[factor] = tuple(map(int, p.stdout.split()))
    return out


def test_memory_does_not_grow_with_the_data(tmp_path):
    """Sorting 4x and 24x the memory limit: peak RSS grows by about the same (a constant in the data
    size: ~50-60 MB here at an 8 MB limit, the merge's blocks and Arrow's pool), well under the data."""
    code = textwrap.dedent(f"""
        import resource, sys, numpy as np, pyarrow as pa
        from collectives.columnar_spill import SortedRuns
        limit, total = int(sys.argv[1]), int(sys.argv[2])
        {CHUNK}
        r = SortedRuns(["key"], limit, sys.argv[3])
        chunk(0, 50_000); r.add(chunk(0, 50_000)); r._mem = []; r._mem_bytes = 0
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        n = i = rows = 0
        while n < total:
            t = chunk(i, 50_000); i += 1; n += t.nbytes; r.add(t); del t
        last = None
        for b in r.batches():
            k = b.column(0).to_pylist()
            assert last is None or last <= k[0]
            last = k[-1]; rows += len(b)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(peak - base, rows)
    """)
    limit = 8 << 20
    growth = {}
    for factor, (g, rows) in peak_growths(code, limit, (4, 24), tmp_path).items():
        growth[factor] = g
        assert rows * 100 >= factor * limit
    assert growth[24] - growth[4] < limit * 2, growth        # 20 more limits of data: no more memory
    assert growth[24] < 24 * limit * 0.6, growth             # far below the data


def test_keyed_gather_tables_memory_does_not_grow_with_the_data(tmp_path):
    """A KeyedGather of tables 4x and 12x config.memory_limit (one process): the pieces go to sorted
    runs as they arrive, so peak RSS grows by about the same for both, within the bound plus a constant
    (the runs' budget is a quarter of the bound: with all of it they took ~3.7x it)."""
    code = textwrap.dedent(f"""
        import resource, sys, numpy as np, pyarrow as pa
        import twisternet as tn
        from collectives import KeyedGather
        limit, total, spill = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
        {CHUNK}
        with tn.init(memory_limit=limit, spill_dir=spill) as ctx:
            op = KeyedGather(ctx, None, None, 1)
            chunk(0, 40_000).sort_by("key")
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            n = i = rows = 0
            while n < total:
                t = chunk(i, 40_000); i += 1; n += t.nbytes
                op.send_table(0, t, key="key"); del t
            op.finish(0)
            last = None
            for b in op.result_batches(0):
                k = b.column(0)
                assert last is None or last <= k[0].as_py()
                last = k[-1].as_py(); rows += len(b)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            print(peak - base, rows, op.spilled_runs)
    """)
    limit = 16 << 20
    growth = {}
    for factor, (g, rows, runs) in peak_growths(code, limit, (4, 12), tmp_path, own_dirs=False).items():
        growth[factor] = g
        assert rows * 100 >= factor * limit and runs >= factor - 1
    assert growth[12] - growth[4] < limit * 2, growth        # 8 more limits of data: no more memory
    assert growth[12] < limit + (40 << 20), growth           # the bound plus a constant (~25 MB here)
    assert not any(files for _, _, files in os.walk(tmp_path))
