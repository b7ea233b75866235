"""The collectives test matrix across an emulated cluster: H=2 hosts x k=2 ranks, 1 Gbit/s links.

Every operation x {batch, streaming} x {numpy, records, strings}, one-task-per-rank and random task plans,
checked against the sequential references of tests/collectives, run as one job per (launcher, mode):
``twisternet master/worker`` across the hosts (TCP) and MPICH's hydra across the hosts (MPI channel,
TCP on eth0). Each job ends with an 8 MB allreduce whose bytes must show up on both hosts' links (so
the data crossed the emulated network, not shared memory or cross-memory attach), and every host must
have run exactly k ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.collectives.reference import check, random_case
from tests.collectives.scenarios import KINDS, OPS
from tests.jobs import json_objects
from twisternet.testbed import JobResult, Testbed

DRIVER = Path(__file__).with_name("cases_driver.py")
LAUNCHERS = ["tcp", "mpi"]
BIG = 1 << 20          # float64 elements of the closing allreduce: 8 MB


def matrix_cases(world: int, mode: str, seeds_per_kind: dict[str, list[int]], n: int = 6) -> list[dict]:
    cases = []
    for op in OPS:
        for kind in KINDS:
            for seed in seeds_per_kind[kind]:
                cases.append({"scenario": "run_op", "params": random_case(world, op, mode, kind, seed, n=n)})
    for via in ("ring", "tree"):        # both rank-level algorithms across the links, several chunks
        cases.append({"scenario": "run_allreduce_calls",
                      "params": {"sizes": [10, 300_000], "chunk_bytes": 64 << 10, "ring_threshold": 256 << 10,
                                 "via": via}})
    cases.append({"scenario": "run_allreduce_calls", "params": {"sizes": [10, BIG], "via": "auto"}})
    return cases


def run_cases(tb: Testbed, launcher: str, cases: list[dict], timeout: float) -> tuple[JobResult, dict]:
    """Run the cases as one job; returns the job and {case: {rank: (host, result)}}."""
    assert tb.tmp is not None
    path = tb.tmp / f"cases-{launcher}-{len(cases)}.json"
    path.write_text(json.dumps(cases))
    if launcher == "tcp":
        res = tb.twisternet_job(DRIVER, [str(path)], timeout=timeout)
    else:
        res = tb.mpich_job([sys.executable, str(DRIVER), str(path)], timeout=timeout)
    assert res.ok, res.describe()
    out: dict[int, dict[int, tuple[str, object]]] = {}
    for d in json_objects(res.stdout, '{"case": '):
        out.setdefault(d["case"], {})[d["rank"]] = (d["host"], d["result"])
    return res, out


def check_job(tb: Testbed, res: JobResult, out: dict, cases: list[dict]) -> None:
    world = tb.hosts * tb.ranks_per_host
    assert sorted(out) == list(range(len(cases))), res.describe()
    for i, case in enumerate(cases):
        assert sorted(out[i]) == list(range(world)), f"case {i}: ranks {sorted(out[i])}\n{res.describe()}"
        if case["scenario"] == "run_op":
            merged = {int(d): items for _, result in out[i].values() for d, items in result.items()}
            check(case["params"], merged)
    for i, case in enumerate(cases):   # ring / tree / auto allreduce calls: right sums, equal on every rank
        if case["scenario"] == "run_allreduce_calls":
            sizes = case["params"]["sizes"]
            got = [out[i][r][1] for r in range(world)]
            assert all(g == got[0] for g in got), (case, got)
            for size, call in zip(sizes, got[0]):
                assert call[0] == pytest.approx(float((np.arange(size) % 97).sum()) * world * (world + 1) / 2)
    # k ranks on every host, each host a different machine name
    hosts = [out[0][r][0] for r in range(world)]
    assert sorted(hosts) == sorted(h for h in tb.hostnames for _ in range(tb.ranks_per_host)), hosts
    # the closing allreduce: correct everywhere, and its bytes went through both links
    last = out[len(cases) - 1]
    expected = float((np.arange(BIG) % 97).sum()) * sum(r + 1 for r in range(world))
    for r in range(world):
        assert last[r][1][1][0] == pytest.approx(expected), (r, last[r])
    moved = {h: (res.counters_after[h].rx_bytes - res.counters_before[h].rx_bytes) for h in range(tb.hosts)}
    assert all(b >= BIG * 8 for b in moved.values()), f"bytes received per host {moved}: the data did not " \
        f"cross the emulated links (shared memory or cma?)"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["batch", "streaming"])
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_matrix_across_hosts(testbed: Testbed, launcher: str, mode: str) -> None:
    """Every operation and kind, SPMD and random plans, across 2 hosts x 2 ranks."""
    cases = matrix_cases(testbed.hosts * testbed.ranks_per_host, mode,
                         {"numpy": [0, 1], "records": [0, 1], "strings": [1, 3]})
    res, out = run_cases(testbed, launcher, cases, timeout=480)
    check_job(testbed, res, out, cases)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mode", ["batch", "streaming"])
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_matrix_across_hosts_large(testbed: Testbed, launcher: str, mode: str) -> None:
    """More random plans and longer streams, with small limits (back pressure across the links)."""
    world = testbed.hosts * testbed.ranks_per_host
    cases = matrix_cases(world, mode, {k: [0, 2, 5, 7, 9] for k in KINDS}, n=60)
    for j, case in enumerate(cases[:-1]):
        case["params"]["fanout"] = 1 + j % 3
        case["params"]["limit"] = 1 + j % 20
        case["params"]["timeout"] = 120
    res, out = run_cases(testbed, launcher, cases, timeout=1500)
    check_job(testbed, res, out, cases)
