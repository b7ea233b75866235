"""The adaptive concurrency rule at and around its 10% and 50% boundaries."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectives.barrier import AdaptiveConcurrency, FixedConcurrency
from collectives.barrier.concurrency import exact_median


def policy_with(history, window=1):
    p = AdaptiveConcurrency(window=window)
    for d in history:
        p.record(d)
    return p


# History [10, 10, x] with window 1: overall median 10, recent median x.
@pytest.mark.parametrize("x, expected", [
    (5.0, 2),        # faster
    (10.0, 2),       # same
    (10.9, 2),       # 9% slower
    (11.0, 1),       # exactly 10% slower
    (11.1, 1),
    (12.5, 1),       # 25%
    (15.0, 1),       # exactly 50% slower
    (15.01, 0),      # just above 50%
    (20.0, 0),
])
def test_admit_count_around_the_boundaries(x, expected):
    p = policy_with([10.0, 10.0, x])
    assert p.admit_count() == expected


def test_window_median_uses_the_last_c_completions():
    # all: [1,1,1,1,2,2,2] -> median 1; last 3: [2,2,2] -> 100% slower -> 0
    assert policy_with([1, 1, 1, 1, 2, 2, 2], window=3).admit_count() == 0
    # last 4: [1,2,2,2] -> median 2 -> still 0; window 7 = everything -> 2
    assert policy_with([1, 1, 1, 1, 2, 2, 2], window=7).admit_count() == 2


def test_fewer_completions_than_the_window_admit_two():
    assert AdaptiveConcurrency(window=5).admit_count() == 2
    assert policy_with([3.0, 9.0], window=5).admit_count() == 2


def test_fixed_policy_always_admits_one():
    p = FixedConcurrency()
    p.record(100.0)
    assert p.admit_count() == 1


def test_bad_inputs():
    with pytest.raises(ValueError):
        AdaptiveConcurrency(window=0)
    with pytest.raises(ValueError):
        AdaptiveConcurrency().record(-1.0)


@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=30), st.integers(1, 10))
def test_rule_matches_a_direct_computation(durations, window):
    p = policy_with(durations, window)
    s = sorted(durations)
    n = len(s)
    overall = Fraction(s[n // 2]) if n % 2 else (Fraction(s[n // 2 - 1]) + Fraction(s[n // 2])) / 2
    r = sorted(durations[-window:])
    m = len(r)
    recent = Fraction(r[m // 2]) if m % 2 else (Fraction(r[m // 2 - 1]) + Fraction(r[m // 2])) / 2
    if overall == 0:
        expected = 2 if recent == 0 else 0
    elif recent > overall * Fraction(3, 2):
        expected = 0
    elif recent >= overall * Fraction(11, 10):
        expected = 1
    else:
        expected = 2
    assert p.admit_count() == expected
    assert exact_median(durations) == overall
