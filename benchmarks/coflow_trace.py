"""Coflow simulator on the published FB2010 trace: time per policy and avg/p95 CCT next to coflowsim's.

Needs FB2010-1Hr-150-0.txt from the public coflow/coflow-benchmark repository at
$TWISTERNET_COFLOW_TRACE or ~/.cache/twisternet/ (see docs/coflow-simulator.md); exits with the path
it looked at otherwise. ``--like N`` runs a trace of N coflows with the published trace's mix instead
(``coflow-gen --like``; 5000 = 10x the trace at the same load). Times are wall and CPU seconds of
``simulate`` alone (trace parsing excluded); the CPU seconds (``time.process_time``) are what to
compare on a loaded machine, wall time grows with the load. ``fifo-pool`` (not in the default list)
is ``fifo`` with ``share_skipped=True``, coflowsim's FIFO structure (docs/coflow-simulator.md, "FIFO").

    python benchmarks/coflow_trace.py [--policies fair,fifo,sebf,deadline,dag] [--like 5000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from twisternet.coflow import (GBIT, generate_like, get_policy, published_trace_path,
                               read_trace, simulate)
from twisternet.coflow.cli import DEFAULT_REALLOC_GAP_MS

#: coflowsim (the Varys authors' Java simulator) on FB2010-1Hr-150-0.txt, seconds, as measured for the
#: issue (deadline mode: deadline = 2x isolated CCT; fractions of all coflows).
COFLOWSIM = {
    "fair": {"avg": 70.6, "p95": 368.0},
    "fifo": {"avg": 82.6, "p95": None},
    "scf": {"avg": 29.6, "p95": None},
    "sebf": {"avg": 28.5, "p95": 37.5},
    "deadline": {"admitted": 0.707, "met": 0.454},
}
POLICIES = ("fair", "fifo", "sebf", "deadline", "dag")
#: Variants by name: policy name and options.
VARIANTS = {"fifo-pool": ("fifo", {"share_skipped": True})}
#: The issue's targets on the published trace: all five default policies in at most this many CPU
#: seconds; SEBF's average CCT at most coflowsim's; fair/SEBF at least 2x.
TARGET_CPU_S = 60.0


def _fmt(x: float | None, unit: str = "") -> str:
    return "-" if x is None else f"{x:.1f}{unit}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="trace file (default: the published trace's path)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--like", type=int, default=None, metavar="N",
                    help="simulate N coflows with the trace's mix (coflow-gen --like) instead")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--realloc-gap-ms", type=float, default=DEFAULT_REALLOC_GAP_MS,
                    help=f"as coflow-sim (default {DEFAULT_REALLOC_GAP_MS:g})")
    ap.add_argument("--json", help="also write the rows to this file")
    a = ap.parse_args(argv)
    path = a.trace or published_trace_path()
    if not os.path.exists(path):
        print(f"coflow_trace: no trace at {path}; fetch FB2010-1Hr-150-0.txt from "
              "github.com/coflow/coflow-benchmark (see docs/coflow-simulator.md)", file=sys.stderr)
        return 2
    trace = read_trace(path)
    label = os.path.basename(path)
    if a.like is not None:
        trace = generate_like(trace, a.like, seed=a.seed)
        label = f"{a.like} coflows with the mix of {label} (seed {a.seed})"
    caps = trace.capacities(GBIT)
    coflows = trace.to_coflows(caps, deadline_slack=2.0)
    flows = sum(len(c) for c in coflows)
    print(f"{label}: {len(coflows)} coflows, {flows} flows, {trace.num_ports} ports, 1 Gbit/s, "
          f"realloc gap {a.realloc_gap_ms:g} ms; load: {os.getloadavg()[0]:.1f}")
    rows = []
    total_wall = total_cpu = 0.0
    for pol in [p for p in a.policies.split(",") if p]:
        base, opts = VARIANTS.get(pol, (pol, {}))
        w0, c0 = time.perf_counter(), time.process_time()
        r = simulate(coflows, get_policy(base, **opts), caps, realloc_gap=a.realloc_gap_ms / 1000.0)
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        total_wall += wall
        total_cpu += cpu
        row = {"policy": pol, "avg_cct_s": r.avg_cct, "p95_cct_s": r.p95_cct, "events": r.events,
               "wall_s": wall, "cpu_s": cpu, "completed": r.completed}
        ref = COFLOWSIM.get(pol, {})
        line = (f"{pol:9s} avg {r.avg_cct:7.1f}s p95 {r.p95_cct:8.1f}s | coflowsim avg "
                f"{_fmt(ref.get('avg'), 's'):>6} p95 {_fmt(ref.get('p95'), 's'):>6} | "
                f"{r.events:6d} events {wall:6.1f}s wall {cpu:6.1f}s cpu")
        if pol == "deadline":
            adm = [x for x in r.coflows if x.admitted]
            met_adm = sum(bool(x.met_deadline) for x in adm)
            row.update({"admitted": len(adm) / len(coflows), "met_of_all": r.deadlines_met,
                        "admitted_met": met_adm / max(1, len(adm))})
            line += (f" | admitted {len(adm) / len(coflows):.1%} met {r.deadlines_met:.1%} of all, "
                     f"{met_adm}/{len(adm)} admitted met (coflowsim: admitted "
                     f"{ref['admitted']:.1%}, met {ref['met']:.1%})")
        print(line, flush=True)
        rows.append(row)
    by = {r["policy"]: r for r in rows}
    if "fair" in by and "sebf" in by:
        print(f"fair/sebf avg CCT: {by['fair']['avg_cct_s'] / by['sebf']['avg_cct_s']:.2f}x "
              f"(coflowsim {COFLOWSIM['fair']['avg'] / COFLOWSIM['sebf']['avg']:.2f}x)")
    print(f"total simulate time: {total_wall:.1f}s wall, {total_cpu:.1f}s cpu; load now "
          f"{os.getloadavg()[0]:.1f}")
    if a.like is None and all(p in by for p in POLICIES):
        cpu5 = sum(by[p]["cpu_s"] for p in POLICIES)
        print(f"target: five policies <= {TARGET_CPU_S:g}s cpu: {cpu5:.1f}s, "
              f"{'met' if cpu5 <= TARGET_CPU_S else 'NOT met'}")
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump({"trace": label, "rows": rows, "coflowsim": COFLOWSIM}, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
