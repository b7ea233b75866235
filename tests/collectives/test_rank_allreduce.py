"""The rank-level allreduce on local threads: every world size and path (auto, tree, ring), callables and
objects, and the ``via`` argument checked."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from tests.collectives.scenarios import run_allreduce_calls
from twisternet.errors import ConfigError
from twisternet.testing import run_local



@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("via", ["auto", "tree", "ring"])
def test_rank_allreduce(world: int, via: str) -> None:
    sizes = [7, 1000, 50_000]
    params = {"via": via, "sizes": sizes, "chunk_bytes": 8192, "ring_threshold": 64 << 10}
    res = run_local(world, run_allreduce_calls, params, timeout=100)
    factor = sum(r + 1 for r in range(world))
    for size, got in zip(sizes, res[0]):
        x = (np.arange(size, dtype=np.float64) % 97)
        assert got[0] == pytest.approx(float(x.sum()) * factor)
        assert got[2] == [size] and got[3] == "float64"
    assert all(r == res[0] for r in res)


@pytest.mark.timeout(60)
def test_rank_allreduce_callable_and_objects() -> None:
    def body(ctx):
        op = C.AllReduce(ctx, edge=1, op=lambda a, b: a | b)
        got = op.allreduce({ctx.rank * 10})
        arr = C.AllReduce(ctx, edge=2, op="max").allreduce(np.array([[ctx.rank, -ctx.rank]]))
        return sorted(got), arr.tolist()
    res = run_local(3, body)
    assert all(r == ([0, 10, 20], [[2, 0]]) for r in res)


def test_allreduce_via_is_checked() -> None:
    def body(ctx):
        with pytest.raises(ConfigError, match="via"):
            C.AllReduce(ctx, edge=2, via="carrier-pigeon")
        return True
    assert run_local(1, body) == [True]
