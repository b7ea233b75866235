"""Back pressure on local threads: a slow destination holds its sources back, and offer() returns False
when the buffers are full."""

from __future__ import annotations

import pytest

import collectives as C
from tests.collectives.scenarios import run_backpressure
from twisternet.errors import BackPressureTimeout
from twisternet.testing import run_local



# Small buffers and credit so that back pressure engages after a few records.
SMALL = dict(buffer_size=4096, buffer_count=2, pool_buffers=8, zero_copy_threshold=1024)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["gather", "reduce"])
def test_backpressure_slow_destination(op: str) -> None:
    world, n, limit = 4, 600, 8
    sources = [1, 2, 3]   # rank 0 only consumes (slowly); ranks 1-3 send as fast as they can
    params = {"op": op, "n": n, "limit": limit, "delay": 0.002, "slow_items": 150, "fanout": 2,
              "sources": sources}
    res = run_local(world, run_backpressure, params, timeout=100, **SMALL)
    got = res[0]["got"]
    if op == "gather":
        # every message exactly once, in order per source
        assert all(src == v[0] for src, v in got)
        got = [(src, v[1]) for src, v in got]
        assert sorted(got) == sorted((s, i) for s in sources for i in range(n))
        for s in sources:
            assert [i for s2, i in got if s2 == s] == list(range(n))
    else:
        assert got == [i * len(sources) for i in range(n)]
    # holdings stay bounded by the per-operation limit at every rank (result queue + input queues)
    for r in range(world):
        assert res[r]["max_held"] <= 2 * limit + 2, (r, res[r]["max_held"])


@pytest.mark.timeout(60)
def test_offer_returns_false_when_full() -> None:
    def body(ctx):
        op = C.Gather(ctx, [0, 1], 0, 4, mode="streaming", limit=3, timeout=5)
        offered = 0
        while op.offer(1, offered):
            offered += 1
            assert offered < 10_000
        assert offered >= 3
        with pytest.raises(BackPressureTimeout) as ei:
            op.send(1, "x", timeout=0.3)
        assert ei.value.edge == 4 and ei.value.operation == "Gather"
        got = op.drain()
        assert [v for _, v in got] == list(range(offered))
        op.finish(0)
        op.finish(1)
        return [v for _, v in op.results()]
    assert run_local(1, body, plan={0: 0, 1: 0}) == [[]]
