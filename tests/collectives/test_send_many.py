"""``send_many`` of KeyedReduce, Gather, AllGather and KeyedGather against per-record ``send`` and a
sequential reference; the column wire format and the fast snapshot/own paths."""

from __future__ import annotations

import collections
import copy

import numpy as np
import pytest
from hypothesis import given, strategies as st

import collectives as C
from collectives.columns import from_columns, to_columns
from collectives.reduction import own, snapshot
from twisternet.testing import run_local

pytestmark = pytest.mark.timeout(120)


def _words(rank: int, n: int) -> list:
    return [f"w{(i * 7919 + rank * 31) % 97}" for i in range(n)]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("key_type", ["str", "int", "object"])
def test_keyed_reduce_send_many_mixed_with_send(world: int, key_type: str) -> None:
    def key(w: str):
        return {"str": w, "int": int(w[1:]) - 50, "object": ("k", w)}[key_type]

    def body(ctx):
        kr = C.KeyedReduce(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1, op="sum",
                           key_type=key_type, mode="batch", limit=16)
        task = ctx.my_tasks[0]
        words = _words(ctx.rank, 3000)
        kr.send_many(task, collections.Counter(key(w) for w in words[:2000]), chunk=7)
        for w in words[2000:]:
            kr.send(task, key(w), 1)          # same keys through send: must meet at the same destination
        kr.finish(task)
        return list(kr.results(task))

    res = run_local(world, body, timeout=100)
    want = collections.Counter(key(w) for r in range(world) for w in _words(r, 3000))
    got: dict = {}
    for per_rank in res:
        for k, v in per_rank:
            assert k not in got, f"key {k!r} reduced at two destinations"
            got[k] = v
    assert got == dict(want)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("cls", ["Gather", "AllGather"])
def test_gather_send_many_equals_send(world: int, cls: str) -> None:
    def records(rank: int) -> list:
        return [{"id": i, "rank": rank, "tags": [i % 3]} if i % 5 == 0 else {"id": i, "rank": rank}
                for i in range(1500)]

    def body(ctx):
        op = getattr(C, cls)(ctx, sources=ctx.tasks, edge=1, mode="batch")
        task = ctx.my_tasks[0]
        recs = records(ctx.rank)
        op.send_many(task, iter(recs[:1000]), chunk=64)
        for r in recs[:1000]:
            r["id"] = -1                       # changed after send_many: the sent copies must not change
            if "tags" in r:
                r["tags"].append("x")
        for r in recs[1000:]:
            op.send(task, r)
        op.finish(task)
        return list(op.results()) if ctx.my_tasks[0] in op.local_destinations else None

    res = run_local(world, body, timeout=100)
    want = [(r, rec) for r in range(world) for rec in records(r)]
    got = [x for x in res if x is not None]
    assert got and all(g == want for g in got)


def test_keyed_gather_send_many() -> None:
    def body(ctx):
        kg = C.KeyedGather(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1, key_type="int", mode="batch")
        task = ctx.my_tasks[0]
        kg.send_many(task, [(i % 10, (ctx.rank, i)) for i in range(200)], chunk=9)
        kg.send_many(task, {100 + ctx.rank: "mapping"})
        kg.finish(task)
        return list(kg.results(task))

    res = run_local(2, body, timeout=60)
    got = dict(kv for per in res for kv in per)
    for k in range(10):
        assert got[k] == [(r, i) for r in range(2) for i in range(200) if i % 10 == k]
    assert got[100] == ["mapping"] and got[101] == ["mapping"]


def test_send_many_checks_its_arguments() -> None:
    def body(ctx):
        g = C.Gather(ctx, sources=ctx.tasks, edge=1)
        kr = C.KeyedReduce(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=2, op="sum", key_type="int")
        out = []
        for call in (lambda: g.send_many(0, [1], chunk=0), lambda: g.send_many(5, [1]),
                     lambda: kr.send_many(0, {"not-an-int": 1})):
            try:
                call()
                out.append("accepted")
            except (ValueError, TypeError) as e:
                out.append(type(e).__name__)
        return out

    assert run_local(1, body) == [["ValueError", "ValueError", "TypeError"]]


@given(st.lists(st.tuples(st.integers(), st.text(max_size=5), st.none() | st.floats(allow_nan=False)),
                max_size=30))
def test_columns_round_trip(rows: list) -> None:
    assert from_columns(to_columns(rows, 3), 3) == rows


@pytest.mark.parametrize("bad", [None, [[1], [2, 3]], [[1]], [(1,), (2,)], "ab"])
def test_columns_reject_malformed(bad) -> None:
    with pytest.raises(ValueError):
        from_columns(bad, 2)


def test_snapshot_and_own_fast_paths_keep_copy_semantics() -> None:
    flat = {"a": 1, "b": "x", "c": None}
    s = snapshot(flat)
    assert s == flat and s is not flat                  # a copy: later changes don't reach it
    nested = {"a": [1, 2], "b": {"c": 3}}
    d = snapshot(nested)
    nested["a"].append(3)
    nested["b"]["c"] = 4
    assert d == {"a": [1, 2], "b": {"c": 3}}
    lst = [1, "a"]
    assert snapshot(lst) == lst and snapshot(lst) is not lst
    arr = np.arange(4)
    assert snapshot(arr) is not arr and np.array_equal(snapshot(arr), arr)
    base = np.arange(6)
    view = base[2:]
    owned = own({"v": view, "n": 1})
    assert owned["v"].base is None and np.array_equal(owned["v"], view)
    plain = {"x": 1}
    assert own(plain) is plain                          # decoded plain records need no copy
    assert own((1, [view]))[1][0].base is None
    assert copy.deepcopy(nested) == nested
