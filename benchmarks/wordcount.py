"""Word count of N words (default 20 million): twisternet batch KeyedReduce on W local workers vs a
single-process ``collections.Counter``, PySpark local mode (``reduceByKey``) and Dask (``Bag.frequencies``
on a ``LocalCluster`` of W worker processes), on the same generated Zipf text, measured in the same run.

    python benchmarks/wordcount.py [--words 20000000] [--workers 2] [--repeat 3] [--spark 1] [--dask 1] [--quick]
    python -m benchmarks --suite wordcount [--set wordcount.words=N]

Timed: counting and the distributed reduce (every key reduced at its destination); not timed anywhere:
generating the text (each side then runs one full garbage collection so that no side pays for the
input's first one). twisternet's time is the slowest worker's. PySpark (``pip install pyspark``, Java
17; ``benchmarks/_spark_peer.py``) runs ``local[W]`` on an RDD of the same words generated and cached in
its W partitions, timed from submitting ``reduceByKey`` to the collected counts (its JVM start-up is
shown apart); Dask
(``benchmarks/_dask_peer.py``) on a Bag of the same words generated and persisted in its W worker
processes. Every run is checked: each implementation must count every word, and every table of counts
must equal the Counter's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from benchmarks.common import (ROOT, choose_peers, job_env, median, peer_env, run_peer, try_peer,
                               twisternet_run, versus_spark)
from benchmarks import report
from benchmarks.harness import SuiteOptions, SuiteResult, Table, Target
from wordcount import generated_words
from benchmarks import _spark_peer

NAME = "wordcount"
DESCRIPTION = ("batch KeyedReduce word count of 20M Zipf words: twisternet on W workers vs "
               "collections.Counter (1 process), PySpark local[W] reduceByKey and Dask Bag.frequencies")


class WrongAnswer(RuntimeError):
    """A peer finished but counted wrong (an error of the run, unlike a peer that crashed)."""


def digest(counts: dict[str, int]) -> str:
    """An order-independent fingerprint of a word -> count table (to compare implementations)."""
    h = hashlib.sha256()
    for w in sorted(counts):
        h.update(f"{w}\t{counts[w]}\n".encode())
    return h.hexdigest()[:16]


def run_twisternet(workers: int, words: int) -> tuple[float, int, str]:
    p = subprocess.run(twisternet_run(workers, "benchmarks/_wordcount_worker.py", str(words)), env=job_env(),
                       capture_output=True, text=True, timeout=1800)
    rows = [json.loads(line.split("WC ", 1)[1]) for line in p.stdout.splitlines() if "WC " in line]
    if len(rows) != workers:
        raise RuntimeError(f"twisternet run failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    counted = sum(r["words"] for r in rows)
    if counted != words:
        raise RuntimeError(f"twisternet counted {counted} words, expected {words}")
    merged: dict[str, int] = {}
    for r in rows:
        merged.update(r["counts"])
    CPU["twisternet"].append(sum(r.get("cpu_s", 0.0) for r in rows))
    return max(r["seconds"] for r in rows), counted, digest(merged)


def run_counter(words: int, shares: int) -> tuple[float, str]:
    """Counter over the very text the ``shares`` workers count (their shares, concatenated)."""
    import gc
    text: list[str] = []
    for r in range(shares):
        text += generated_words(r, shares, words)
    gc.collect()
    t = time.perf_counter()
    c = Counter(text)
    dt = time.perf_counter() - t
    if sum(c.values()) != words:
        raise RuntimeError("Counter lost words")
    return dt, digest(dict(c))


def _counted(d: dict[str, Any], who: str, words: int) -> tuple[float, int, str]:
    if sum(d["counts"].values()) != words or d["words"] != words:
        raise WrongAnswer(f"{who} lost words")
    return d["seconds"], d["words"], digest(d["counts"])


#: JVM start-up seconds of each PySpark run, in order (reported apart from its timed seconds).
SPARK_STARTUP: list[float] = []
#: CPU seconds (all processes, timed part) of each run, by implementation: twisternet and PySpark.
CPU: dict[str, list[float]] = {"twisternet": [], "PySpark": []}


def run_spark(workers: int, words: int) -> tuple[float, int, str]:
    """PySpark local[workers] reduceByKey over the same words (``benchmarks/_spark_peer.py``)."""
    d = _spark_peer.run("wordcount", workers, words)
    SPARK_STARTUP.append(d["startup_s"])
    CPU["PySpark"].append(d.get("cpu_s", 0.0))
    return _counted(d, "PySpark", words)


def run_dask(workers: int, words: int) -> tuple[float, int, str]:
    with tempfile.TemporaryDirectory(prefix="dask-wc-") as d:         # the workers' scratch space
        out = run_peer([sys.executable, str(ROOT / "benchmarks" / "_dask_peer.py"), "wordcount", str(words),
                        str(workers)], "DASK", "Dask", peer_env(DASK_LOCAL_DIR=d))
    return _counted(out, "Dask", words)


def run(opts: SuiteOptions) -> SuiteResult:
    t_start = time.monotonic()
    res = SuiteResult(NAME, description=DESCRIPTION)
    words = opts.get("words", 200_000 if opts.quick else 20_000_000)
    repeat = opts.repeats()
    active = choose_peers(opts, NAME, res.skipped)
    runners = {"PySpark": run_spark, "Dask": run_dask}
    workers = list(opts.workers)
    bar = opts.bar(NAME)
    bar.set_total(repeat * len(workers) * (2 + len(active)))
    raw: dict[str, Any] = {"words": words, "counter": {}, "twisternet": {}, "spark": {}, "dask": {}}
    field = {"PySpark": "spark", "Dask": "dask"}
    startup: dict[int, list[float]] = {}
    cpu: dict[str, dict[int, list[float]]] = {"twisternet": {}, "PySpark": {}}
    failed: set[str] = set()       # peers that crashed or timed out (a wrong answer raises instead)
    for rep in range(repeat):
        for w in workers:
            bar.step(f"run {rep + 1}/{repeat}: Counter over the text of {w} shares")
            dt, ref = run_counter(words, w)
            raw["counter"].setdefault(w, []).append(dt)
            bar.step(f"run {rep + 1}/{repeat}: twisternet x{w}")
            n_cpu = len(CPU["twisternet"])
            t, _, d = run_twisternet(w, words)
            if len(CPU["twisternet"]) > n_cpu:
                cpu["twisternet"].setdefault(w, []).append(CPU["twisternet"][-1])
            if d != ref:
                raise RuntimeError(f"twisternet x{w} counts differ from Counter's")
            raw["twisternet"].setdefault(w, []).append(t)
            for name in active:
                left_out = " (left out: it failed)" if name in failed else ""
                bar.step(f"run {rep + 1}/{repeat}: {name} x{w}{left_out}")
                got = try_peer(name, lambda name=name, w=w: runners[name](w, words), failed, res.skipped,
                               f"{w} workers", wrong=WrongAnswer)    # a wrong answer is an error, not a skipped peer
                if got is None:
                    continue
                t, _, d = got
                if name == "PySpark" and SPARK_STARTUP:
                    startup.setdefault(w, []).append(SPARK_STARTUP[-1])
                    cpu["PySpark"].setdefault(w, []).append(CPU["PySpark"][-1])
                if d != ref:
                    raise RuntimeError(f"{name} x{w} counts differ from Counter's")
                raw[field[name]].setdefault(w, []).append(t)
    rows = []
    for w in workers:
        ref_t = median(raw["counter"][w])
        rows.append([f"collections.Counter, 1 process (text of {w} shares)", f"{ref_t:.2f}",
                     f"{words / ref_t:,.0f}", "1.00", "n/a", "n/a"])
        t = median(raw["twisternet"][w])
        peer_t = {name: median(raw[field[name]][w]) for name in active if raw[field[name]].get(w)}
        tn_cpu = f" (CPU {median(cpu['twisternet'][w]):.1f} s)" if cpu["twisternet"].get(w) else ""
        rows.append([f"twisternet KeyedReduce, {w} workers{tn_cpu}", f"{t:.2f}", f"{words / t:,.0f}",
                     f"{ref_t / t:.2f}",
                     *(f"{peer_t[n] / t:.1f}" if n in peer_t else "n/a" for n in ("PySpark", "Dask"))])
        for name, pt in peer_t.items():
            label = f"PySpark local[{w}] reduceByKey" if name == "PySpark" else f"Dask Bag.frequencies, {w} workers"
            if name == "PySpark" and startup.get(w):
                label += (f" (CPU {median(cpu['PySpark'][w]):.1f} s; JVM start-up {median(startup[w]):.1f} s, "
                          "not timed)")
            rows.append([label, f"{pt:.2f}", f"{words / pt:,.0f}", f"{ref_t / pt:.2f}",
                         *("1.0" if n == name else "" for n in ("PySpark", "Dask"))])
        target = versus_spark(f"word count, {w} workers", t, peer_t.get("PySpark"), "PySpark" in failed)
        if target:
            res.targets.append(target)
        if w == 2:
            res.targets.append(Target("word count, 2 workers vs one process running Counter", ">= 1.5x faster",
                                      f"{ref_t / t:.2f}x ({t:.2f} s vs {ref_t:.2f} s)", ref_t / t >= 1.5))
    res.tables.append(Table(f"Word count of {words:,} words (median of {repeat})",
                            ["implementation", "seconds", "words/s", "speedup vs Counter", "PySpark / this",
                             "Dask / this"], rows,
                            note="every run checked: the same word -> count table as collections.Counter"))
    raw["spark_startup_s"] = startup
    raw["cpu_s"] = cpu
    res.raw = raw
    res.seconds = time.monotonic() - t_start
    bar.finish()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", type=int, default=None)
    ap.add_argument("--workers", default="2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--spark", type=int, default=None, help="1: include PySpark, 0: leave it out")
    ap.add_argument("--dask", type=int, default=None, help="1: include Dask, 0: leave it out")
    a = ap.parse_args(argv)
    extra: dict[str, Any] = {}
    if a.words:
        extra["words"] = str(a.words)
    if a.spark is not None:
        extra["spark"] = str(a.spark)
    if a.dask is not None:
        extra["dask"] = str(a.dask)
    workers = [int(x) for x in a.workers.split(",")]
    report.run_standalone(NAME, run, SuiteOptions(quick=a.quick, repeat=a.repeat, workers=workers,
                                                  extra=extra))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
