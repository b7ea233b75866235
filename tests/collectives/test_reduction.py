"""Reductions (collectives.reduction): the named ones against Python's operators, callables, bad
reductions, snapshot and own."""

from __future__ import annotations

import operator

import numpy as np
import pytest

from collectives.reduction import Reduction, own, snapshot


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
