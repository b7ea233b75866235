"""The rank-level allreduce on local threads: every world size and path (auto, tree, ring, doubling),
callables and objects, and the ``via`` argument checked."""

from __future__ import annotations

import numpy as np
import pytest

import collectives as C
from tests.collectives.scenarios import run_allreduce_calls
from twisternet.errors import ConfigError
from twisternet.testing import run_local



@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("via", ["auto", "tree", "ring", "doubling"])
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3, 5, 6, 7, 8])
def test_doubling_every_rank_count(world: int) -> None:
    """Powers of two and not (the extra ranks fold in and out): every rank gets the exact integer sum,
    max and prod, bit-identical float sums, ``out=`` (also in place) filled, and the operation's calls
    in order."""
    def body(ctx):
        op = C.AllReduce(ctx, edge=3, op="sum", via="doubling", timeout=30)
        mx = C.AllReduce(ctx, edge=4, op="max", via="doubling", timeout=30)
        pr = C.AllReduce(ctx, edge=5, op="prod", via="doubling", timeout=30)
        rng = np.random.default_rng(ctx.rank)
        f = rng.standard_normal(301).astype(np.float32)
        out = np.empty((3, 4), np.int64)
        inplace = np.full(5, ctx.rank, np.int16)
        got = [op.allreduce(np.arange(10, dtype=np.int64) * (ctx.rank + 1)).tolist(),
               mx.allreduce(np.array([ctx.rank, -ctx.rank], np.int32)).tolist(),
               pr.allreduce(np.full(2, 2, np.int64)).tolist(),
               op.allreduce(f).tobytes(),
               op.allreduce(np.full((3, 4), ctx.rank, np.int64), out=out) is out and out.tolist(),
               op.allreduce(inplace, out=inplace) is inplace and inplace.tolist()]
        for o in (op, mx, pr):
            o.close()
        return got
    res = run_local(world, body, timeout=100)
    total = sum(r + 1 for r in range(world))
    assert res[0][0] == [i * total for i in range(10)]
    assert res[0][1] == [world - 1, 0]
    assert res[0][2] == [2 ** world] * 2
    want = sum(np.random.default_rng(r).standard_normal(301).astype(np.float32) for r in range(world))
    assert np.frombuffer(res[0][3], np.float32) == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert res[0][4] == [[sum(range(world))] * 4] * 3
    assert res[0][5] == [sum(range(world))] * 5
    assert all(r == res[0] for r in res)     # bit-identical on every rank, float sums included


def test_doubling_refuses_values_it_cannot_reduce_on_every_rank() -> None:
    """A scalar (or a callable reduction) with via="doubling": ConfigError on every rank, none waits."""
    from twisternet.errors import TwisternetError

    def body(ctx):
        op = C.AllReduce(ctx, edge=2, op="sum", via="doubling", timeout=30)
        try:
            op.allreduce(np.ones(3) if ctx.rank else 1.0)
        except TwisternetError as e:
            return type(e).__name__, str(e)
        finally:
            op.abort()
        return None
    for name, msg in run_local(3, body, timeout=60):
        assert name in ("ConfigError", "RemoteError"), (name, msg)
        assert "via='doubling' needs a non-empty numpy array" in msg, msg
