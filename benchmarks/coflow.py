"""Coflow scheduling, live: completion times of a big and a small concurrent Partition per policy.

Four workers (two when quick) in their own network namespaces, each link shaped to 100 Mbit/s with
``tc tbf``; every rank sends ``big_mb`` MB in a big Partition and, ``delay`` seconds later, ``small_mb``
MB in a small one. The coflow completion time (CCT) of each is reported per ``coflow_policy``; with a
size-aware policy (sebf) the small coflow should overtake the big one's backlog. Needs root (namespaces).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import median
from benchmarks.harness import SuiteOptions, SuiteResult, Table, Target, ratio

NAME = "coflow"
DESCRIPTION = ("Live coflow scheduling: CCT of a small Partition started just after a big one, per policy "
               "(workers in tbf-shaped network namespaces)")
#: Policies run by default; "<policy>+pace" also paces each flow to its policy rate (token buckets),
#: with the policies told the real link capacity.
POLICIES = ("none", "fifo", "fair", "fair+pace", "sebf")
# 256 KiB buffers (finer slices) with the default pool memory (64 MiB)
_ENV = {"TWISTERNET_BUFFER_SIZE": "256k", "TWISTERNET_POOL_BUFFERS": "256",
        "TWISTERNET_COFLOW_INFLIGHT": "256k"}


def run(opts: SuiteOptions) -> SuiteResult:
    """Every policy, ``repeat`` times; a table of median CCTs and the small-coflow speedup target.

    Overrides: ``n`` (workers, 4; 2 when quick), ``big_mb`` (16; 8), ``small_mb`` (0.5; 0.25),
    ``delay`` (0.3 s; 0.2), ``rate`` (link Mbit/s, 100), ``policies`` (comma list; ``fair+pace`` = with pacing).
    """
    from benchmarks._coflow_netns import Testbed, ccts, netns_unavailable
    t0 = time.monotonic()
    res = SuiteResult(suite=NAME, description=DESCRIPTION)
    why = netns_unavailable()
    if why:
        res.status = "not available"
        res.error = why
        return res
    n = int(opts.get("n", 2 if opts.quick else 4))
    big = float(opts.get("big_mb", 8.0 if opts.quick else 16.0))
    small = float(opts.get("small_mb", 0.25 if opts.quick else 0.5))
    delay = float(opts.get("delay", 0.2 if opts.quick else 0.3))
    rate = float(opts.get("rate", 100.0))
    pols = [p for p in str(opts.get("policies", ",".join(POLICIES))).split(",") if p]
    if n < 2 or big <= 0 or small <= 0:
        raise ValueError(f"coflow needs n >= 2, big_mb > 0, small_mb > 0 (got {n}, {big}, {small})")
    repeat = opts.repeats()
    bar = opts.bar(NAME)
    bar.set_total(len(pols) * repeat)
    samples: dict[str, list[dict[str, float]]] = {p: [] for p in pols}
    with Testbed(n, rate_mbit=rate) as tb:
        for rep in range(repeat):
            for pol in pols:
                bar.step(f"run {rep + 1}/{repeat}: {pol}")
                name, _, mod = pol.partition("+")
                env = dict(_ENV)
                if mod == "pace":
                    env.update({"TWISTERNET_COFLOW_PACING": "1",
                                "TWISTERNET_COFLOW_RANK_CAPACITY": str(int(rate * 1e6 / 8 * 0.96))})
                elif mod:
                    raise ValueError(f"unknown policy modifier {mod!r} in {pol!r} (only '+pace')")
                rows = tb.run_job(name, ["--big-mb", str(big), "--small-mb", str(small), "--delay", str(delay)],
                                  timeout=300, extra_env=env)
                samples[pol].append(ccts(rows))
    med = {p: {k: median([s[k] for s in samples[p]]) for k in ("big", "small")} for p in pols}
    base = med.get("fifo", med[pols[0]])["small"]
    res.tables.append(Table(
        f"{n} workers, {rate:g} Mbit/s links; per rank {big:g} MB big, {small:g} MB small "
        f"started {delay:g} s later (median of {repeat})",
        ["policy", "small CCT s", "big CCT s", "small speedup vs fifo"],
        [[p, med[p]["small"], med[p]["big"], ratio(base, med[p]["small"])] for p in pols]))
    if "sebf" in med and "fifo" in med:
        sp = ratio(med["fifo"]["small"], med["sebf"]["small"])
        res.targets.append(Target("small coflow CCT, sebf vs fifo", ">= 1.67x faster (< 0.6x)",
                                  "n/a" if sp is None else f"{sp:.2f}x", None if sp is None else sp >= 1.67))
    res.raw = {"samples": samples, "n": n, "big_mb": big, "small_mb": small, "delay": delay, "rate": rate}
    res.seconds = time.monotonic() - t0
    return res


def main(argv: list[str] | None = None) -> int:
    """Standalone script: same as ``python -m benchmarks --suite coflow``; prints the CCTs per policy."""
    from benchmarks import report
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int)
    ap.add_argument("--big-mb", type=float)
    ap.add_argument("--small-mb", type=float)
    ap.add_argument("--policies", help="comma list, default none,fifo,fair,fair+pace,sebf")
    ap.add_argument("--repeat", type=int)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    extra: dict[str, Any] = {k: v for k, v in (("n", a.workers), ("big_mb", a.big_mb), ("small_mb", a.small_mb),
                                               ("policies", a.policies)) if v is not None}
    opts = SuiteOptions(quick=a.quick, repeat=a.repeat or 1, repeat_given=bool(a.repeat), extra=extra)
    report.run_standalone(NAME, run, opts, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
