"""Knee detection: the EWMA arithmetic on fixed traces (numbers worked out by hand in the comments) and the
adaptive release of PartialBarrierMachine(knee=True) with its gates, several knees and late groups."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.barrier import CatchUp, FireReason, KneeDetector, PartialBarrierMachine, Status

approx = pytest.approx


def test_estimator_on_a_fixed_trace():
    k = KneeDetector()
    k.observe(0.0)
    assert k.deadline() is None               # one arrival: no sample, no deadline
    k.observe(1.0)                            # s=1: arr=1, arrvar=1/2
    assert (k.arr, k.arrvar) == (1.0, 0.5)
    assert k.deadline() == approx(1 + 1 + 4 * 0.5)          # 4.0
    k.observe(2.0)                            # s=1: arr=.7+.3=1.0, arrvar=.75*.5+.25*0=.375
    assert k.arr == approx(1.0) and k.arrvar == approx(0.375)
    assert k.deadline() == approx(2 + 1.0 + 1.5)            # 4.5
    k.observe(4.0)                            # s=2: arr=.7*1+.3*2=1.3, arrvar=.75*.375+.25*|2-1.3|=.45625
    assert k.arr == approx(1.3) and k.arrvar == approx(0.45625)
    assert k.deadline() == approx(4 + 1.3 + 4 * 0.45625)    # 7.125
    assert k.check(7.12) is None
    assert k.check(7.2) == approx(7.125)
    assert k.in_knee and k.knees == [(approx(7.125), 4)]
    assert k.deadline() is None               # declared: wait for the next arrival
    k.observe(10.0)                           # s=6: arr=.7*1.3+.3*6=2.71, arrvar=.75*.45625+.25*3.29
    assert k.arr == approx(2.71) and k.arrvar == approx(0.75 * 0.45625 + 0.25 * 3.29)
    assert not k.in_knee


def test_knee_release_fires_at_the_knee_with_everyone_so_far():
    b = PartialBarrierMachine("k", 5, percent=60, knee=True)         # gate: 3 labels
    for i, t in enumerate([0.0, 1.0, 2.0, 4.0]):
        assert b.enter(f"t{i}", i, t).waiting
    assert b.next_deadline() == approx(7.125)
    assert b.tick(7.1) == []
    rel = b.tick(7.2)
    assert sorted(r.label for r in rel) == ["t0", "t1", "t2", "t3"]
    assert rel[0].fire.reason is FireReason.KNEE and rel[0].fire.time == approx(7.125)
    # the straggler completes max: it is released at once (late pass)
    out = b.enter("t4", 4, 20.0, round=0)
    assert out.status is Status.LATE_FIRE and out.own.time == 20.0


def test_knee_before_the_percent_gate_does_not_fire():
    b = PartialBarrierMachine("k", 5, percent=60, knee=True)
    b.enter("a", 0, 0.0)
    b.enter("b", 1, 1.0)                      # deadline 1 + 1 + 4*.5 = 4
    assert b.tick(4.0) == []                  # knee with 2 < 3 labels: recorded, no fire
    assert b.knees(0) == [(4.0, 2)]
    b.enter("c", 2, 10.0)                     # s=9: arr=.7+2.7=3.4, arrvar=.375+.25*5.6=1.775
    assert b.next_deadline() == approx(10 + 3.4 + 4 * 1.775)  # 20.5
    rel = b.tick(21.0)
    assert rel[0].fire.reason is FireReason.KNEE and rel[0].fire.time == approx(20.5)
    assert sorted(rel[0].fire.passed) == ["a", "b", "c"]


def test_knee_before_min_wait_fires_when_min_wait_elapses():
    b = PartialBarrierMachine("k", 10, min_wait=10.0, knee=True)
    for i, t in enumerate([0.0, 1.0, 2.0]):
        b.enter(f"t{i}", i, t)                # knee at 4.5
    assert b.tick(9.9) == [] and b.knees(0) == [(4.5, 3)]
    rel = b.tick(10.0)
    assert rel[0].fire.reason is FireReason.KNEE and rel[0].fire.time == 10.0 and len(rel) == 3


def test_arrival_after_knee_resets_it_before_min_wait():
    b = PartialBarrierMachine("k", 10, min_wait=10.0, knee=True)
    for i, t in enumerate([0.0, 1.0, 2.0]):
        b.enter(f"t{i}", i, t)                # knee at 4.5
    b.tick(5.0)
    b.enter("t3", 3, 9.0)                     # s=7: arr=.7+2.1=2.8, arrvar=.28125+.25*4.2=1.33125
    assert b.tick(10.0) == []                 # min_wait elapsed, but no knee in effect any more
    assert b.next_deadline() == approx(9 + 2.8 + 4 * 1.33125)   # 17.125
    assert b.tick(17.125)[0].fire.reason is FireReason.KNEE


def test_later_knees_release_later_groups_of_late_arrivals():
    b = PartialBarrierMachine("k", 6, knee=True)
    for i, t in enumerate([0.0, 1.0, 2.0]):
        b.enter(f"t{i}", i, t)
    first = b.tick(4.5)                       # knee at 4.5, no gate
    assert len(first) == 3
    # late arrivals are held until the next knee
    assert b.enter("d", 3, 10.0, round=0).waiting   # s=8: arr=3.1, arrvar=.28125+.25*4.9=1.50625
    assert b.enter("e", 4, 12.0, round=0).waiting   # s=2: arr=2.77, arrvar=1.1296875+.25*.77=1.3221875
    assert b.next_deadline() == approx(12 + 2.77 + 4 * 1.3221875)   # 20.05875
    late = b.tick(21.0)
    assert sorted(r.label for r in late) == ["d", "e"]
    assert all(r.status is Status.LATE_FIRE and r.time == approx(20.05875) for r in late)
    assert late[0].fire == first[0].fire
    assert b.knees(0) == [(4.5, 3), (approx(20.05875), 5)]
    out = b.enter("f", 5, 30.0, round=0)      # the 6th label: max reached, passes at once
    assert out.status is Status.LATE_FIRE and out.own.time == 30.0


def test_timeout_ends_holding_late_arrivals():
    b = PartialBarrierMachine("k", 6, knee=True, timeout=8.0)
    for i, t in enumerate([0.0, 1.0, 2.0]):
        b.enter(f"t{i}", i, t)
    b.tick(4.5)
    assert b.enter("d", 3, 6.0, round=0).waiting
    late = b.tick(8.0)                        # the round's timeout releases the held group
    assert [(r.label, r.time, r.status) for r in late] == [("d", 8.0, Status.LATE_FIRE)]
    assert b.enter("e", 4, 9.0, round=0).status is Status.LATE_FIRE   # from now on: at once


def test_knee_with_catch_up_tells_late_arrivals_to_skip():
    b = PartialBarrierMachine("k", 4, knee=True, late="catch_up")
    for i, t in enumerate([0.0, 1.0, 2.0]):
        b.enter(f"t{i}", i, t)
    b.tick(4.5)
    with pytest.raises(CatchUp) as ei:
        b.enter("slow", 3, 40.0, round=0)
    assert ei.value.next_round == 1 and sorted(ei.value.fire.passed) == ["t0", "t1", "t2"]


def test_single_arrival_never_makes_a_knee():
    b = PartialBarrierMachine("k", 3, knee=True)
    b.enter("a", 0, 0.0)
    assert b.next_deadline() is None and b.tick(1e6) == []


# ---------------------------------------------------------------------------- reference model


def reference_knee_fire(arrivals, mx, percent, min_wait):
    """Independent model of the first fire of an adaptive barrier (no timeout, distinct arrival times)."""
    thr = 1 if percent is None else max(1, math.ceil(round(percent * mx / 100, 9)))
    t0 = arrivals[0]
    mw = None if min_wait is None else t0 + min_wait
    arr = var = None
    for i, a in enumerate(arrivals):
        n = i + 1
        if i > 0:
            s = a - arrivals[i - 1]
            if arr is None:
                arr, var = s, s / 2
            else:
                arr = 0.7 * arr + 0.3 * s
                var = 0.75 * var + 0.25 * abs(s - arr)
        if n >= mx:
            return a, "max", n
        nxt = arrivals[i + 1] if i + 1 < len(arrivals) else math.inf
        if arr is None:
            continue
        knee = a + arr + 4 * var
        if knee > nxt:
            continue                           # the next arrival comes first (ties: the timer first)
        if n < thr:
            continue                           # knee below the percent gate: recorded, no fire
        if mw is None or knee >= mw:
            return knee, "knee", n
        if mw <= nxt:
            return mw, "knee", n               # min_wait elapses while the knee is still in effect
    return None


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.integers(1, 9), min_size=1, max_size=9), mx=st.integers(2, 10),
       percent=st.one_of(st.none(), st.sampled_from([20, 50, 75, 100])),
       min_wait=st.one_of(st.none(), st.integers(0, 40)))
def test_adaptive_fire_matches_reference_model(gaps, mx, percent, min_wait):
    arrivals = [0.0]
    for g in gaps[1:]:
        arrivals.append(arrivals[-1] + g)
    arrivals = arrivals[:mx]
    b = PartialBarrierMachine("k", mx, percent=percent, min_wait=min_wait, knee=True)
    fired = []
    for i, a in enumerate(arrivals):
        if b.current_round > 0:
            break
        fired += b.enter(f"t{i}", i, a, round=0).releases
    fired += b.tick(1e9)
    ref = reference_knee_fire(arrivals, mx, percent, min_wait)
    fires = [r for r in fired if r.status is Status.FIRE]
    if ref is None:
        assert fires == []
        return
    t, reason, n = ref
    assert fires, (arrivals, ref)
    assert fires[0].fire.time == approx(t) and fires[0].fire.reason.value == reason
    assert fires[0].fire.count == n
