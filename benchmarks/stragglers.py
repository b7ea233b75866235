"""Stragglers: a MapReduce-style job of R rounds over 8 local workers where, in every round, the
slowest map task takes 10x the median. Completion time with a classic barrier per round vs a
knee-released partial barrier (Albrecht et al., ATC 2006) whose left-out tasks are re-executed with
their input split evenly over the released workers (a late straggler gets CatchUp and skips ahead to
the barrier's current round).

    python -m benchmarks --suite stragglers [--quick] [--set stragglers.n=8] [--set stragglers.rounds=10]
    python benchmarks/stragglers.py [--workers 8] [--rounds 10] [--median 0.1] [--repeat 3] [--quick]

Task durations are simulated with sleep (deterministic per round and task), so the figure measures
synchronisation, not CPU: 8 workers on this 2-core machine do not compete for the processor.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median, run_tagged, twisternet_run
from benchmarks.harness import SuiteOptions, SuiteResult, Table, Target, ratio

NAME = "stragglers"
DESCRIPTION = ("MapReduce rounds with a 10x straggler per round: classic barrier vs knee-released partial "
               "barrier with re-execution (8 workers)")
SPEEDUP_TARGET = 3.0


def run(opts: SuiteOptions) -> SuiteResult:
    """Both synchronisation modes, alternating, ``repeat`` times; a table and the 3x speedup target.

    Overrides: ``n`` (workers, default 8; 4 when quick), ``rounds`` (10; 3), ``median`` (task seconds, 0.1; 0.05).
    """
    t0 = time.monotonic()
    n = opts.get("n", 4 if opts.quick else 8)
    rounds = opts.get("rounds", 3 if opts.quick else 10)
    med_task = opts.get("median", 0.05 if opts.quick else 0.1)
    if n < 2 or rounds < 1 or med_task <= 0:
        raise ValueError(f"stragglers needs n >= 2, rounds >= 1, median > 0 (got {n}, {rounds}, {med_task})")
    repeat = opts.repeats()
    bar = opts.bar(NAME)
    bar.set_total(2 * repeat)
    times: dict[str, list[float]] = {"classic": [], "partial": []}
    extra: dict[str, list[Any]] = {"classic": [], "partial": []}
    for rep in range(repeat):
        for mode in times:
            bar.step(f"run {rep + 1}/{repeat}: {mode} barrier")
            r = run_tagged(twisternet_run(n, "benchmarks/_stragglers_worker.py", mode, str(rounds), str(med_task)),
                           "STRAGGLERS")
            times[mode].append(float(r["seconds"]))
            extra[mode].append(r)
    c, p = median(times["classic"]), median(times["partial"])
    speedup = ratio(c, p)
    res = SuiteResult(suite=NAME, description=DESCRIPTION)
    res.tables.append(Table(
        f"{rounds} rounds x {n} workers, median task {med_task * 1e3:.0f} ms, slowest 10x (median of {repeat})",
        ["synchronisation", "job seconds", "speedup"],
        [["classic barrier", c, 1.0], ["partial barrier (knee) + re-execution", p, speedup]],
        note="task durations are simulated with sleep: the figure measures synchronisation, not CPU"))
    res.targets.append(Target(f"stragglers, {n} workers: partial barrier vs classic barrier",
                              f">= {SPEEDUP_TARGET:.0f}x faster job", f"{speedup:.2f}x" if speedup else "n/a",
                              None if speedup is None else speedup >= SPEEDUP_TARGET))
    res.raw = {"workers": n, "rounds": rounds, "median_task_s": med_task, "repeat": repeat, "seconds": times,
               "runs": extra}
    res.seconds = time.monotonic() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    """The standalone script (kept for compatibility): same as ``python -m benchmarks --suite stragglers``."""
    from benchmarks import report
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int)
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--median", type=float, help="median task time, seconds")
    ap.add_argument("--repeat", type=int)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    extra: dict[str, Any] = {k: v for k, v in (("n", a.workers), ("rounds", a.rounds), ("median", a.median))
                             if v is not None}
    opts = SuiteOptions(quick=a.quick, repeat=a.repeat or 3, repeat_given=bool(a.repeat), extra=extra)
    report.run_standalone(NAME, run, opts, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
