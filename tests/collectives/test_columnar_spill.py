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

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
        }))
    return out


@pytest.mark.parametrize("keys,distinct", [(["k"], 50), (["k"], 1), (["s", "k"], 20), (["f"], 6),
                                           (["s"], 5)])
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


def test_keyed_gather_result_batches_spill_and_match_result_table():
    import collectives as C

    def body(ctx):
        data = tables(4, 4000, 200, seed=ctx.rank)
        out = {}
        for method in ("batches", "table"):
            with C.KeyedGather(ctx, edge=11 if method == "batches" else 12) as op:
                task = ctx.my_tasks[0]
                for t in data:
                    op.send_table(task, t, key=["s", "k"])
                op.finish(task)
                if method == "batches":
                    got = list(op.result_batches(task, memory_limit=50_000, batch_rows=1000))
                    out[method] = (pa.Table.from_batches(got), op.spilled_runs)
                else:
                    out[method] = op.result_table(task)
        return out
    for r in run_local(2, body, timeout=180):
        table, spilled = r["batches"]
        assert spilled > 3
        assert table.equals(r["table"])


def test_memory_does_not_grow_with_the_data():
    """Sorting 4x and 12x the memory limit: peak RSS grows by about the same (a constant in the data
    size), well under the data size."""
    code = textwrap.dedent("""
        import resource, sys, numpy as np, pyarrow as pa
        from collectives.columnar_spill import SortedRuns
        limit, total = int(sys.argv[1]), int(sys.argv[2])
        def chunk(i, rows=50_000):
            raw = np.random.default_rng(i).integers(0, 256, (rows, 10), dtype=np.uint8)
            val = np.full(rows * 90, 120, np.uint8)
            fsb = pa.FixedSizeBinaryArray.from_buffers
            return pa.table({"key": fsb(pa.binary(10), rows, [None, pa.py_buffer(raw)]),
                             "value": fsb(pa.binary(90), rows, [None, pa.py_buffer(val)])})
        r = SortedRuns(["key"], limit, sys.argv[3])
        chunk(0); r.add(chunk(0)); r._mem = []; r._mem_bytes = 0
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        n = i = rows = 0
        while n < total:
            t = chunk(i); i += 1; n += t.nbytes; r.add(t); del t
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
    for factor in (4, 12):
        spill = os.path.join(ROOT, ".pytest_spill_rss")
        p = subprocess.run([sys.executable, "-c", code, str(limit), str(factor * limit), spill],
                           capture_output=True, text=True, timeout=600, env=job_env())
        assert p.returncode == 0, p.stderr
        g, rows = map(int, p.stdout.split())
        growth[factor] = g
        assert rows * 100 >= factor * limit
    assert growth[12] - growth[4] < limit * 2, growth        # 8 more limits of data: no more memory
    assert growth[12] < 12 * limit * 0.6, growth             # far below the data
