"""Streaming throughput of small messages: records ``(key, 1)`` (~16 bytes) through a streaming
KeyedReduce, messages per second per worker, vs mpi4py's per-message pickled ``isend``/``recv`` of the
same records in the same run.

    python benchmarks/streaming.py [--workers 2,4] [--repeat 3] [--quick]
    python -m benchmarks --suite streaming [--set streaming.messages=N]

twisternet is measured twice: with ``send_many`` batches of 1000 records (the batching into buffers the
target speaks of) and with one ``send`` per record. Every destination consumes every running-sum update
as it forms; each run checks that every record produced exactly one update and the sums add up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median, mpiexec_run, run_tagged, twisternet_run
from benchmarks import report
from benchmarks.harness import SuiteOptions, SuiteResult, Table, Target

NAME = "streaming"
DESCRIPTION = ("small messages (~16 B) through a streaming KeyedReduce, messages/s per worker: "
               "twisternet batched and per record vs mpi4py pickled isend/recv")


def _twisternet(workers: int, messages: int, batch: int) -> float:
    import subprocess
    cmd = twisternet_run(workers, "benchmarks/_streaming_worker.py", str(messages), str(batch))
    from benchmarks.common import ROOT, job_env
    p = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    import json
    rate = None
    checks = []
    for line in p.stdout.splitlines():
        body = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
        if body.startswith("STREAM "):
            rate = json.loads(body[7:])["min_rate"]
        elif body.startswith("CHECK "):
            checks.append(json.loads(body[6:]))
    if rate is None or len(checks) != workers:
        raise RuntimeError(f"streaming run failed (exit {p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")
    if sum(c["updates"] for c in checks) != workers * messages or sum(c["sum"] for c in checks) != workers * messages:
        raise RuntimeError(f"streaming run lost or duplicated records: {checks}")
    return float(rate)


def _mpi4py(workers: int, messages: int) -> float | None:
    cmd = mpiexec_run(workers, "benchmarks/_streaming_mpi4py.py", str(messages))
    if cmd is None:
        return None
    d = run_tagged(cmd, "STREAM", timeout=900)
    if d["total"] != workers * messages:
        raise RuntimeError(f"mpi4py run lost records: {d}")
    return float(d["min_rate"])


def run(opts: SuiteOptions) -> SuiteResult:
    res = SuiteResult(NAME)
    messages = opts.get("messages", 20_000 if opts.quick else 1_000_000)
    single = max(1000, messages // 10)          # per-record sends are ~10x slower: fewer of them
    repeat = opts.repeats()
    import importlib.util
    have_mpi = importlib.util.find_spec("mpi4py") is not None and mpiexec_run(2, "x") is not None
    if not have_mpi:
        res.skipped.append("mpi4py: not installed or no mpiexec (pip install '.[mpi]')")
    bar = opts.bar(NAME)
    bar.set_total(repeat * len(opts.workers) * (3 if have_mpi else 2))
    raw: dict[str, Any] = {"messages": messages, "per_record_messages": single, "runs": {}}
    rows = []
    for w in opts.workers:
        runs: dict[str, list[float]] = {"batched": [], "per_record": [], "mpi4py": []}
        for rep in range(repeat):
            bar.step(f"{w} workers, run {rep + 1}/{repeat}: twisternet send_many")
            runs["batched"].append(_twisternet(w, messages, 1000))
            bar.step(f"{w} workers, run {rep + 1}/{repeat}: twisternet send per record")
            runs["per_record"].append(_twisternet(w, single, 1))
            if have_mpi:
                bar.step(f"{w} workers, run {rep + 1}/{repeat}: mpi4py isend/recv")
                runs["mpi4py"].append(_mpi4py(w, messages))
        raw["runs"][w] = runs
        b, s = median(runs["batched"]), median(runs["per_record"])
        m = median(runs["mpi4py"]) if runs["mpi4py"] else None
        rows.append([w, f"{b:,.0f}", f"{s:,.0f}", f"{m:,.0f}" if m else "n/a", f"{b / m:.2f}" if m else "n/a"])
        res.targets.append(Target(f"streaming, {w} workers: messages/s per worker (batched)", ">= 500,000",
                                  f"{b:,.0f}", b >= 500_000))
        if w == 2:      # issue 22: one send() per record, not send_many
            res.targets.append(Target("streaming, 2 workers: records/s per worker, one send() per record",
                                      ">= 300,000", f"{s:,.0f}", s >= 300_000))
        if m:
            res.targets.append(Target(f"streaming, {w} workers: twisternet batched vs mpi4py per-message send",
                                      ">= 10x", f"{b / m:.2f}x", b / m >= 10))
    res.tables.append(Table(
        f"Messages per second per worker (slowest worker; median of {repeat}); {messages:,} records per worker "
        f"({single:,} for per-record sends)",
        ["workers", "twisternet send_many", "twisternet send", "mpi4py isend/recv", "batched / mpi4py"], rows,
        note="records (key, 1) with 6-character keys routed by key; every update consumed and checked"))
    if len(opts.workers) and max(opts.workers) > 2:
        res.notes.append("more workers than the machine's 2 cores: per-worker rates drop for every implementation")
    res.raw = raw
    bar.finish()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="2")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    workers = [int(x) for x in a.workers.split(",")]
    report.run_standalone(NAME, run, SuiteOptions(quick=a.quick, repeat=a.repeat, workers=workers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
