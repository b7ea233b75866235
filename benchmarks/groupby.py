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
Peers that are not installed are reported as skipped. PySpark (``benchmarks/_spark_peer.py``,
``local[W]``, its own process) reads the table from a Parquet file written before, caches it, and is timed
from submitting ``groupBy("k").sum("v")`` to its Arrow result in the driver; its JVM start-up is shown
apart. Polars in one process is the local ceiling. Issue #23's target: twisternet on 2 workers faster
than Dask and PySpark. Also the ``groupby`` suite of ``python -m benchmarks``
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


#: JVM start-up seconds of each PySpark run, in order (reported apart from its timed seconds), and the
#: CPU seconds its processes (driver, JVM, Python workers) used in the timed part.
SPARK_STARTUP: list[float] = []
SPARK_CPU: list[float | None] = []


def run_spark(parquet: str, ref: Any, workers: int) -> float:
    """PySpark local[workers] ``groupBy("k").sum("v")`` of the table written to ``parquet`` (read and
    cached before the clock starts; ``benchmarks/_spark_peer.py``), its Arrow result verified here."""
    import pyarrow as pa
    from benchmarks import _spark_peer
    with tempfile.TemporaryDirectory(prefix="spark-groupby-out-") as d:
        out = os.path.join(d, "out.arrow")
        r = _spark_peer.run("groupby", workers, parquet, out)
        got = pa.ipc.open_file(out).read_all()
    SPARK_STARTUP.append(r["startup_s"])
    SPARK_CPU.append(r.get("cpu_s"))
    verify("pyspark", got.column("k").to_numpy(), got.column("v_sum").to_numpy(), ref)
    return r["seconds"]


def spark_input(table: Any, where: str) -> str:
    """``table`` written once as Parquet under ``where`` (PySpark's input; not timed)."""
    import pyarrow.parquet as pq
    path = os.path.join(where, "table.parquet")
    pq.write_table(table, path)
    return path


NAME = "groupby"
DESCRIPTION = ("group-by-sum of an Arrow table (int64 key, float64 value): twisternet KeyedReduce.send_table "
               "on W workers vs pyarrow and Polars (1 process) and Dask / PySpark DataFrames")


def measure(rows: int, distinct: int, workers: int, repeat: int,
            step: Callable[[str], None] = lambda what: None, spark: bool = True,
            dask: bool = True) -> tuple[dict[str, float], list[str]]:
    """Median seconds per implementation (every answer verified), and the peers skipped (with why).
    ``spark`` / ``dask`` False: leave that peer out (reported as skipped)."""
    from benchmarks.common import spark_missing
    table = whole_table(rows, distinct, workers)
    ref = reference(table)
    skipped: list[str] = []
    spark_name = f"pyspark local[{workers}]"
    spark_why = (spark_missing() if spark
                 else "left out on request or of a quick run (--set groupby.spark=1 includes it)")
    with tempfile.TemporaryDirectory(prefix="groupby-spark-in-") as where:
        peers: list[tuple[str, Callable[[], float]]] = [
            ("twisternet", lambda: run_twisternet(rows, distinct, workers, ref)),
            ("pyarrow (1 process)", lambda: run_pyarrow(table, ref)),
            ("polars (1 process)", lambda: run_polars(table, ref)),
        ]
        if dask:
            peers.append((f"dask ({workers} workers)", lambda: run_dask(table, ref, workers)))
        else:
            skipped.append(f"dask ({workers} workers): left out on request (--set groupby.dask=1 includes it)")
        if spark_why:
            skipped.append(f"{spark_name}: {spark_why}")
        else:
            parquet = spark_input(table, where)
            peers.append((spark_name, lambda: run_spark(parquet, ref, workers)))
        times: dict[str, float] = {}
        for name, fn in peers:
            step(name)
            try:
                times[name] = median(fn() for _ in range(repeat))
            except ImportError as e:
                skipped.append(f"{name}: {e.name or e} not installed")
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                if name != spark_name or "wrong" in str(e):    # a wrong answer fails the suite
                    raise
                from benchmarks.common import failure_reason
                skipped.append(f"{name}: failed: {failure_reason(e)}")
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
    # PySpark (a JVM start per run) is left out of quick runs unless asked for, as in the other suites
    spark, dask = bool(int(opts.get("spark", 0 if opts.quick else 1))), bool(int(opts.get("dask", 1)))
    for w in opts.workers:
        SPARK_STARTUP.clear()
        times, skipped = measure(rows, distinct, w, repeat, lambda what, w=w: bar.step(f"{what} x{w}"),
                                 spark=spark, dask=dask)
        res.skipped += [f"{s} ({w} workers)" for s in skipped]
        base = times["twisternet"]
        res.tables.append(Table(f"Group-by-sum of {rows:,} rows, {distinct:,} keys, {w} workers (median of {repeat})",
                                ["implementation", "seconds", "Mrows/s", "time / twisternet's"],
                                [[n, f"{t:.3f}", f"{rows / t / 1e6:.1f}", f"{t / base:.2f}"] for n, t in times.items()],
                                note="every answer checked against single-process pyarrow (keys exact, sums 1e-9); "
                                     "Polars in 1 process is the local ceiling"
                                     + (f"; PySpark's JVM start-up, not timed: {median(SPARK_STARTUP):.1f} s"
                                        if SPARK_STARTUP else "")))
        for peer in ("dask", "pyspark"):
            name = next((n for n in times if n.startswith(peer)), None)
            res.targets.append(Target(f"group-by, {w} workers, vs {peer}", "faster",
                                      f"{times[name] / base:.2f}x" if name else "peer not run",
                                      times[name] > base if name else None))
        res.raw[w] = {**times, "pyspark startup_s": list(SPARK_STARTUP)}
    res.seconds = time.monotonic() - t_start
    bar.finish()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--distinct", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--spark", type=int, default=1, help="0: leave PySpark out")
    ap.add_argument("--dask", type=int, default=1, help="0: leave Dask out")
    args = ap.parse_args()
    print(f"group-by-sum: {args.rows:,} rows, {args.distinct:,} distinct int64 keys, float64 values, "
          f"{args.workers} workers, median of {args.repeat}")
    SPARK_STARTUP.clear()
    times, skipped = measure(args.rows, args.distinct, args.workers, args.repeat, spark=bool(args.spark),
                             dask=bool(args.dask))
    for s in skipped:
        print(f"  skipped: {s}")
    base = times["twisternet"]
    print("| implementation | seconds | Mrows/s | time / twisternet's |\n|---|---|---|---|")
    for name, dt in times.items():
        print(f"| {name} | {dt:.3f} | {args.rows / dt / 1e6:.1f} | {dt / base:.2f}x |")
    if SPARK_STARTUP:
        print(f"PySpark JVM start-up (not timed): median {median(SPARK_STARTUP):.1f} s of {len(SPARK_STARTUP)}; "
              f"CPU of its timed part (all its processes): {SPARK_CPU}")


if __name__ == "__main__":
    main()
