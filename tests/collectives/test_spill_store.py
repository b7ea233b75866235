"""The spill store (collectives.spill): sorted runs on disk match a stable in-memory sort, blocks keep
shared values, corruption and unorderable keys are detected, files are removed."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings, strategies as st

from collectives.spill import SpillCorruptionError, SpillStore, read_run
from twisternet.errors import TwisternetError


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
