"""The collective test matrix: every operation x {streaming, batch} x {1..4 workers} x {numpy arrays,
Python records, strings}, on even seeds one task per rank, on odd seeds random task plans with disjoint
sources and destinations and several tasks per process; checked against sequential references."""

from __future__ import annotations

import pytest

from twisternet.testing import run_local

from tests.collectives.reference import check, random_case
from tests.collectives.scenarios import KINDS, OPS, run_op


def run_case(world: int, params: dict) -> dict[int, list]:
    plan = {int(t): r for t, r in params["plan"].items()}
    per_rank = run_local(world, run_op, params, plan=plan, timeout=60)
    merged: dict[int, list] = {}
    for res in per_rank:
        for d, items in res.items():
            assert int(d) not in merged
            merged[int(d)] = items
    return merged


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["batch", "streaming"])
@pytest.mark.parametrize("op", OPS)
def test_matrix(op: str, mode: str, world: int, kind: str) -> None:
    for seed in (0, 1):
        params = random_case(world, op, mode, kind, seed)
        check(params, run_case(world, params))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode", ["batch", "streaming"])
def test_matrix_random_plans(op: str, mode: str) -> None:
    """More random plans, longer streams and fanouts 1-3."""
    for seed in range(3, 13, 2):
        for world in (2, 3, 4):
            params = random_case(world, op, mode, KINDS[seed % 3], seed, n=25)
            params["fanout"] = 1 + seed % 3
            check(params, run_case(world, params))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode", ["batch", "streaming"])
def test_matrix_random_plans_large(op: str, mode: str) -> None:
    for seed in range(13, 53, 2):
        for world in (2, 3, 4, 5):
            params = random_case(world, op, mode, KINDS[seed % 3], seed, n=200)
            params["fanout"] = 1 + seed % 4
            params["limit"] = 1 + seed % 50          # small limits: back pressure everywhere
            check(params, run_case(world, params))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["batch", "streaming"])
def test_manual_progress_mode(mode: str) -> None:
    """The operations also work when the program drives progress itself (``progress="manual"``)."""
    for i, op in enumerate(OPS):
        params = random_case(3, op, mode, KINDS[i % 3], seed=1)
        plan = {int(t): r for t, r in params["plan"].items()}
        per_rank = run_local(3, run_op, params, plan=plan, timeout=60, progress="manual")
        check(params, {int(d): items for res in per_rank for d, items in res.items()})
