"""ThrottledRelease: per-period counts, FIFO order, percent budgets, adaptive budgets."""

from __future__ import annotations

import pytest

from collectives.barrier import AdaptiveConcurrency, AdmitReason, BarrierSpecError, ThrottledRelease


def test_count_per_period_fifo():
    th = ThrottledRelease("t", period=10.0, count=2)
    own = [th.enter(l, i, float(i)).own for i, l in enumerate("abcde")]
    assert [o is not None for o in own] == [True, True, False, False, False]
    assert th.next_deadline() == 10.0
    assert [(a.label, a.time, a.reason) for a in th.tick(10.0)] == [("c", 10.0, AdmitReason.PERIOD),
                                                                      ("d", 10.0, AdmitReason.PERIOD)]
    assert [(a.label, a.time) for a in th.tick(25.0)] == [("e", 20.0)]
    assert th.next_deadline() is None


def test_budget_left_in_a_period_lets_a_newcomer_through():
    th = ThrottledRelease("t", period=10.0, count=2)
    th.enter("a", 0, 0.0)
    th.tick(34.0)                             # idle periods
    assert th.enter("b", 1, 35.0).own.reason is AdmitReason.FREE
    assert th.enter("c", 2, 36.0).own is not None
    assert th.enter("d", 3, 37.0).waiting     # third in period [30, 40)
    assert [(a.label, a.time) for a in th.tick(40.0)] == [("d", 40.0)]


def test_percent_of_max_per_period():
    th = ThrottledRelease("t", period=1.0, percent=25, max=8)   # 2 per period
    assert th.per_period == 2
    for i in range(8):
        th.enter(f"x{i}", i, 0.0)
    per_time = {}
    for a in th.tick(10.0):
        per_time.setdefault(a.time, []).append(a.label)
    assert per_time == {1.0: ["x2", "x3"], 2.0: ["x4", "x5"], 3.0: ["x6", "x7"]}


def test_adaptive_budget_follows_completion_times():
    th = ThrottledRelease("t", period=10.0, count=2, policy=AdaptiveConcurrency(window=1))
    for i in range(10):
        th.enter(f"x{i}", i, 0.0)            # x0, x1 pass at 0
    th.complete("x0", 1.0)
    th.complete("x1", 1.0)                   # durations [1, 1] -> admit 2 -> budget 3
    assert [a.label for a in th.tick(10.0)] == ["x2", "x3", "x4"]
    th.complete("x2", 20.0)                  # [1, 1, 10]: 900% slower -> 0 -> budget 2
    assert [a.label for a in th.tick(20.0)] == ["x5", "x6"]


def test_bad_parameters():
    with pytest.raises(BarrierSpecError):
        ThrottledRelease("t", period=1.0)
    with pytest.raises(BarrierSpecError):
        ThrottledRelease("t", period=1.0, count=1, percent=10, max=10)
    with pytest.raises(BarrierSpecError):
        ThrottledRelease("t", period=1.0, percent=10)
    with pytest.raises(BarrierSpecError):
        ThrottledRelease("t", period=0, count=1)
