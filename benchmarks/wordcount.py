"""Word count of N words (default 20 million): twisternet batch KeyedReduce on W local workers vs a
single-process ``collections.Counter``, on the same generated Zipf text, measured in the same run.

    python benchmarks/wordcount.py [--words 20000000] [--workers 2] [--repeat 3] [--quick]

Timed: counting and the distributed reduce (every key reduced at its destination); not timed in either
case: generating the text. twisternet's time is the slowest worker's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from benchmarks.common import job_env, median, table, twisternet_run  # noqa: E402
from wordcount import generated_words  # noqa: E402


def run_twisternet(workers: int, words: int) -> tuple[float, int]:
    import json
    import subprocess
    p = subprocess.run(twisternet_run(workers, "benchmarks/_wordcount_worker.py", str(words)), env=job_env(),
                       capture_output=True, text=True, timeout=1800)
    rows = [json.loads(l.split("WC ", 1)[1]) for l in p.stdout.splitlines() if "WC " in l]
    if len(rows) != workers:
        raise RuntimeError(f"twisternet run failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    counted = sum(r["words"] for r in rows)
    if counted != words:
        raise RuntimeError(f"twisternet counted {counted} words, expected {words}")
    return max(r["seconds"] for r in rows), counted


def run_counter(words: int) -> float:
    text = generated_words(0, 1, words)
    t = time.perf_counter()
    c = Counter(text)
    dt = time.perf_counter() - t
    assert sum(c.values()) == words
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--words", type=int, default=20_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    if a.quick:
        a.words, a.repeat = 200_000, 1
    tn_times, ref_times = [], []
    for rep in range(a.repeat):
        print(f"[wordcount] run {rep + 1}/{a.repeat}: twisternet x{a.workers} ...", file=sys.stderr, flush=True)
        tn_times.append(run_twisternet(a.workers, a.words)[0])
        print(f"[wordcount] run {rep + 1}/{a.repeat}: Counter ...", file=sys.stderr, flush=True)
        ref_times.append(run_counter(a.words))
    t, r = median(tn_times), median(ref_times)
    print(f"\nword count of {a.words:,} words (median of {a.repeat})")
    print(table(["implementation", "seconds", "words/s", "speedup vs Counter"],
                [[f"twisternet KeyedReduce, {a.workers} workers", f"{t:.2f}", f"{a.words / t:,.0f}", f"{r / t:.2f}"],
                 ["collections.Counter, 1 process", f"{r:.2f}", f"{a.words / r:,.0f}", "1.00"]]))
    print(f"\nTarget: {a.workers} workers >= 1.5x the single process; measured {r / t:.2f}x "
          f"({'met' if r / t >= 1.5 else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
