"""Ranks that disagree in an allreduce call (dtype with byte order, length, shape) or whose reduction
raises: every rank raises at once, naming the ranks that differ or the rank that failed, on every path
(shared memory, tree, ring, recursive doubling) and under both launchers; no rank waits for the timeout."""

from __future__ import annotations

import pytest

from collectives.allreduce import shm as shm_allreduce
from twisternet.testing import run_local

from tests.collectives.launchers import run_scenario
from tests.collectives.scenarios import run_failing_reduction, run_mismatch

pytestmark = pytest.mark.timeout(300)

CASES = ["byteorder", "length", "shape", "dtype"]


def check_mismatch(res: list, odd: int, case: str) -> None:
    for rank, r in enumerate(res):
        assert r["first"]["error"] is None and r["first"]["value"] == [float(len(res))] * 24, r
        second = r["second"]
        assert second["error"] == "MismatchError", (rank, second)
        assert f"ranks [{odd}]" in second["message"] or f"rank [{odd}]" in second["message"], second
        if case == "byteorder":
            assert ">f4" in second["message"] and "<f4" in second["message"], second


# via="ring" and "doubling" refuse a scalar up front (ConfigError), so it is no mismatch case for them
@pytest.mark.parametrize("via, case", [(v, c) for v in ("tree", "ring", "doubling") for c in CASES + ["scalar"]
                                       if c != "scalar" or v == "tree"])
def test_threads_every_rank_raises(via: str, case: str) -> None:
    res = run_local(3, run_mismatch, {"case": case, "via": via, "odd": 2, "chunk_bytes": 1024,
                                      "timeout": 20}, timeout=90)
    check_mismatch(res, 2, case)


@pytest.mark.parametrize("world", [2, 4, 5, 8])
@pytest.mark.parametrize("case", ["byteorder", "shape"])
def test_threads_doubling_names_the_odd_rank_alike_everywhere(world: int, case: str) -> None:
    """Recursive doubling gathers every rank's descriptor before it raises: every rank raises the same
    error, naming the one odd rank (each rank index in turn, folded-in ranks of 5 included), with the
    others listed together."""
    for odd in range(world):
        res = run_local(world, run_mismatch, {"case": case, "via": "doubling", "odd": odd, "timeout": 20},
                        timeout=90)
        check_mismatch(res, odd, case)
        if world > 2:
            others = [r for r in range(world) if r != odd]
            assert all(r["second"]["message"] == res[0]["second"]["message"] for r in res), res
            assert f"ranks {others}: float32" in res[0]["second"]["message"], res[0]


def test_threads_ranks_that_pick_different_algorithms_raise() -> None:
    """24 float32 are 96 bytes, under ring_threshold=100: recursive doubling; 25 are 100 bytes: the ring."""
    res = run_local(3, run_mismatch, {"case": "length", "via": "auto", "odd": 1, "ring_threshold": 100,
                                      "timeout": 20}, timeout=90)
    check_mismatch(res, 1, "length")


@pytest.mark.skipif(not shm_allreduce.supported(), reason="needs /dev/shm on an x86-64 machine")
@pytest.mark.parametrize("launcher", ["tcp", "mpi"])
@pytest.mark.parametrize("case", CASES + ["scalar"])
def test_processes_shared_memory(launcher: str, case: str) -> None:
    # a scalar takes the tree while the others are in a shared-memory round ("auto"): it joins the
    # round as "no array", so every rank raises at once
    via = "auto" if case == "scalar" else "shm"
    res = run_scenario(launcher, 3, "run_mismatch", {"case": case, "via": via, "odd": 1, "timeout": 20},
                       timeout=150)
    check_mismatch(res, 1, case)


@pytest.mark.parametrize("launcher", ["tcp", "mpi"])
@pytest.mark.parametrize("via", ["tree", "ring", "doubling"])
def test_processes_messages(launcher: str, via: str) -> None:
    res = run_scenario(launcher, 3, "run_mismatch", {"case": "byteorder", "via": via, "odd": 0,
                                                     "timeout": 20, "ring_threshold": 1}, timeout=150)
    check_mismatch(res, 0, "byteorder")


def check_failure(res: list, fail: int, limit: float, waiting: list[int] | None = None) -> None:
    """The failing rank raises the reduction's error; every rank that waits for the result (all of them
    for allreduce; the destination for a Reduce) raises RemoteError naming it, well before the timeout."""
    for rank, r in enumerate(res):
        if waiting is not None and rank not in waiting + [fail]:
            continue       # a source with nothing to wait for finished its part
        if rank == fail:
            assert r["error"] == "ZeroDivisionError", r
        else:
            assert r["error"] == "RemoteError" and f"rank {fail} failed" in r["message"] \
                and "ZeroDivisionError" in r["message"], r
        assert r["after"] < limit, r     # not the operation's 60 s timeout


@pytest.mark.parametrize("form,fail", [("allreduce", 0), ("reduce", 1)])
def test_threads_a_failing_reduction_reaches_every_rank(form: str, fail: int) -> None:
    check_failure(run_local(3, run_failing_reduction, {"form": form, "fail_rank": fail}, timeout=90), fail, 30,
                  [0] if form == "reduce" else None)


@pytest.mark.parametrize("launcher", ["tcp", "mpi"])
@pytest.mark.parametrize("form,fail", [("allreduce", 0), ("reduce", 1)])
def test_processes_a_failing_reduction_reaches_every_rank(launcher: str, form: str, fail: int) -> None:
    res = run_scenario(launcher, 3, "run_failing_reduction", {"form": form, "fail_rank": fail}, timeout=150)
    check_failure(res, fail, 30, [0] if form == "reduce" else None)
