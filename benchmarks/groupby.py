"""Group-by-sum of N rows (int64 key with K distinct values, float64 value): twisternet's
``KeyedReduce.send_table`` on W local workers vs single-process pyarrow ``Table.group_by`` and Polars
(the local ceilings), and Dask / PySpark DataFrames when installed, on the same generated table.

    python benchmarks/groupby.py [--rows 10000000] [--distinct 1000000] [--workers 2] [--repeat 3]

The issue's target size is ``--rows 100000000 --distinct 1000000``. Timed: the aggregation and the
distributed merge (every key reduced at its destination; twisternet's time is the slowest worker's,
from a common start barrier); not timed: generating the table (``examples/groupby.py``'s
``generated_table``, identical for every implementation). Every run is checked: the concatenated
per-worker results must have exactly the reference's keys and counts, and sums equal within 1e-9
relative. Figures are medians of ``--repeat`` runs; ratios are the peer's time over twisternet's.
Peers that are not installed are reported as skipped. Also the ``groupby`` suite of ``python -m benchmarks``
(``--set groupby.rows=N --set groupby.distinct=K``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any
from collections.abc import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import numpy as np  # noqa: E402

from groupby import generated_table  # noqa: E402


def whole_table(rows: int, distinct: int, workers: int) -> Any:
    import pyarrow as pa
    return pa.concat_tables([generated_table(r, workers, rows, distinct) for r in range(workers)])


def reference(table: Any) -> Any:
    return table.group_by("k").aggregate([("v", "sum"), ("v", "count")]).sort_by("k")


def verify(name: str, keys: np.ndarray, sums: np.ndarray, ref: Any) -> None:
    order = np.argsort(keys, kind="stable")
    keys, sums = keys[order], sums[order]
    want_k = ref.column("k").to_numpy()
    if len(keys) != len(want_k) or not np.array_equal(keys, want_k):
        raise RuntimeError(f"{name}: wrong keys ({len(keys)} vs {len(want_k)})")
    if not np.allclose(sums, ref.column("v_sum").to_numpy(), rtol=1e-9, atol=1e-9):
        raise RuntimeError(f"{name}: wrong sums")


def run_twisternet(rows: int, distinct: int, workers: int, ref: Any) -> float:
    import pyarrow as pa
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWISTERNET_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as out:
        p = subprocess.run([sys.executable, "-m", "twisternet", "run", "-n", str(workers),
                            str(ROOT / "benchmarks" / "_groupby_worker.py"), str(rows), str(distinct), out],
                           env=env, capture_output=True, text=True, timeout=3600, cwd=ROOT)
        res = [json.loads(line.split("GB ", 1)[1]) for line in p.stdout.splitlines() if "GB " in line]
        if len(res) != workers:
            raise RuntimeError(f"twisternet run failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        parts = [pa.ipc.open_file(os.path.join(out, f"{r}.arrow")).read_all() for r in range(workers)]
    got = pa.concat_tables(parts)
    verify("twisternet", got.column("k").to_numpy(), got.column("v_sum").to_numpy(), ref)
    return max(r["seconds"] for r in res)


def run_pyarrow(table: Any, ref: Any) -> float:
    gc.collect()
    t = time.perf_counter()
    out = table.group_by("k").aggregate([("v", "sum")])
    dt = time.perf_counter() - t
    verify("pyarrow", out.column("k").to_numpy(), out.column("v_sum").to_numpy(), ref)
    return dt


def run_polars(table: Any, ref: Any) -> float:
    import polars as pl
    df = pl.from_arrow(table)
    gc.collect()
    t = time.perf_counter()
    out = df.group_by("k").agg(pl.col("v").sum())
    dt = time.perf_counter() - t
    verify("polars", out["k"].to_numpy(), out["v"].to_numpy(), ref)
    return dt


def run_dask(table: Any, ref: Any, workers: int) -> float:
    import dask.dataframe as dd
    from dask.distributed import Client, LocalCluster
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True) as cluster, Client(cluster):
        ddf = dd.from_pandas(table.to_pandas(), npartitions=workers).persist()
        gc.collect()
        t = time.perf_counter()
        out = ddf.groupby("k")["v"].sum().compute()
        dt = time.perf_counter() - t
    verify("dask", out.index.to_numpy(), out.to_numpy(), ref)
    return dt


def run_spark(table: Any, ref: Any, workers: int) -> float:
    from pyspark.sql import SparkSession, functions as F
    spark = SparkSession.builder.master(f"local[{workers}]").appName("groupby").getOrCreate()
    try:
        sdf = spark.createDataFrame(table.to_pandas()).repartition(workers).cache()
        sdf.count()
        t = time.perf_counter()
        rows = sdf.groupBy("k").agg(F.sum("v").alias("v")).collect()
        dt = time.perf_counter() - t
    finally:
        spark.stop()
    verify("pyspark", np.array([r["k"] for r in rows]), np.array([r["v"] for r in rows]), ref)
    return dt


NAME = "groupby"
DESCRIPTION = ("group-by-sum of an Arrow table (int64 key, float64 value): twisternet KeyedReduce.send_table "
               "on W workers vs pyarrow and Polars (1 process) and Dask / PySpark DataFrames")


def measure(rows: int, distinct: int, workers: int, repeat: int,
            step: Callable[[str], None] = lambda what: None) -> tuple[dict[str, float], list[str]]:
    """Median seconds per implementation (every answer verified), and the peers skipped (with why)."""
    table = whole_table(rows, distinct, workers)
    ref = reference(table)
    peers: list[tuple[str, Callable[[], float]]] = [
        ("twisternet", lambda: run_twisternet(rows, distinct, workers, ref)),
        ("pyarrow (1 process)", lambda: run_pyarrow(table, ref)),
        ("polars (1 process)", lambda: run_polars(table, ref)),
        (f"dask ({workers} workers)", lambda: run_dask(table, ref, workers)),
        (f"pyspark local[{workers}]", lambda: run_spark(table, ref, workers)),
    ]
    times: dict[str, float] = {}
    skipped: list[str] = []
    for name, fn in peers:
        step(name)
        try:
            times[name] = median(fn() for _ in range(repeat))
        except ImportError as e:
            skipped.append(f"{name}: {e.name or e} not installed")
    return times, skipped


def run(opts: Any) -> Any:
    """The ``python -m benchmarks --suite groupby`` entry point."""
    from benchmarks.harness import SuiteResult, Table, Target
    t_start = time.monotonic()
    res = SuiteResult(NAME, description=DESCRIPTION)
    rows = opts.get("rows", 1_000_000 if opts.quick else 100_000_000)
    distinct = opts.get("distinct", 10_000 if opts.quick else 1_000_000)
    repeat = opts.repeats() if hasattr(opts, "repeats") else opts.repeat
    bar = opts.bar(NAME)
    bar.set_total(5 * len(opts.workers))
    for w in opts.workers:
        times, skipped = measure(rows, distinct, w, repeat, lambda what, w=w: bar.step(f"{what} x{w}"))
        res.skipped += [f"{s} ({w} workers)" for s in skipped]
        base = times["twisternet"]
        res.tables.append(Table(f"Group-by-sum of {rows:,} rows, {distinct:,} keys, {w} workers (median of {repeat})",
                                ["implementation", "seconds", "Mrows/s", "time / twisternet's"],
                                [[n, f"{t:.3f}", f"{rows / t / 1e6:.1f}", f"{t / base:.2f}"] for n, t in times.items()],
                                note="every answer checked against single-process pyarrow (keys exact, sums 1e-9)"))
        for peer in ("dask", "pyspark"):
            name = next((n for n in times if n.startswith(peer)), None)
            res.targets.append(Target(f"group-by, {w} workers, vs {peer}", "faster",
                                      f"{times[name] / base:.2f}x" if name else "peer not run",
                                      times[name] > base if name else None))
        res.raw[w] = times
    res.seconds = time.monotonic() - t_start
    bar.finish()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--distinct", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    print(f"group-by-sum: {args.rows:,} rows, {args.distinct:,} distinct int64 keys, float64 values, "
          f"{args.workers} workers, median of {args.repeat}")
    times, skipped = measure(args.rows, args.distinct, args.workers, args.repeat)
    for s in skipped:
        print(f"  skipped: {s}")
    base = times["twisternet"]
    print("| implementation | seconds | Mrows/s | time / twisternet's |\n|---|---|---|---|")
    for name, dt in times.items():
        print(f"| {name} | {dt:.3f} | {args.rows / dt / 1e6:.1f} | {dt / base:.2f}x |")


if __name__ == "__main__":
    main()
