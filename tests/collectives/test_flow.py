"""Back pressure, disk spill, rank-level allreduce and timeout diagnostics."""

from __future__ import annotations

import os
import random
import threading
import time

import numpy as np
import pytest

import collectives as C
from twisternet.errors import RemoteError, BackPressureTimeout, ConfigError, OperationTimeout
from twisternet.testing import run_local

from tests.collectives.scenarios import run_allreduce_calls, run_backpressure, run_spill

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


@pytest.mark.timeout(120)
def test_spill_keyed_gather(tmp_path) -> None:
    world, memory_limit = 3, 16 << 10
    params = {"seed": 7, "n": 3000, "keys": 200, "pad": 40}
    res = run_local(world, run_spill, params, timeout=100, memory_limit=memory_limit, spill_dir=str(tmp_path))
    out = res[0]
    # reference: every (source, i, key) regenerated independently, grouped by key, sources in order
    expect: dict[int, list] = {}
    for s in range(world):
        rng = np.random.default_rng(params["seed"] + s)
        keys = rng.integers(0, params["keys"], size=params["n"]).tolist()
        for i, k in enumerate(keys):
            expect.setdefault(k, []).append(f"{s}:{i}:" + "p" * params["pad"])
    total_bytes = sum(len(v) for vs in expect.values() for v in vs)
    assert total_bytes >= 20 * memory_limit
    assert out["result"] == [[k, expect[k]] for k in sorted(expect)]
    assert out["files_before"] > 0, "nothing was spilled"
    assert out["files_after"] == 0 and out["files_closed"] == 0
    assert not any(files for _, _, files in os.walk(tmp_path))


@pytest.mark.timeout(120)
def test_spill_removed_on_close_without_reading(tmp_path) -> None:
    def body(ctx):
        op = C.Gather(ctx, None, 0, 2)
        for i in range(4000):
            op.send(ctx.rank, "v" * 50 + str(i))
        op.finish(ctx.rank)
        if ctx.rank == 0:
            ctx.wait_until(op.done, timeout=30)
            spilled = sum(len(f) for _, _, f in os.walk(tmp_path))
        else:
            spilled = None
        op.close()
        return spilled
    res = run_local(2, body, timeout=60, memory_limit=32 << 10, spill_dir=str(tmp_path))
    assert res[0] > 0
    assert not any(files for _, _, files in os.walk(tmp_path))


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
        op.send(ctx.rank, ctx.rank + 1)
        if ctx.rank == 0:
            with pytest.raises(ArithmeticError, match="reduce failed"):
                op.send(0, 5)         # a local combine fails in the caller's own thread
            with pytest.raises(ArithmeticError, match="reduce failed"):
                op.finish(0)          # and the operation stays failed
            return True
        # the failure reaches rank 1 too (RemoteError naming rank 0), here at its next wait
        with pytest.raises(RemoteError, match="rank 0 failed: ArithmeticError: reduce failed"):
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


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_spill_bounds_rss(tmp_path) -> None:
    """Memory stays near the bound while gathering >> bound bytes (measured in a fresh process)."""
    import json
    import subprocess
    import sys
    n, pad = 400_000, 120
    probe = os.path.join(os.path.dirname(__file__), "rss_probe.py")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, probe, str(n), str(pad), "4MiB", str(tmp_path)], capture_output=True,
                         text=True, timeout=280, env={**os.environ, "PYTHONPATH": root}, check=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    assert res["count"] == n and res["ordered"]
    assert res["payload"] >= 40 << 20                       # >= 10x the 4 MiB bound in payload alone
    assert res["growth_kib"] < 40 << 10, res                # peak RSS grew by far less than the data
    assert not any(files for _, _, files in os.walk(tmp_path))


@pytest.mark.timeout(60)
def test_dead_peer_fails_waiters_fast() -> None:
    from twisternet.errors import PeerLostError
    seen: dict[int, BaseException] = {}

    def body(ctx):
        op = C.KeyedGather(ctx, None, [0], 1, key_type="int", timeout=30)
        op.send(ctx.rank, 1, "x")
        if ctx.rank == 1:
            raise RuntimeError("worker 1 crashed")
        t = time.monotonic()
        try:
            # the loss may be known already at finish(), or only while rank 0 waits for its results
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
