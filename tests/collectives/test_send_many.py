"""``send_many`` of KeyedReduce, Gather, AllGather and KeyedGather against per-record ``send`` and a
sequential reference; the column wire format and the fast snapshot/own paths."""

from __future__ import annotations

import collections
import copy
import os

import numpy as np
import pytest
from hypothesis import given, strategies as st

import collectives as C
from collectives.columns import from_columns, to_columns
from collectives.reduction import own, snapshot
from twisternet.errors import TwisternetError
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
@pytest.mark.parametrize("chunk", [64, 512])     # buffered (copied) / sent at once (encoded, not copied)
def test_gather_send_many_equals_send(world: int, cls: str, chunk: int) -> None:
    def records(rank: int) -> list:
        return [{"id": i, "rank": rank, "tags": [i % 3]} if i % 5 == 0 else {"id": i, "rank": rank}
                for i in range(1500)]

    def body(ctx):
        op = getattr(C, cls)(ctx, sources=ctx.tasks, edge=1, mode="batch")
        task = ctx.my_tasks[0]
        recs = records(ctx.rank)
        op.send_many(task, iter(recs[:1000]), chunk=chunk)
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


@pytest.mark.parametrize("cls", ["Gather", "AllGather"])
def test_gather_values_and_copy_false(cls: str) -> None:
    """values() is results() without the sources; copy=False keeps this rank's own records by reference."""
    def body(ctx):
        op = getattr(C, cls)(ctx, sources=ctx.tasks, edge=1, mode="batch")
        task = ctx.my_tasks[0]
        recs = [{"id": i, "rank": ctx.rank} for i in range(700)]
        op.send_many(task, recs, chunk=300, copy=False)
        op.send(task, recs[0], copy=False)
        op.finish(task)
        if task not in op.local_destinations:
            return None
        vals = list(op.values())
        mine = [v for v in vals if v["rank"] == ctx.rank]
        return vals, all(a is b for a, b in zip(mine, recs + [recs[0]]))

    res = run_local(3, body, timeout=100)
    want = [{"id": i, "rank": r} for r in range(3) for i in list(range(700)) + [0]]
    got = [x for x in res if x is not None]
    assert got and all(vals == want and same for vals, same in got)


def test_allgather_sources_apart_from_destinations_and_several_tasks_per_rank() -> None:
    """Batch AllGather's direct exchange: destinations that are no source, ranks with several tasks,
    every destination with the records of every source by source task then send order."""
    plan = {0: 0, 1: 0, 2: 1, 3: 2, 4: 2}

    def body(ctx):
        op = C.AllGather(ctx, sources=[0, 1, 3], destinations=[1, 2, 4], edge=1, mode="batch")
        for t in op.local_sources:
            op.send_many(t, [(t, i) for i in range(300)], chunk=128)
            op.send(t, (t, "last"))
            op.finish(t)
        return {t: list(op.results(t)) for t in op.local_destinations}

    res = run_local(3, body, plan=plan, timeout=100)
    want = [(t, (t, i)) for t in (0, 1, 3) for i in [*range(300), "last"]]
    got = {t: v for per in res for t, v in per.items()}
    assert sorted(got) == [1, 2, 4] and all(v == want for v in got.values())


def test_allgather_spills_past_the_memory_bound(tmp_path) -> None:
    def body(ctx):
        op = C.AllGather(ctx, sources=ctx.tasks, edge=1, mode="batch")
        task = ctx.my_tasks[0]
        op.send_many(task, [f"{ctx.rank}-{i}-" + "x" * 50 for i in range(3000)])
        op.finish(task)
        out = list(op.values())
        return out, op.spilled_bytes

    res = run_local(2, body, memory_limit=64 << 10, spill_dir=str(tmp_path), timeout=100)
    want = [f"{r}-{i}-" + "x" * 50 for r in range(2) for i in range(3000)]
    assert all(out == want for out, _ in res)
    assert all(spilled > 0 for _, spilled in res)
    assert not any(f for _, _, f in os.walk(tmp_path))


def test_values_is_for_batch_results() -> None:
    def body(ctx):
        out = []
        g = C.Gather(ctx, sources=ctx.tasks, edge=1, mode="streaming")
        try:
            g.values()
        except TwisternetError as e:
            out.append(str(e))
        g.abort()
        p = C.Partition(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=2)
        p.send(0, {"a": 1}, destination=0, copy=False)
        p.finish(0)
        out.append(list(p.values()))
        return out

    (res,) = run_local(1, body)
    assert "batch" in res[0] and res[1] == [{"a": 1}]


def test_broadcast_and_partition_copy_flag() -> None:
    def body(ctx):
        task = ctx.my_tasks[0]
        b = C.Broadcast(ctx, sources=[0], destinations=ctx.tasks, edge=1)
        p = C.Partition(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=2)
        kept, copied = {"v": [1]}, {"v": [2]}
        if ctx.rank == 0:
            b.send(task, kept, copy=False)
            b.send(task, copied)
            b.finish(task)
        p.send(task, kept, destination=task, copy=False)
        p.send(task, copied, destination=task)
        p.send(task, copied, destination=1 - task)
        p.finish(task)
        got_b, got_p = list(b.results()), list(p.values())
        copied["v"].append("changed")
        return got_b, got_p, got_b[0] is kept, any(x is kept for x in got_p), got_b[1] is copied

    res = run_local(2, body, timeout=60)
    for rank, (got_b, got_p, b_same, p_same, b_copied_same) in enumerate(res):
        assert got_b == [{"v": [1]}, {"v": [2]}]
        assert [x for x in got_p if x == {"v": [1]}] == [{"v": [1]}]
        assert b_same is (rank == 0) and p_same and not b_copied_same


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


@pytest.mark.parametrize("op", ["sum", "max", "concat"])
def test_streaming_keyed_reduce_running_values(op: str) -> None:
    """Every record yields one running update, equal to a sequential fold; updates never alias the
    running state (a consumer changing an update must not change later ones), scalars or not."""
    def concat(a, b):
        return a + b

    def value(rank: int, i: int):
        return [rank, i] if op == "concat" else (i * 3 + rank) % 17 + 0.5 * (i % 2)

    def body(ctx):
        kr = C.KeyedReduce(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1,
                           op=concat if op == "concat" else op, key_type="str", mode="streaming")
        task = ctx.my_tasks[0]
        got = []
        kr.send_many(task, [(f"k{i % 7}", value(ctx.rank, i)) for i in range(400)])
        kr.finish(task)
        for k, v in kr.results(task):
            got.append((k, copy.deepcopy(v)))
            if isinstance(v, list):
                v.append("consumer scribble")
        return got

    res = run_local(2, body, timeout=60)
    fold = {"sum": lambda a, b: a + b, "max": max, "concat": lambda a, b: a + b}[op]
    finals = {}
    for per in res:
        seen: dict = {}
        for k, v in per:
            assert k not in finals
            seen[k] = v
        finals.update(seen)
        assert len(per) == sum(1 for r in range(2) for i in range(400) if f"k{i % 7}" in seen)
    for k, v in finals.items():
        vals = [value(r, i) for r in range(2) for i in range(400) if f"k{i % 7}" == k]
        want = vals[0]
        for x in vals[1:]:
            want = fold(want, x)
        if op == "concat":
            assert sorted(map(tuple, zip(v[::2], v[1::2]))) == sorted(map(tuple, zip(want[::2], want[1::2])))
        else:
            assert v == want


@pytest.mark.parametrize("world", [1, 2, 3])
def test_streaming_sends_held_back_keep_every_update_in_order(world: int) -> None:
    """Per-record sends in a stream are held back and handed over in batches: every destination still
    sees each source's updates of a key in send order, interleaved with send_many, arrays (taken at
    once) and offer, and nothing is left behind at finish."""
    def body(ctx):
        kr = C.KeyedReduce(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1, op="sum", key_type="object",
                           mode="streaming")
        task = ctx.my_tasks[0]
        got: list = []

        def consume():
            for k, v in kr.results(task):
                got.append((k, v.copy() if isinstance(v, np.ndarray) else v))
        import threading
        th = threading.Thread(target=consume)
        th.start()
        for i in range(3000):
            kr.send(task, ("k", i % 7), 1)
            if i % 500 == 499:
                kr.send_many(task, [(("k", j), 1) for j in range(7)])
            if i % 1000 == 999:
                arr = np.ones(3)
                kr.send(task, ("a", 0), arr)
                arr[:] = 100             # changed after send(): the record holds what was sent
            if i % 700 == 0:
                while not kr.offer(task, ("o", 0), 2):
                    pass
        kr.finish(task)
        th.join(60)
        return got

    res = run_local(world, body, timeout=100)
    seen: dict = {}
    for per_rank in res:
        for k, v in per_rank:
            seen.setdefault(k, []).append(v)
    for j in range(7):                   # running sums: every update, in order, +1 or +world at a time
        ups = seen[("k", j)]
        assert ups == sorted(ups) and ups[-1] == world * (3000 // 7 + (1 if j < 3000 % 7 else 0) + 6)
        assert len(ups) == world * (3000 // 7 + (1 if j < 3000 % 7 else 0) + 6)
    assert [list(v) for v in seen[("a", 0)]][-1] == [3.0 * world] * 3
    assert seen[("o", 0)][-1] == 2 * 5 * world


def test_a_held_back_record_goes_without_another_call_from_its_sender() -> None:
    """A record held back behind a stream is handed over by the engine within flush_delay, while the
    sending thread does nothing more with twisternet (here: waits on an Event the receiver sets)."""
    import threading
    arrived = threading.Event()
    world = 3

    def body0(ctx):
        kr = C.KeyedReduce(ctx, sources=[1, 2], destinations=[0], edge=1, op="sum", key_type="str",
                           mode="streaming")
        if ctx.rank == 0:
            seen = 0
            for _k, _v in kr.results(0):
                seen += 1
                if seen == 4:
                    arrived.set()
            return seen
        task = ctx.my_tasks[0]
        kr.send(task, f"x{task}", 1)            # after a pause: handed over at once
        kr.send(task, f"y{task}", 1)            # right behind it: held back
        ok = arrived.wait(30)                   # no twisternet call from this thread until both arrived
        kr.finish(task)
        return ok

    out = run_local(world, body0, timeout=60)
    assert out == [4, True, True]


@pytest.mark.parametrize("mode", ["streaming", "batch"])
def test_keyed_gather_sends_held_back_arrive_complete_and_in_order(mode: str) -> None:
    """KeyedGather per-record sends held back in a stream: every record arrives once, each source's
    records of a key in send order, with send_many mixed in; a list changed after send() arrives as
    it was sent (copy=True), a scalar sent with copy=False too."""
    world = 3

    def body(ctx):
        kg = C.KeyedGather(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1, key_type="int", mode=mode,
                           group=False)
        task = ctx.my_tasks[0]
        got: list = []

        def consume():
            for k, v in kg.results(task):
                got.append((k, v))
        import threading
        th = threading.Thread(target=consume)
        th.start()
        for i in range(2000):
            kg.send(task, i % 5, (task, i), copy=i % 2 == 0)
            if i % 400 == 399:
                kg.send_many(task, [(j, (task, 10_000 + i + j)) for j in range(5)])
            if i % 900 == 0:
                lst = [task, i]
                kg.send(task, 99, lst)
                lst.append("changed")
        kg.finish(task)
        th.join(60)
        return got

    res = run_local(world, body, timeout=100)
    records = [kv for per_rank in res for kv in per_rank]
    assert len(records) == world * (2000 + 5 * 5 + 3)
    by: dict = {}
    for k, v in records:
        by.setdefault((k, v[0]), []).append(v[1])
    for (k, _src), seq in by.items():
        if k == 99:
            assert sorted(seq) == [0, 900, 1800]
            continue
        plain = [i for i in seq if i < 10_000]
        assert plain == sorted(plain) and len(plain) == len(set(plain)) == len(range(k, 2000, 5))
    assert all(len(v) == 2 for k, v in records if k == 99)
