"""Operations that go wrong on local threads: timeouts that name the missing sources, many operations at
once and edge conflicts, bad arguments, reduce functions that raise (also on the progress thread), and
a dead peer failing the waiters fast; plus callback delivery."""

from __future__ import annotations

import random
import threading
import time

import pytest

import collectives as C
from twisternet.errors import RemoteError, ConfigError, OperationTimeout
from twisternet.testing import run_local


@pytest.mark.timeout(60)
def test_timeout_names_missing_sources() -> None:
    # tasks 0,1 on rank 0; 2,3 on rank 1 (an inner tree node's subtree); task 3 never finishes in time
    plan = {0: 0, 1: 0, 2: 1, 3: 1}

    def body(ctx):
        op = C.Gather(ctx, [0, 1, 2, 3], [0], 11, timeout=30)
        for t in op.local_sources:
            op.send(t, t)
        if ctx.rank == 0:
            op.finish(0)
            op.finish(1)
            with pytest.raises(OperationTimeout) as ei:
                list(op.results(timeout=0.5))
            e = ei.value
            ctx.send(1, 1000, "go")  # let rank 1 finish task 3
            out = list(op.results())
            return e.missing_sources, e.edge, e.operation, str(e), out
        got = threading.Event()
        ctx.register(1000, lambda src, obj: got.set() or True)
        op.finish(2)
        assert got.wait(20)
        op.finish(3)
        op.close()
        return None
    missing, edge, operation, text, out = run_local(2, body, plan=plan, timeout=50)[0]
    assert missing == [3] and edge == 11 and operation == "Gather"
    assert "sources that never finished=[3]" in text
    assert out == [(0, 0), (1, 1), (2, 2), (3, 3)]


@pytest.mark.timeout(60)
def test_many_ops_at_once_and_edge_conflicts() -> None:
    def body(ctx):
        ops = [C.Reduce(ctx, None, 0, e) for e in range(5)]
        with pytest.raises(ConfigError, match="already used"):
            C.Gather(ctx, None, 0, 3)
        order = list(range(5))
        random.Random(ctx.rank).shuffle(order)
        for e in order:
            ops[e].send(ctx.rank, e * (ctx.rank + 1))
            ops[e].finish(ctx.rank)
        out = [op.result() if ctx.rank == 0 else None for op in ops]
        for op in ops:
            op.close()
        again = C.Gather(ctx, None, 0, 3)  # the edge is free again after close
        again.abort()
        return out
    res = run_local(3, body)
    assert res[0] == [e * 6 for e in range(5)]


@pytest.mark.timeout(60)
def test_callback_delivery() -> None:
    seen: dict[int, list] = {}
    lock = threading.Lock()

    def cb(task, item):
        with lock:
            seen.setdefault(task, []).append(item)

    def body(ctx):
        b = C.Broadcast(ctx, 0, None, 1, mode="streaming", callback=cb)
        if ctx.rank == 0:
            for i in range(20):
                b.send(0, i)
            b.finish(0)
        ctx.wait_until(b.done, timeout=20)
        with pytest.raises(Exception, match="callback"):
            b.results()
        kr = C.KeyedReduce(ctx, None, [1], 2, key_type="int", callback=cb)
        kr.send(ctx.rank, 5, 1)
        kr.finish(ctx.rank)
        kr.close()
        return True
    run_local(3, body)
    assert seen[0] == list(range(20)) and seen[2] == list(range(20))
    assert seen[1] == list(range(20)) + [(5, 3)]


def test_bad_arguments() -> None:
    def body(ctx):
        with pytest.raises(ConfigError, match="mode"):
            C.Gather(ctx, None, 0, 1, mode="eventually")
        with pytest.raises(ConfigError, match="exactly one destination"):
            C.Reduce(ctx, None, [0, 1], 1)
        with pytest.raises(ConfigError, match="destinations"):
            C.Gather(ctx, None, [99], 1)
        with pytest.raises(ConfigError, match="edge"):
            C.Gather(ctx, None, 0, -1)
        with pytest.raises(ConfigError, match="edge"):
            C.Gather(ctx, None, 0)
        with pytest.raises(ConfigError, match="key_type"):
            C.KeyedReduce(ctx, None, 0, 1, key_type="complex")
        with pytest.raises(ValueError, match="unknown reduction"):
            C.Reduce(ctx, None, 0, 1, op="average")
        kr = C.KeyedReduce(ctx, None, [0, 1], 2, key_type="int")
        with pytest.raises(TypeError, match="key_type"):
            kr.send(0, "seven", 1)
        with pytest.raises(ValueError, match="not a source"):
            kr.send(5, 1, 1)
        kr.finish(0)
        with pytest.raises(ValueError, match="already finished"):
            kr.send(0, 1, 1)
        bad = C.KeyedGather(ctx, None, [0, 1], 3, key_type="int", selector=lambda k, d: 42)
        with pytest.raises(ValueError, match="selector"):
            bad.send(0, 1, 1)
        with pytest.raises(ValueError, match="task="):
            list(kr.results())
        return True
    assert run_local(1, body, plan={0: 0, 1: 0}) == [True]


@pytest.mark.timeout(60)
def test_reduce_function_error_surfaces() -> None:
    def boom(a, b):
        raise ArithmeticError("reduce failed")

    def body(ctx):
        op = C.Reduce(ctx, None, 0, 1, op=boom, timeout=10)
        if ctx.rank == 0:
            op.send(0, 1)
            with pytest.raises(ArithmeticError, match="reduce failed"):
                op.send(0, 5)         # a local combine fails in the caller's own thread
            with pytest.raises(ArithmeticError, match="reduce failed"):
                op.finish(0)          # and the operation stays failed
            return True
        # the failure reaches rank 1 too (RemoteError naming rank 0), at whichever of its
        # calls comes after the failure arrived: rank 0 does not wait for rank 1 to send
        with pytest.raises(RemoteError, match="rank 0 failed: ArithmeticError: reduce failed"):
            op.send(1, 2)
            op.finish(1)
            op._wait(lambda: False, "the failure", None, 10)
        return True
    assert run_local(2, body) == [True, True]


def test_reduce_function_error_on_the_progress_thread_reaches_the_sources() -> None:
    def boom(a, b):
        raise ArithmeticError("reduce failed")

    def body(ctx):
        op = C.Reduce(ctx, None, 0, 1, op=boom, timeout=10)
        op.send(ctx.rank, ctx.rank + 1)
        op.finish(ctx.rank)
        if ctx.rank == 0:             # the combine with rank 1's partial fails on the progress thread
            with pytest.raises(ArithmeticError, match="reduce failed"):
                op.result()
            return True
        with pytest.raises(RemoteError, match="rank 0 failed"):
            op._wait(lambda: False, "the failure", None, 10)
        return True
    assert run_local(2, body) == [True, True]


@pytest.mark.timeout(60)
def test_dead_peer_fails_waiters_fast() -> None:
    from twisternet.errors import PeerLostError
    seen: dict[int, BaseException] = {}

    def body(ctx):
        op = C.KeyedGather(ctx, None, [0], 1, key_type="int", timeout=30)
        if ctx.rank == 1:
            op.send(ctx.rank, 1, "x")
            raise RuntimeError("worker 1 crashed")
        t = time.monotonic()
        try:
            # the loss may be known already at the send (rank 1 may crash first), at finish(), or
            # only while rank 0 waits for its results
            op.send(ctx.rank, 1, "x")
            op.finish(ctx.rank)
            if ctx.rank == 0:
                list(op.results())
        except PeerLostError as e:
            seen[ctx.rank] = e
            assert time.monotonic() - t < 20
            raise
        return True
    with pytest.raises(RuntimeError, match="crashed"):
        run_local(3, body, timeout=50, peer_timeout=5, heartbeat_interval=0.5)
    assert isinstance(seen[0], PeerLostError) and seen[0].rank == 1
