"""The functional layer (tn.all_reduce & co.), its non-blocking handles and automatic edges, the avg
reduction and the root aliases, on the in-process local channel."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys

import numpy as np
import pytest

import twisternet as tn
from collectives import AllReduce, Broadcast, Gather, KeyedReduce, Reduce
from collectives.edges import AUTO_EDGE_BASE, MAX_USER_EDGE, next_auto_edge
from collectives.reduction import Reduction
from twisternet.errors import ConfigError, MismatchError, RemoteError, TwisternetError
from twisternet.testing import run_local

from tests.jobs import ROOT, job_env


def test_every_call_gives_the_reference_result() -> None:
    def body(ctx):
        r = ctx.rank
        x = np.arange(6, dtype=np.float64) + r
        got = {op: tn.all_reduce(x, op, ctx=ctx) for op in ("sum", "avg", "mean", "min", "max", "prod")}
        return (got, tn.broadcast({"from": r} if r == 2 else "ignored", src=2, ctx=ctx),
                tn.reduce(x, dst=1, op="avg", ctx=ctx), tn.all_gather(("r", r), ctx=ctx),
                tn.gather(r * r, dst=2, ctx=ctx), tn.barrier(ctx=ctx), tn.all_reduce(r + 1, "max", ctx=ctx))
    n = 3
    xs = [np.arange(6, dtype=np.float64) + r for r in range(n)]
    for r, (got, b, red, ag, g, bar, mx) in enumerate(run_local(n, body, timeout=120)):
        np.testing.assert_array_equal(got["sum"], sum(xs))
        np.testing.assert_allclose(got["avg"], sum(xs) / n)
        np.testing.assert_array_equal(got["avg"], got["mean"])
        np.testing.assert_array_equal(got["min"], xs[0])
        np.testing.assert_array_equal(got["max"], xs[-1])
        np.testing.assert_array_equal(got["prod"], xs[0] * xs[1] * xs[2])
        assert b == {"from": 2}
        assert (red is None) == (r != 1)
        if r == 1:
            np.testing.assert_allclose(red, sum(xs) / n)
        assert ag == [("r", 0), ("r", 1), ("r", 2)]
        assert g == ([0, 1, 4] if r == 2 else None)
        assert bar is None and mx == 3


def test_out_writes_into_the_callers_array_in_place() -> None:
    def body(ctx):
        x = np.full(1000, ctx.rank + 1.0, np.float32)
        res = tn.all_reduce(x, out=x, ctx=ctx)
        y = np.zeros(4)
        res2 = tn.broadcast(np.arange(4.0) if ctx.rank == 0 else None, src=0, out=y, ctx=ctx)
        return res is x, x[0], res2 is y, y.tolist()
    for same, v, same2, y in run_local(2, body, timeout=60):
        assert same and v == 3.0 and same2 and y == [0.0, 1.0, 2.0, 3.0]


def test_several_calls_in_flight_complete_through_their_handles() -> None:
    def body(ctx):
        r = ctx.rank
        hs = [tn.all_reduce(np.full(8, float(i + r)), async_op=True, ctx=ctx) for i in range(4)]
        hb = tn.broadcast("hello" if r == 1 else None, src=1, async_op=True, ctx=ctx)
        hg = tn.all_gather(r, async_op=True, ctx=ctx)
        hr = tn.reduce(r, dst=0, async_op=True, ctx=ctx)
        hbar = tn.barrier(async_op=True, ctx=ctx)
        fut = hg.get_future()
        assert isinstance(fut, concurrent.futures.Future)
        done, _ = concurrent.futures.wait([h.get_future() for h in hs + [hb, hg, hr, hbar]], timeout=60)
        assert len(done) == 8
        return ([h.wait()[0] for h in hs], hb.wait(), fut.result(), hr.wait(), hbar.is_completed())
    for r, (sums, b, g, red, bar) in enumerate(run_local(2, body, timeout=120)):
        assert sums == [2 * i + 1 for i in range(4)]
        assert b == "hello" and g == [0, 1] and red == (1 if r == 0 else None) and bar


def test_errors_reach_wait_and_the_future_on_every_rank() -> None:
    def body(ctx):
        h = tn.all_reduce(np.ones(3 + ctx.rank), async_op=True, ctx=ctx)
        err = h.get_future().exception(timeout=60)
        with pytest.raises(type(err)):
            h.wait()
        after = tn.all_reduce(np.ones(2), ctx=ctx)     # the next call works again, on a fresh operation
        return type(err), str(err), after.tolist()
    for kind, msg, after in run_local(3, body, timeout=120):
        assert issubclass(kind, (MismatchError, RemoteError)), msg
        assert after == [3.0, 3.0]


def test_bad_input_on_one_rank_fails_the_call_on_every_rank() -> None:
    def body(ctx):
        out = np.zeros(5 if ctx.rank == 1 else 4)
        try:
            tn.all_reduce(np.ones(4), out=out, ctx=ctx)
        except Exception as e:  # noqa: BLE001
            first = (type(e).__name__, str(e))
        else:
            first = None
        try:
            tn.all_gather(object.__new__(_Unsendable) if ctx.rank == 0 else 1, ctx=ctx)
        except Exception as e:  # noqa: BLE001
            second = (type(e).__name__, str(e))
        else:
            second = None
        return first, second
    res = run_local(3, body, timeout=120, allow_pickle=False)
    for r, (first, second) in enumerate(res):
        assert first is not None and "rank 1" in first[1], first
        assert first[0] == ("ValueError" if r == 1 else "RemoteError"), first
        assert second is not None and "all_gather() on rank 0" in second[1], second
        assert second[0] == ("CodecError" if r == 0 else "RemoteError"), second


class _Unsendable:
    pass


def test_automatic_edges_are_deterministic_and_reserved() -> None:
    class Ctx:
        pass
    a, b = Ctx(), Ctx()
    assert [next_auto_edge(a) for _ in range(3)] == [next_auto_edge(b) for _ in range(3)]
    assert AUTO_EDGE_BASE <= next_auto_edge(a, 5) < MAX_USER_EDGE

    def body(ctx):
        with pytest.raises(ConfigError, match="reserved"):
            AllReduce(ctx, edge=AUTO_EDGE_BASE + 3)
        tn.all_reduce(1, ctx=ctx)
        tn.broadcast(1, src=0, ctx=ctx)
        with AllReduce(ctx, edge=0) as op:   # user edges stay free
            return op.allreduce(ctx.rank)
    assert run_local(2, body, timeout=60) == [1, 1]


def test_root_aliases_and_conflicts() -> None:
    def body(ctx):
        r = ctx.rank
        with Reduce(ctx, edge=1, root=1) as a, Gather(ctx, edge=2, dst=1) as g, \
                Broadcast(ctx, edge=3, src=1) as bc, Reduce(ctx, edge=4, destination=1, dst=1) as same:
            assert a.destinations == g.destinations == bc.sources == same.destinations == [1]
            for op in (a, g, same):
                op.send(r, r + 1)
                op.finish(r)
            if r == 1:
                bc.send(1, "x")
                bc.finish(1)
            got = (a.result() if r == 1 else None, list(g.values()), list(bc.results()))
        with pytest.raises(TypeError, match="root=0.*dst=1"):
            Reduce(ctx, edge=5, root=0, dst=1)
        with pytest.raises(TypeError, match="src"):
            Broadcast(ctx, edge=6, source=0, src=1)
        return got
    res = run_local(2, body, timeout=60)
    assert res[1] == (3, [1, 2], ["x"]) and res[0] == (None, [], ["x"])


def test_avg_is_a_divided_sum_where_the_count_is_known() -> None:
    assert Reduction("mean").finalize(np.array([2.0, 4.0]), 2).tolist() == [1.0, 2.0]
    assert Reduction("avg").finalize(6, 4) == 1.5
    assert Reduction("sum").finalize(6, 4) == 6
    assert Reduction("avg").finalize(np.array([3, 4]), 2).dtype == np.float64

    def body(ctx):
        with AllReduce(ctx, edge=1, op="avg") as op:
            got = op.allreduce(np.full(3, ctx.rank * 3.0))
        with Reduce(ctx, edge=2, op="avg") as red, pytest.raises(ConfigError, match="cannot average"):
            red.send(ctx.rank, 1.0)
        with pytest.raises(ConfigError, match="cannot average"):
            KeyedReduce(ctx, edge=3, op="mean")
        return got.tolist()
    assert run_local(3, body, timeout=60) == [[3.0] * 3] * 3


def test_without_a_context_the_error_says_to_init() -> None:
    import twisternet.functional as F
    F._current = None
    with pytest.raises(TwisternetError, match="tn.init"):
        tn.all_reduce(1)


def test_importing_twisternet_does_not_import_torch() -> None:
    code = "import sys, twisternet, collectives; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=job_env(), capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "False", out.stderr


def test_operations_of_handles_nobody_waits_for_are_closed() -> None:
    """A torch Work waits on the handle's future, never on wait(): the stream still closes the
    operation and frees its automatic edge, so the counter can wrap around without a clash."""
    import time

    from collectives.edges import _claims

    def body(ctx):
        futs = [tn.broadcast(i, src=0, async_op=True, ctx=ctx).get_future() for i in range(20)]
        assert [f.result(timeout=60) for f in futs] == list(range(20))
        deadline = time.monotonic() + 60
        while any(e >= AUTO_EDGE_BASE for e in _claims.get(ctx, {})):
            assert time.monotonic() < deadline, sorted(_claims.get(ctx, {}))
            time.sleep(0.05)
        return True
    assert run_local(2, body, timeout=120) == [True, True]


def test_allreduce_async_of_an_operation() -> None:
    def body(ctx):
        with AllReduce(ctx, edge=3) as op:
            hs = [op.allreduce_async(np.full(4, float(i + ctx.rank))) for i in range(3)]
            return [h.wait()[0] for h in hs]
    assert run_local(2, body, timeout=60) == [[1.0, 3.0, 5.0]] * 2


@pytest.mark.parametrize("world", [2, 3, 5])     # 3 and 5: recursive doubling folds ranks in and out
def test_barrier_returns_only_after_every_rank_entered(world: int) -> None:
    """Rank 0 enters last (after every other rank is about to enter); no rank leaves before it entered,
    in the blocking and the non-blocking form."""
    import threading
    entered: list[int] = []
    lock = threading.Lock()
    others = [threading.Event() for _ in range(2)]
    count = [0, 0]

    def body(ctx):
        seen = []
        for i, blocking in enumerate((True, False)):
            if ctx.rank == 0:
                others[i].wait(60)
            with lock:
                entered.append(ctx.rank)
                if ctx.rank:
                    count[i] += 1
                    if count[i] == world - 1:
                        others[i].set()
            if blocking:
                tn.barrier(ctx=ctx)
            else:
                tn.barrier(async_op=True, ctx=ctx).wait(60)
            with lock:
                seen.append(sorted(entered).count(0))
        return seen
    assert run_local(world, body, timeout=120) == [[1, 2]] * world
