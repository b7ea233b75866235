"""Collectives of Python records: gather / allgather / broadcast / partition of N small dicts per worker
(``{"id", "name", "score"}``), twisternet vs mpi4py's lowercase (pickle) collectives and torch.distributed's
``*_object`` collectives (gloo), measured in the same run.

    python -m benchmarks --suite records [--set records.records=N] [--workers 2,4]

Each op is timed from a barrier until every destination holds the records as Python objects (the slowest
rank's time) and checked (count and id sum at every destination). twisternet uses ``send_many`` for
gather/allgather, one record (the whole list) for broadcast, one list per destination for partition,
as mpi4py's ``alltoall`` does; it passes ``copy=False`` (the lists are not changed afterwards, as with
mpi4py, whose ``bcast`` hands the root its own object back), reads batch results with ``values()``
and runs with ``memory_limit`` 4 GB so that, like its peers, it keeps everything in memory (the
default 256 MB bound would spill 1M records at 4 workers to disk). torch has no all-to-all for
objects: its partition column is n/a.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, job_env, median, mpiexec_run, run_tagged, twisternet_run
from benchmarks import report
from benchmarks.harness import SuiteOptions, SuiteResult, Table, Target

NAME = "records"
DESCRIPTION = ("gather/allgather/broadcast/partition of small dict records: twisternet vs mpi4py pickle "
               "collectives and torch *_object")
OPS = ("gather", "allgather", "broadcast", "partition")


def _check(d: dict[str, Any], who: str) -> dict[str, float]:
    if d["bad"]:
        raise RuntimeError(f"{who}: wrong results for {d['bad']}")
    return d["seconds"]


def _torch(n: int, records: int) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(ROOT / "benchmarks/_records_peer.py"), "torch", str(records),
                               str(r), str(n), str(port)], env=job_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(n)]
    outs = [p.communicate(timeout=900) for p in procs]
    import json
    for out, _ in outs:
        for line in out.splitlines():
            if line.startswith("RECORDS "):
                return _check(json.loads(line[8:]), "torch")
    raise RuntimeError("torch run printed nothing:\n" + "\n".join(e[-1500:] for _, e in outs))


def run(opts: SuiteOptions) -> SuiteResult:
    res = SuiteResult(NAME)
    records = opts.get("records", 5_000 if opts.quick else 250_000)
    repeat = opts.repeats()
    have_mpi = importlib.util.find_spec("mpi4py") is not None and mpiexec_run(2, "x") is not None
    have_torch = importlib.util.find_spec("torch") is not None
    if not have_mpi:
        res.skipped.append("mpi4py: not installed or no mpiexec (pip install '.[mpi]')")
    if not have_torch:
        res.skipped.append("torch *_object: torch is not installed (pip install '.[bench]')")
    bar = opts.bar(NAME)
    bar.set_total(repeat * len(opts.workers) * (1 + have_mpi + have_torch))
    raw: dict[str, Any] = {"records": records, "runs": {}}
    for w in opts.workers:
        runs: dict[str, list[dict[str, float]]] = {"twisternet": [], "mpi4py": [], "torch": []}
        for rep in range(repeat):
            bar.step(f"{w} workers, run {rep + 1}/{repeat}: twisternet")
            runs["twisternet"].append(_check(run_tagged(twisternet_run(w, "benchmarks/_records_peer.py", "tn",
                                                                       str(records)), "RECORDS"), "twisternet"))
            if have_mpi:
                bar.step(f"{w} workers, run {rep + 1}/{repeat}: mpi4py")
                runs["mpi4py"].append(_check(run_tagged(mpiexec_run(w, "benchmarks/_records_peer.py", "mpi",
                                                                    str(records)), "RECORDS"), "mpi4py"))
            if have_torch:
                bar.step(f"{w} workers, run {rep + 1}/{repeat}: torch")
                runs["torch"].append(_torch(w, records))
        raw["runs"][w] = runs
        rows = []
        for op in OPS:
            tn_t = median([r[op] for r in runs["twisternet"]])
            mp = median([r[op] for r in runs["mpi4py"]]) if runs["mpi4py"] else None
            to = median([r[op] for r in runs["torch"]]) if runs["torch"] and op in runs["torch"][0] else None
            rows.append([op, f"{tn_t:.3f}", f"{mp:.3f}" if mp else "n/a", f"{to:.3f}" if to else "n/a",
                         f"{mp / tn_t:.2f}" if mp else "n/a", f"{to / tn_t:.2f}" if to else "n/a"])
            for peer, t in (("mpi4py", mp), ("torch *_object", to)):
                if t:
                    res.targets.append(Target(f"records {op}, {w} workers: twisternet vs {peer}", ">= 2x faster",
                                              f"{t / tn_t:.2f}x ({tn_t:.3f} s vs {t:.3f} s)", t / tn_t >= 2))
        res.tables.append(Table(f"{w} workers, {records:,} dict records per worker: seconds (median of {repeat})",
                                ["op", "twisternet", "mpi4py", "torch", "mpi4py / twisternet",
                                 "torch / twisternet"], rows,
                                note="speedups above 1: twisternet faster; every result checked"))
    res.raw = raw
    bar.finish()
    return res


def main(argv: list[str] | None = None) -> int:
    import argparse
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
