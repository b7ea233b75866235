"""The PySpark peer of the sort, group-by and word count suites (``pip install pyspark``; Java 17+).

    python benchmarks/_spark_peer.py sort      WORKERS LOCAL_DIR TOTAL_RECORDS
    python benchmarks/_spark_peer.py wordcount WORKERS LOCAL_DIR TOTAL_WORDS [SHARES]
    python benchmarks/_spark_peer.py groupby   WORKERS LOCAL_DIR PARQUET OUT_ARROW

What a PySpark user on one machine runs: ``local[W]`` with W = the twisternet worker count (the same
cores), ``LOCAL_DIR`` as ``spark.local.dir`` (shuffle and spill files) and the JVM's temp dir, the UI off.
Each run is timed in three parts, only the last of which is the figure compared with the others:

* ``startup_s``: starting the JVM and the SparkContext (the py4j gateway, ``spark-submit``);
* ``load_s``: generating the same input as the other implementations in W partitions and caching it
  (``count()`` forces it), as the others generate theirs in their workers before their clocks start;
* ``seconds``: from submitting the job to having its result in the driver (``collect()``,
  ``toArrow()``), where the suite then verifies it; ``cpu_s``: the CPU seconds the driver, the JVM and
  the Python workers used in that time (:func:`cpu_seconds`; a figure the machine's load hardly moves).

* sort: an RDD of the sort suite's ``(key, value)`` byte records, ``sortByKey(numPartitions=W)``, each
  output partition summarized where it lies (``_sort_data.summarize``: count, checksum, order,
  first/last key) and the summaries collected. PySpark's Python-side sort spills sorted runs to
  ``LOCAL_DIR`` once a Python worker passes ``spark.python.worker.memory`` (512 MB by default); the
  bytes Spark spilled are read back from its status store (``spilled_bytes``; None if unreadable).
* wordcount: an RDD of the demo's generated words in SHARES shares (default W; the cluster suite passes
  its rank count), ``map(w -> (w, 1)).reduceByKey(add).collect()``.
* groupby: the suite's table, written once to ``PARQUET``; ``spark.read.parquet`` then ``repartition(W)
  .cache()``, then ``groupBy("k").sum("v").toArrow()`` (written to ``OUT_ARROW`` as columns k, v_sum).

Prints ``SPARK {json}``. :func:`run` is the suites' side: a missing pyspark or java is
:func:`benchmarks.common.spark_missing`'s to say before calling it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

#: The driver JVM's heap (in local mode it is the executor too): the cached input (about 1.2x its
#: size for the 1 GB sort, pickled) and the shuffle fit, so spilling is the Python sort's, as intended.
DRIVER_MEMORY = {"sort": "4g", "wordcount": "4g", "groupby": "6g"}


def run(kind: str, workers: int, *args: Any, tmp: str | None = None) -> dict[str, Any]:
    """Run the peer ``kind`` on ``local[workers]`` in a fresh process with its spark.local.dir in a new
    directory under ``tmp`` (the system temp dir by default, where twisternet spills too); the dict it
    printed. RuntimeError (its output's end) if it printed none, subprocess.TimeoutExpired past
    ``common.PEER_TIMEOUT``."""
    from benchmarks.common import run_peer
    with tempfile.TemporaryDirectory(prefix=f"spark-{kind}-", dir=tmp) as local:
        return run_peer([sys.executable, str(HERE / "_spark_peer.py"), kind, str(workers), local,
                         *map(str, args)], "SPARK", "PySpark",
                        _env())


def _env() -> dict[str, str]:
    """The peer's environment: examples/ before benchmarks/ on the path of the driver and of the Python
    workers, so that ``wordcount`` is the demo's text generator, not the suite of the same name."""
    from benchmarks.common import ROOT, job_env
    env = job_env(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "examples"), str(ROOT / "benchmarks"), env["PYTHONPATH"]])
    return env


def _conf(kind: str, workers: int, local: str) -> Any:
    from pyspark import SparkConf
    return (SparkConf().setMaster(f"local[{workers}]").setAppName(f"twisternet-bench-{kind}")
            .set("spark.ui.enabled", "false")
            .set("spark.ui.showConsoleProgress", "false")
            .set("spark.local.dir", local)
            .set("spark.driver.memory", DRIVER_MEMORY[kind])
            .set("spark.driver.extraJavaOptions", f"-Djava.io.tmpdir={local}")
            .set("spark.default.parallelism", str(workers))
            .set("spark.sql.shuffle.partitions", str(workers)))


def spilled_bytes(sc: Any) -> int | None:
    """Bytes Spark's stages spilled to disk so far (its status store's diskBytesSpilled summed over
    the stages), or None where this Spark version's internals do not answer."""
    try:
        store = sc._jsc.sc().statusStore()
        gw = sc._gateway
        try:      # Spark 4: stageList(statuses, details, withSummaries, unsortedQuantiles, taskStatus)
            stages = store.stageList(None, False, False, gw.new_array(gw.jvm.double, 0), gw.jvm.java.util.ArrayList())
        except Exception:  # noqa: BLE001 - Spark 3: stageList(statuses)
            stages = store.stageList(None)
        return int(sum(stages.apply(i).diskBytesSpilled() for i in range(stages.size())))
    except Exception:  # noqa: BLE001 - a private API: its absence costs the figure, not the run
        return None


def cpu_seconds() -> float:
    """CPU seconds (user + system) used so far by this driver and every live process under it: the JVM
    and PySpark's Python daemon and workers (reused across tasks, so alive at both ends of the job)."""
    import psutil
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:       # a worker that ended in between: its CPU is lost to the figure
            pass
    return total


def _sort(sc: Any, workers: int, total: int) -> dict[str, Any]:
    import _sort_data as sd
    sc.addPyFile(str(HERE / "_sort_data.py"))   # the generator and the summary, for the Python workers
    t = time.perf_counter()
    rdd = sc.parallelize(range(workers), workers).flatMap(lambda r: sd.generate(r, workers, total)).cache()
    n = rdd.count()
    load = time.perf_counter() - t
    t, c = time.perf_counter(), cpu_seconds()
    parts = rdd.sortByKey(numPartitions=workers).mapPartitions(lambda it: [sd.summarize(it)]).collect()
    dt, cpu = time.perf_counter() - t, cpu_seconds() - c
    return {"seconds": dt, "cpu_s": cpu, "load_s": load, "n": n, "parts": parts, "spilled_bytes": spilled_bytes(sc)}


def _wordcount(sc: Any, workers: int, total: int, shares: int | None = None) -> dict[str, Any]:
    import operator

    from wordcount import generated_words
    shares = shares or workers
    sc.addPyFile(str(HERE.parent / "examples" / "wordcount.py"))   # the text generator, for the workers
    t = time.perf_counter()
    rdd = sc.parallelize(range(shares), shares).flatMap(lambda r: generated_words(r, shares, total)).cache()
    n = rdd.count()
    load = time.perf_counter() - t
    t, c = time.perf_counter(), cpu_seconds()
    counts = dict(rdd.map(lambda w: (w, 1)).reduceByKey(operator.add).collect())
    dt, cpu = time.perf_counter() - t, cpu_seconds() - c
    return {"seconds": dt, "cpu_s": cpu, "load_s": load, "words": n, "counts": counts}


def _groupby(spark: Any, workers: int, parquet: str, out: str) -> dict[str, Any]:
    import pyarrow as pa
    t = time.perf_counter()
    df = spark.read.parquet(parquet).repartition(workers).cache()
    n = df.count()
    load = time.perf_counter() - t
    t, c = time.perf_counter(), cpu_seconds()
    got = df.groupBy("k").sum("v").toArrow()
    dt, cpu = time.perf_counter() - t, cpu_seconds() - c
    got = got.rename_columns(["k", "v_sum"])
    with pa.OSFile(out, "wb") as f, pa.ipc.new_file(f, got.schema) as w:
        w.write_table(got)
    return {"seconds": dt, "cpu_s": cpu, "load_s": load, "rows": n, "groups": got.num_rows}


def main() -> None:
    kind, workers, local = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    args = sys.argv[4:]
    if kind not in DRIVER_MEMORY:
        raise SystemExit(f"unknown peer kind {kind!r} (sort, wordcount, groupby)")
    conf = _conf(kind, workers, local)
    t = time.perf_counter()
    if kind == "groupby":
        from pyspark.sql import SparkSession
        spark = SparkSession.builder.config(conf=conf).getOrCreate()
        sc = spark.sparkContext
    else:
        from pyspark import SparkContext
        sc = SparkContext(conf=conf)
    startup = time.perf_counter() - t
    sc.setLogLevel("ERROR")
    version = sc.version
    try:
        if kind == "sort":
            out = _sort(sc, workers, int(args[0]))
        elif kind == "wordcount":
            out = _wordcount(sc, workers, int(args[0]), int(args[1]) if len(args) > 1 else None)
        else:
            out = _groupby(spark, workers, args[0], args[1])
    finally:
        sc.stop()
    out.update(startup_s=startup, workers=workers, spark=version)
    print("SPARK " + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "examples"))
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    main()
