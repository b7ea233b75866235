"""Stragglers: a MapReduce-style job of R rounds over 8 local workers where, in every round, the
slowest map task takes 10x the median. Completion time with a classic barrier per round vs a
knee-released partial barrier (Albrecht et al., ATC 2006) whose left-out tasks are re-executed with
their input split evenly over the released workers (a late straggler gets CatchUp and skips ahead to
the barrier's current round).

    python benchmarks/stragglers.py [--workers 8] [--rounds 10] [--median 0.1] [--repeat 3] [--quick]

Task durations are simulated with sleep (deterministic per round and task), so the figure measures
synchronisation, not CPU: 8 workers on this 2-core machine do not compete for the processor.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median, run_tagged, table, twisternet_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--median", type=float, default=0.1, help="median task time, seconds")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if a.quick:
        a.workers, a.rounds, a.median, a.repeat = 4, 3, 0.05, 1
    times: dict[str, list[float]] = {"classic": [], "partial": []}
    for rep in range(a.repeat):
        for mode in times:
            print(f"[stragglers] run {rep + 1}/{a.repeat}: {mode} barrier ...", file=sys.stderr, flush=True)
            r = run_tagged(twisternet_run(a.workers, "benchmarks/_stragglers_worker.py", mode, str(a.rounds),
                                          str(a.median)), "STRAGGLERS")
            times[mode].append(r["seconds"])
    c, p = median(times["classic"]), median(times["partial"])
    print(f"\n{a.rounds} rounds x {a.workers} workers, median task {a.median * 1e3:.0f} ms, slowest 10x "
          f"(median of {a.repeat})")
    print(table(["synchronisation", "job seconds", "speedup"],
                [["classic barrier", f"{c:.2f}", "1.00"],
                 ["partial barrier (knee) + re-execution", f"{p:.2f}", f"{c / p:.2f}"]]))
    print(f"\nTarget: >= 3x; measured {c / p:.2f}x ({'met' if c / p >= 3 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
