"""The hierarchical allreduce across an emulated cluster of 2 hosts x 2 ranks (1 Gbit/s links).

Checks, over ``twisternet master/worker`` (hosts from the bootstrap table) and MPICH (hosts exchanged
on the first call): the hierarchical result equals the flat ring's (exactly for int64 sums, within
float32 rounding for float sums), is bit-identical on every rank, and the master numbered the ranks
host by host without being asked (host h runs ranks 2h, 2h+1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from twisternet.testbed import Testbed

from tests.jobs import json_objects

SCRIPT = Path(__file__).with_name("scripts") / "hier_vs_flat.py"


def _run(tb: Testbed, launcher: str) -> tuple[dict[int, dict], str]:
    if launcher == "tcp":
        res = tb.twisternet_job(SCRIPT, timeout=400)
    else:
        res = tb.mpich_job([sys.executable, str(SCRIPT)], timeout=400)
    assert res.ok, res.describe()
    got = {d["rank"]: d for d in json_objects(res.stdout, '{"rank": ')}
    return got, res.describe()


def _check(tb: Testbed, got: dict[int, dict], why: str) -> None:
    world = tb.hosts * tb.ranks_per_host
    assert sorted(got) == list(range(world)), why
    for r in range(world):
        want = {"_hier", "_multi_ring", "_ring"} | ({"_doubling"} if r % tb.ranks_per_host == 0 else set())
        assert want <= set(got[r]["algos"]), (r, got[r]["algos"])   # small sizes: doubling between leaders
        assert got[r]["results"] == got[0]["results"], f"rank {r} differs from rank 0"
    rows = got[0]["results"]
    hier = {(d, n): (h, first, s) for via, d, n, h, first, s in rows if via == "hier"}
    flat = {(d, n): (h, first, s) for via, d, n, h, first, s in rows if via == "ring"}
    assert flat, rows
    for key, (h, first, s) in flat.items():
        if key[0] == "int64":
            assert hier[key][0] == h, f"int64 sums of {key[1]} differ between hierarchical and flat"
        else:
            assert hier[key][1] == pytest.approx(first, rel=1e-4, abs=1e-4)
            assert hier[key][2] == pytest.approx(s, rel=1e-3, abs=np.sqrt(key[1]) * 1e-3)


@pytest.mark.timeout(900)
def test_hierarchical_equals_flat_over_tcp_with_host_contiguous_ranks(testbed: Testbed) -> None:
    got, why = _run(testbed, "tcp")
    _check(testbed, got, why)
    k = testbed.ranks_per_host
    for r, d in got.items():    # the master numbered the workers host by host (no --rank given)
        assert d["host"] == testbed.hostnames[r // k], (r, d["host"])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hierarchical_equals_flat_under_mpich(testbed: Testbed) -> None:
    got, why = _run(testbed, "mpi")
    _check(testbed, got, why)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("option,host_of", [({}, lambda r, h, k: r // k),
                                             ({"interleaved_ranks": True}, lambda r, h, k: r % h)])
def test_rank_numbering_by_the_master_and_interleaved(testbed: Testbed, option, host_of) -> None:
    """Without --rank the master numbers host by host; interleaved_ranks reproduces the old alternation."""
    res = testbed.twisternet_job(SCRIPT.with_name("whoami.py"), timeout=200, **option)
    assert res.ok, res.describe()
    got = {d["rank"]: d["host"] for d in json_objects(res.stdout, '{"rank": ')}
    h, k = testbed.hosts, testbed.ranks_per_host
    assert got == {r: testbed.hostnames[host_of(r, h, k)] for r in range(h * k)}, got
