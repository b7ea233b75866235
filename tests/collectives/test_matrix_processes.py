"""The same scenarios as the thread matrix, in real processes: over TCP (``twisternet run``) and MPI."""

from __future__ import annotations

import pytest

from tests.collectives.launchers import run_scenario
from tests.collectives.reference import check, random_case
from tests.collectives.scenarios import KINDS, OPS

LAUNCHERS = ["tcp", "mpi"]


def merged(per_rank: list) -> dict[int, list]:
    out: dict[int, list] = {}
    for res in per_rank:
        for d, items in res.items():
            out[int(d)] = items
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("op,mode,kind", [("keyed_reduce", "batch", "strings"), ("allreduce", "streaming", "numpy"),
                                          ("gather", "batch", "records")])
def test_scenarios_in_processes(launcher: str, op: str, mode: str, kind: str) -> None:
    params = random_case(3, op, mode, kind, seed=1)
    check(params, merged(run_scenario(launcher, 3, "run_op", params)))


# Not marked slow on purpose: CI runs the whole operation x mode matrix under twisternet run (TCP) and
# under mpiexec, at 2 and 4 processes (the channel issues ask for exactly that).
@pytest.mark.timeout(900)
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("mode", ["batch", "streaming"])
@pytest.mark.parametrize("op", OPS)
def test_matrix_in_processes(launcher: str, op: str, mode: str) -> None:
    for world, seed in ((2, 1), (4, 3)):
        params = random_case(world, op, mode, KINDS[(seed + len(op)) % 3], seed)
        check(params, merged(run_scenario(launcher, world, "run_op", params)))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("via", ["ring", "tree", "doubling"])   # "auto" picks shared memory here (test_shm_allreduce)
def test_ring_and_tree_allreduce_in_processes(launcher: str, via: str) -> None:
    import numpy as np
    sizes = [10, 300_000]
    res = run_scenario(launcher, 3, "run_allreduce_calls",
                       {"sizes": sizes, "chunk_bytes": 64 << 10, "ring_threshold": 256 << 10,
                        "via": via})
    for size, got in zip(sizes, res[0]):
        assert got[0] == pytest.approx(float((np.arange(size) % 97).sum()) * 6)
    assert res[0] == res[1] == res[2]
