"""Collectives of tables: gather / allgather / broadcast / partition of the records suite's data (N
records ``{"id", "name", "score"}`` per worker) as one Arrow table per worker with ``send_table`` /
``result_table``, vs mpi4py's pickle collectives and twisternet's record path on the same records as
dicts (``benchmarks/_records_peer.py``), in the same run.

    python benchmarks/tables.py [--records 1000000] [--workers 2] [--repeat 3]

Each op is timed from a barrier until every destination holds its result (a ``pyarrow.Table``, or the
Python records for the peers; the slowest rank's time) and checked (row count and id sum at every
destination). Ratios are the peer's time over the table path's. The issue's target: tables >= 5x faster
than mpi4py for each op. (Not yet a ``python -m benchmarks`` suite.)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import mpiexec_run, run_tagged, twisternet_run

OPS = ("gather", "allgather", "broadcast", "partition")


def runs(cmd: list[str], tag: str, repeat: int) -> dict[str, float]:
    out = [run_tagged(cmd, tag, timeout=1800) for _ in range(repeat)]
    for o in out:
        if o["bad"]:
            raise RuntimeError(f"{cmd[-2]}: wrong results for {o['bad']}")
    return {op: median(o["seconds"][op] for o in out) for op in OPS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n, w = str(args.records), args.workers
    results = {"twisternet tables": runs(twisternet_run(w, "benchmarks/_tables_peer.py", n), "TABLES", args.repeat),
               "twisternet records": runs(twisternet_run(w, "benchmarks/_records_peer.py", "tn", n), "RECORDS",
                                          args.repeat)}
    mpi = mpiexec_run(w, "benchmarks/_records_peer.py", "mpi", n)
    if mpi is not None and importlib.util.find_spec("mpi4py") is not None:
        results["mpi4py pickle"] = runs(mpi, "RECORDS", args.repeat)
    else:
        print("mpi4py: skipped (not installed)")
    base = results["twisternet tables"]
    print(f"{args.records:,} records per worker, {w} workers, median of {args.repeat} (seconds; ratio = "
          f"time / tables' time)")
    print("| implementation | " + " | ".join(OPS) + " |\n|---|" + "---|" * len(OPS))
    for name, secs in results.items():
        print(f"| {name} | " + " | ".join(f"{secs[op]:.3f} ({secs[op] / base[op]:.1f}x)" for op in OPS) + " |")


if __name__ == "__main__":
    main()
