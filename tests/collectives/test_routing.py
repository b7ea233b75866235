"""Routing (collectives.routing): k-ary tree shapes, the process-independent stable key hash,
hash_selector's spread and normalize_key."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, strategies as st

from collectives.routing import KaryTree, hash_selector, normalize_key, stable_hash
from tests.jobs import job_env
from twisternet.errors import ConfigError


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
