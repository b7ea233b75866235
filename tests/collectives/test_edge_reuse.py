"""An edge id is reusable at once after close(): a training loop that makes a new AllReduce on one edge
per epoch gets every epoch right under both launchers (it stalled in most runs when records of the
next incarnation reached the previous one, or stale ones reached the next), and two ranks that run
different operations on one edge both raise MismatchError instead of dropping data."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from twisternet.testing import run_local

from tests.collectives.launchers import run_scenario
from tests.collectives.scenarios import run_kinds

pytestmark = pytest.mark.timeout(400)
SCRIPT = Path(__file__).parent / "scripts" / "edge_reuse.py"


@pytest.mark.parametrize("launcher", ["tcp", "mpi"])
@pytest.mark.parametrize("via", ["auto", "ring", "tree", "doubling"])
def test_training_loop_reuses_the_edge_every_epoch(run_job, launcher: str, via: str) -> None:
    epochs = 40
    p = run_job(launcher, 3, SCRIPT, str(epochs), via, timeout=300)
    got = re.findall(r"REUSE rank=\d+ ok=\d+", p.stdout)   # mpiexec may glue the ranks' lines together
    assert sorted(got) == [f"REUSE rank={r} ok={epochs}" for r in range(3)], p.stdout[-3000:] + p.stderr[-3000:]
    assert p.returncode == 0


@pytest.mark.parametrize("ring_threshold", [64, 1 << 20])    # the array by the ring; by recursive doubling
def test_threads_reuse_the_edge_every_epoch(ring_threshold: int) -> None:
    import numpy as np

    import collectives as C

    def body(ctx):
        ok = 0
        for epoch in range(40):
            with C.AllReduce(ctx, edge=5, op="sum", timeout=20, ring_threshold=ring_threshold) as op:
                a = op.allreduce(np.full(64, float(ctx.rank + epoch)))
                b = op.allreduce(ctx.rank * epoch)
            ok += bool(np.all(a == sum(r + epoch for r in range(ctx.world)))
                       and b == sum(r * epoch for r in range(ctx.world)))
        return ok
    assert run_local(3, body, timeout=200) == [40] * 3


@pytest.mark.parametrize("kinds", [("gather", "reduce"), ("allgather", "allreduce")])
def test_different_operations_on_one_edge_raise_on_every_rank(kinds: tuple[str, str]) -> None:
    for r in run_local(2, run_kinds, {"kinds": list(kinds)}, timeout=60):
        assert r["error"] == "MismatchError", r
        assert "different operations on one edge" in r["message"] and "edge 7" in r["message"], r


@pytest.mark.parametrize("launcher", ["tcp", "mpi"])
@pytest.mark.parametrize("kinds", [["gather", "reduce"], ["allgather", "allreduce"]])
def test_processes_different_operations_on_one_edge_raise_on_every_rank(launcher: str, kinds: list) -> None:
    for r in run_scenario(launcher, 2, "run_kinds", {"kinds": kinds}, timeout=120):
        assert r["error"] == "MismatchError", r
        assert "different operations on one edge" in r["message"] and "edge 7" in r["message"], r


def test_a_reduction_whose_repr_holds_an_address_is_not_a_mismatch() -> None:
    """functools.partial objects print their function's address, which differs between processes."""
    import functools
    import operator

    import collectives as C

    def body(ctx):
        # a fresh partial (and function object) per rank: only the address differs
        fn = functools.partial(lambda k, a, b: operator.add(a, b) * k, 1)
        op = C.Reduce(ctx, edge=3, reduce=fn, timeout=20)
        assert " at 0x" not in op.fingerprint()
        op.send(ctx.rank, ctx.rank + 1)
        op.finish(ctx.rank)
        got = op.result() if ctx.rank == 0 else None
        op.close()
        return got
    assert run_local(2, body, timeout=60)[0] == 3


@pytest.mark.parametrize("launcher,how", [("tcp", "table"), ("mpi", "table"), ("mpi", "exchange")])
def test_operations_over_overlapping_subsets_agree_on_the_hosts(run_job, launcher: str, how: str) -> None:
    """Without a host table in the channel the hosts are found by an exchange among an operation's
    ranks; with what an earlier operation's exchange taught some ranks in the shared task plan, Z
    (ranks 0, 1, 3) had rank 1 skip the exchange that ranks 0 and 3 waited in, until the timeout."""
    args = ["exchange"] if how == "exchange" else []
    p = run_job(launcher, 4, Path(__file__).parent / "scripts" / "subset_topology.py", *args, timeout=200)
    # (mpiexec may join two ranks' lines: "SUBSET rank=3 ok=3SUBSET rank=0 ok=3")
    got = sorted((int(r), int(n)) for r, n in re.findall(r"SUBSET rank=(\d+) ok=(\d+)", p.stdout))
    assert got == [(0, 3), (1, 4), (2, 2), (3, 3)], p.stdout[-3000:] + p.stderr[-3000:]
    assert p.returncode == 0
