"""The published FB2010 trace as an input: where it is looked for, the trace-shaped generator, and
(slow, only when the file is present) every policy on the whole trace against coflowsim's figures."""

from __future__ import annotations

import math
import os
import time
from collections import Counter

import pytest

from twisternet.coflow import (GBIT, Coflow, PortCapacities, generate_like, parse_trace,
                               published_trace_path, read_trace, simulate)
from twisternet.coflow.cli import DEFAULT_REALLOC_GAP_MS, gen_main

# coflowsim's figures on FB2010-1Hr-150-0.txt (seconds), measured by the author.
COFLOWSIM_AVG = {"fair": 70.6, "fifo": 82.6, "scf": 29.6, "sebf": 28.5}

TEMPLATE = """\
6 4
1 0 2 0 1 1 2:4
2 100 1 3 2 4:1 5:2.5
3 250 3 0 2 4 1 1:9
4 1000 1 5 3 0:1 1:1 2:1
"""


def test_published_trace_path_env_and_default(monkeypatch) -> None:
    monkeypatch.setenv("TWISTERNET_COFLOW_TRACE", "~/x/fb.txt")
    assert published_trace_path() == os.path.expanduser("~/x/fb.txt")
    monkeypatch.delenv("TWISTERNET_COFLOW_TRACE")
    assert published_trace_path() == os.path.join(os.path.expanduser("~"), ".cache", "twisternet",
                                                  "FB2010-1Hr-150-0.txt")


def test_generate_like_copies_the_template_mix() -> None:
    tpl = parse_trace(TEMPLATE)
    tr = generate_like(tpl, 400, seed=3)
    assert tr.num_ports == 6 and len(tr.coflows) == 400
    shapes = {(len(c.mappers), tuple(mb for _, mb in c.reducers)) for c in tpl.coflows}
    seen = Counter()
    for c in tr.coflows:
        key = (len(c.mappers), tuple(mb for _, mb in c.reducers))
        assert key in shapes  # every coflow has a template coflow's shape and bytes
        seen[key] += 1
        assert len(set(c.mappers)) == len(c.mappers) and len(set(p for p, _ in c.reducers)) == len(c.reducers)
        assert all(0 <= p < 6 for p in c.mappers)
    assert len(seen) == len(shapes) and min(seen.values()) > 50  # all four drawn, roughly evenly
    arr = [c.arrival_ms for c in tr.coflows]
    assert arr == sorted(arr) and arr[0] == 0
    # Same arrival rate as the template: 4 coflows in 1 s -> 400 in about 100 s.
    assert 90_000 <= arr[-1] <= 100_000
    assert generate_like(tpl, 400, seed=3) == tr and generate_like(tpl, 400, seed=4) != tr
    # Placements are fresh: not every coflow sits on its template's ports.
    tpl_ports = {(c.mappers, tuple(p for p, _ in c.reducers)) for c in tpl.coflows}
    assert sum((c.mappers, tuple(p for p, _ in c.reducers)) not in tpl_ports for c in tr.coflows) > 300


def test_coflow_gen_like_cli(tmp_path) -> None:
    tpl = tmp_path / "tpl.txt"
    tpl.write_text(TEMPLATE)
    out = tmp_path / "x10.txt"
    assert gen_main([str(out), "--like", str(tpl), "--coflows", "40", "--seed", "1"]) == 0
    tr = read_trace(out)
    assert tr.num_ports == 6 and len(tr.coflows) == 40
    assert gen_main([str(out), "--like", str(tmp_path / "missing.txt")]) == 2


def test_coflow_never_released_before_its_arrival() -> None:
    # The old release test allowed 1 ns of slack, so a coflow arriving at 1e-9 s was released (and
    # sent) at t=0 and finished faster than its isolated minimum CCT.
    res = simulate([Coflow(0, 1e-9, [(0, 0, 1.0)])], "fifo", PortCapacities.uniform(3, 1.5))
    r = res.coflows[0]
    assert r.release == pytest.approx(1e-9, abs=0) and r.cct >= r.isolated


def _published():
    path = published_trace_path()
    if not os.path.exists(path):
        pytest.skip(f"published trace not found at {path} (set TWISTERNET_COFLOW_TRACE or put "
                    "FB2010-1Hr-150-0.txt from github.com/coflow/coflow-benchmark there)")
    return read_trace(path)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_published_trace_all_policies() -> None:
    tr = _published()
    assert tr.num_ports == 150 and len(tr.coflows) == 526
    caps = tr.capacities(GBIT)
    cfs = tr.to_coflows(caps, deadline_slack=2.0)
    res = {}
    cpu = {}
    for pol in ("fair", "fifo", "sebf", "deadline", "dag"):
        t0 = time.process_time()
        res[pol] = simulate(cfs, pol, caps, realloc_gap=DEFAULT_REALLOC_GAP_MS / 1000.0)
        cpu[pol] = time.process_time() - t0
        print(f"{pol}: avg {res[pol].avg_cct:.2f}s p95 {res[pol].p95_cct:.2f}s cpu {cpu[pol]:.1f}s")
    for pol in ("fair", "fifo", "sebf", "dag"):
        assert res[pol].completed == len(cfs)
        for r in res[pol].coflows:
            assert r.cct >= r.isolated * (1 - 1e-9)
    # SEBF at or below coflowsim's SEBF, and at least 2.4x better than per-flow fairness.
    assert res["sebf"].avg_cct <= COFLOWSIM_AVG["sebf"]
    assert res["fair"].avg_cct / res["sebf"].avg_cct >= 2.4
    # FIFO with MADD (122 s) is within 1.5x of coflowsim's FIFO, not 4x above it as the old greedy
    # FIFO was (334 s); the rest is coflowsim's refill order (docs/coflow-simulator.md, "FIFO").
    assert res["fifo"].avg_cct <= 2.0 * COFLOWSIM_AVG["fifo"]
    # Deadline mode: every admitted coflow meets its deadline (2x its isolated CCT).
    dl = res["deadline"]
    admitted = [r for r in dl.coflows if r.admitted]
    assert len(admitted) >= 0.5 * len(cfs)
    assert all(r.met_deadline for r in admitted)
    # The whole run stays far from the old engine's minutes per policy (CPU time, not wall time).
    assert sum(cpu.values()) < 300, cpu
    assert all(math.isfinite(r.avg_cct) for r in res.values())


def test_coflow_sim_without_trace_uses_published_path(tmp_path, monkeypatch, capsys) -> None:
    from twisternet.coflow.cli import main
    missing = tmp_path / "nowhere" / "FB2010-1Hr-150-0.txt"
    monkeypatch.setenv("TWISTERNET_COFLOW_TRACE", str(missing))
    assert main(["--policy", "sebf"]) == 2
    err = capsys.readouterr().err
    assert str(missing) in err and "coflow-benchmark" in err
    small = tmp_path / "small.txt"
    small.write_text(TEMPLATE)
    monkeypatch.setenv("TWISTERNET_COFLOW_TRACE", str(small))
    assert main(["--policy", "sebf", "--no-baseline"]) == 0
    assert capsys.readouterr().out.startswith("policy=sebf coflows=4 ")
