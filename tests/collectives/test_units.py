"""Unit tests of the pure parts: trees, key hashing and routing, reductions, edge claims, spill store."""

from __future__ import annotations

import os
import subprocess
import sys
import operator

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import collectives as C
from collectives.edges import EDGE_SPAN, MAX_USER_EDGE, UP_BASE, channel_edge, claim_edge, release_edge
from collectives.reduction import Reduction, own, snapshot
from collectives.routing import KaryTree, hash_selector, normalize_key, stable_hash
from collectives.spill import SpillCorruptionError, SpillStore, read_run
from tests.jobs import job_env
from twisternet.errors import ConfigError, TwisternetError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------------------ trees
@given(st.sets(st.integers(0, 200), min_size=1, max_size=60), st.integers(1, 5), st.data())
def test_tree_shape(members: set, fanout: int, data) -> None:
    root = data.draw(st.sampled_from(sorted(members)))
    t = KaryTree(root, members, fanout)
    assert t.parent(root) is None and t.level(root) == 0
    seen = set()
    for r in members:
        kids = t.children(r)
        assert len(kids) <= fanout
        for k in kids:
            assert t.parent(k) == r and t.level(k) == t.level(r) + 1
            assert k not in seen
            seen.add(k)
    assert seen == members - {root}                 # every member but the root has exactly one parent
    assert t.subtree(root) == members
    assert t.depth == max(t.level(r) for r in members)
    if fanout >= 2:
        assert t.depth <= len(members).bit_length()


def test_tree_too_deep() -> None:
    with pytest.raises(ConfigError, match="fanout"):
        KaryTree(0, range(100), 1)
    with pytest.raises(ConfigError, match="fanout"):
        KaryTree(0, range(3), 0)


# ------------------------------------------------------------------------------------------ keys
def test_stable_hash_is_process_independent() -> None:
    keys = ["apple", b"\x00\xff", 12345678901234567890123, -7, 3.25, ("k", 1), "ünïcode"]
    mine = [stable_hash(k) for k in keys]
    code = (f"from collectives.routing import stable_hash; "
            f"print([stable_hash(k) for k in {keys!r}])")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], env=job_env(PYTHONHASHSEED=seed),
                             capture_output=True, text=True, timeout=60, check=True).stdout
        assert eval(out) == mine


@given(st.lists(st.text(max_size=8), min_size=1, max_size=200))
def test_hash_selector_spreads_and_is_deterministic(words) -> None:
    dests = [3, 5, 9]
    for w in words:
        d = hash_selector(w, dests)
        assert d in dests and d == hash_selector(w, list(dests))


def test_hash_selector_balance() -> None:
    counts = {d: 0 for d in range(4)}
    for i in range(4000):
        counts[hash_selector(f"word{i}", list(range(4)))] += 1
    assert min(counts.values()) > 800


def test_normalize_key() -> None:
    assert normalize_key(np.int64(5), "int") == 5 and type(normalize_key(np.int64(5), "int")) is int
    assert normalize_key(2, "float") == 2.0
    assert normalize_key(bytearray(b"ab"), "bytes") == b"ab"
    for bad, kt in [(True, "int"), ("1", "int"), (1, "str"), ([1], "object"), ("x", "bytes")]:
        with pytest.raises(TypeError):
            normalize_key(bad, kt)
    with pytest.raises(ConfigError):
        normalize_key(1, "decimal")


# ------------------------------------------------------------------------------------------ reductions
@pytest.mark.parametrize("name,ref", [("sum", operator.add), ("prod", operator.mul), ("max", max), ("min", min)])
def test_named_reductions(name, ref) -> None:
    r = Reduction(name)
    rng = np.random.default_rng(1)
    a, b = rng.integers(-5, 5, 6), rng.integers(-5, 5, 6)
    acc = a.copy()
    out = r.combine(acc, b)
    expect = {"sum": a + b, "prod": a * b, "max": np.maximum(a, b), "min": np.minimum(a, b)}[name]
    assert np.array_equal(out, expect)
    assert out is acc                                 # fast path: in place
    assert r.combine(3, 4) == ref(3, 4)
    # a dtype promotion must not truncate: int acc + float value gives a new float array
    f = r.combine(np.array([1, 2]), np.array([0.5, 0.5]))
    assert f.dtype == np.float64
    assert r.named


def test_callable_and_bad_reductions() -> None:
    r = Reduction(lambda a, b: a + b)
    assert r.combine([1], [2]) == [1, 2] and not r.named
    with pytest.raises(ValueError):
        Reduction("median")   # "avg"/"mean" are named reductions now
    with pytest.raises(TypeError):
        Reduction(42)  # type: ignore[arg-type]


def test_snapshot_and_own() -> None:
    a = np.arange(4)
    s = snapshot(a)
    a[0] = 99
    assert s[0] == 0
    d = {"x": [1, 2]}
    sd = snapshot(d)
    d["x"].append(3)
    assert sd == {"x": [1, 2]}
    base = np.arange(10)
    view = base[2:5]
    owned = own((1, [view]))
    assert owned[1][0].base is None and np.array_equal(owned[1][0], view)
    t = ("a", 1)
    assert snapshot(t) is t


# ------------------------------------------------------------------------------------------ edges
def test_edge_claims() -> None:
    class Ctx:
        pass
    ctx = Ctx()
    claim_edge(ctx, 3, "A")
    with pytest.raises(ConfigError, match="already used by A"):
        claim_edge(ctx, 3, "B")
    claim_edge(Ctx(), 3, "other process")           # per context
    release_edge(ctx, 3)
    claim_edge(ctx, 3, "B")
    assert channel_edge(3, 0) == 3 * EDGE_SPAN and channel_edge(3, UP_BASE) == 3 * EDGE_SPAN + UP_BASE
    assert channel_edge(MAX_USER_EDGE - 1, EDGE_SPAN - 1) < 2**31 - 1024
    with pytest.raises(ValueError):
        channel_edge(1, EDGE_SPAN)


# ------------------------------------------------------------------------------------------ spill
records = st.lists(st.tuples(st.integers(-20, 20), st.one_of(st.integers(), st.text(max_size=30),
                                                             st.binary(max_size=30))), max_size=300)


@settings(max_examples=60, deadline=None)
@given(records, st.booleans(), st.sampled_from([1024, 2048, 1 << 20]))
def test_spill_store_matches_stable_sort(tmp_path_factory, recs, sort, limit) -> None:
    d = tmp_path_factory.mktemp("spill")
    store = SpillStore(limit, str(d), sort=sort)
    store.block_bytes = 256        # many blocks per run
    store.fan_in = 3               # exercise the multi-pass merge
    for k, v in recs:
        store.add(k, v)
    expect = sorted(recs, key=lambda r: r[0]) if sort else list(recs)
    assert list(store) == expect
    assert list(store) == expect   # re-iterable
    assert len(store) == len(recs)
    store.close()
    assert not any(f for _, _, f in os.walk(d))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.lists(st.integers(), max_size=40), st.booleans()), max_size=60),
       st.booleans(), st.sampled_from([1024, 4096, 1 << 20]))
def test_chunked_spill_store_matches_stable_sort(tmp_path_factory, adds, sort, limit) -> None:
    """A chunked store (add_chunk, add growing the open chunk) yields what a plain store of the same
    records yields, spilled or not; values() the values alone."""
    d = tmp_path_factory.mktemp("spill")
    store = SpillStore(limit, str(d), sort=sort, chunked=True)
    store.chunk_values = 7
    store.block_bytes = 256
    store.fan_in = 3
    recs = []
    for k, vals, one_by_one in adds:
        if one_by_one:
            for v in vals:
                store.add(k, v)
        else:
            store.add_chunk(k, list(vals))
        recs += [(k, v) for v in vals]
    expect = sorted(recs, key=lambda r: r[0]) if sort else recs
    assert list(store) == expect and list(store) == expect
    assert list(store.values()) == [v for _, v in expect]
    assert len(store) == len(recs)
    store.close()
    assert not any(f for _, _, f in os.walk(d))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(-5, 5), st.binary(max_size=40)), max_size=80), max_size=12),
       st.sampled_from([1024, 8192, 1 << 20]))
def test_spill_store_add_many_matches_add(tmp_path_factory, batches, limit) -> None:
    d = tmp_path_factory.mktemp("spill")
    many, one = SpillStore(limit, str(d)), SpillStore(limit, str(d))
    for batch in batches:
        many.add_many(list(batch))
        for k, v in batch:
            one.add(k, v)
    flat = [r for b in batches for r in b]
    assert list(many) == list(one) == sorted(flat, key=lambda r: r[0])
    assert len(many) == len(flat)
    if limit == 1024 and sum(len(v) for _, v in flat) > 20_000:
        assert many.runs > 0                     # the bound holds for batches too
    many.close()
    one.close()


def test_spill_blocks_keep_cycles_and_shared_values(tmp_path) -> None:
    """Spill blocks are pickled without the memo for speed; a self-referencing record still goes
    through (the usual pickler takes over) and comes back with its cycle."""
    cyclic: list = [1]
    cyclic.append(cyclic)
    shared = {"s": 1}
    store = SpillStore(1024, str(tmp_path))
    for i in range(200):
        store.add(i % 5, [shared, i])
    store.add(2, cyclic)
    assert store.runs > 0
    out = list(store)
    assert len(out) == 201 and [k for k, _ in out] == sorted(k for k, _ in out)
    back = next(v for _, v in out if v and v[0] == 1)
    assert back[1] is back
    assert all(v[0] == {"s": 1} for _, v in out if v[0] != 1)
    store.close()


def test_chunked_store_checks() -> None:
    plain = SpillStore(1 << 20)
    with pytest.raises(TwisternetError, match="chunked=True"):
        plain.add_chunk(0, [1])
    plain.add(0, "a")
    assert list(plain.values()) == ["a"]
    store = SpillStore(1 << 20, chunked=True)
    chunk = [1, 2]
    store.add_chunk(0, chunk)
    store.add(0, 3)                        # grows the open chunk
    store.add(1, 4)
    list(store)
    store.add(0, 5)                        # after a read a new chunk starts: order stays stable
    assert list(store) == [(0, 1), (0, 2), (0, 3), (0, 5), (1, 4)]
    store.close()
    with pytest.raises(TwisternetError, match="closed"):
        store.add_chunk(0, [1])


def test_spill_store_spills_and_removes(tmp_path) -> None:
    store = SpillStore(4096, str(tmp_path))
    for i in range(2000):
        store.add(i % 7, "x" * 20)
    assert store.runs > 3 and store.directory is not None
    assert len(list(store)) == 2000
    store.close()
    assert not os.path.exists(store.directory)


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_spill_corruption_detected(tmp_path, damage) -> None:
    store = SpillStore(2048, str(tmp_path))
    for i in range(500):
        store.add(i, f"value-{i}")
    path = os.path.join(store.directory, sorted(os.listdir(store.directory))[0])
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[:-5]
    else:
        data[:4] = b"JUNK"
    open(path, "wb").write(bytes(data))
    with pytest.raises(SpillCorruptionError, match="spill file"):
        list(store)
    with pytest.raises(SpillCorruptionError):
        list(read_run(path))
    store.close()
    assert not os.path.exists(os.path.dirname(path))


def test_spill_unorderable_keys(tmp_path) -> None:
    store = SpillStore(1 << 20, str(tmp_path))
    store.add(1, "a")
    store.add("b", "b")
    with pytest.raises(TypeError, match="orderable"):
        list(store)
    store.close()


def test_public_api() -> None:
    for name in C.__all__:
        assert hasattr(C, name), name
