"""Release rules of BarrierMachine / PartialBarrierMachine on a manual clock: precedence, labels, late modes, rounds,
callbacks. Expected values are worked out by hand from the rules (or by an independent reference model)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.barrier import (BarrierMachine, BarrierProtocolError, BarrierSpecError, CatchUp, FireReason,
                                 PartialBarrierMachine, Status)


def labels_of(releases):
    return sorted(r.label for r in releases)


# ---------------------------------------------------------------------------- classic
def test_classic_barrier_fires_only_when_all_entered():
    b = BarrierMachine("b", 3)
    assert b.enter("a", 0, 0.0).waiting
    assert b.enter("b", 1, 100.0).waiting
    assert b.next_deadline() is None          # a classic barrier has no timer
    assert b.tick(150.0) == []
    out = b.enter("c", 2, 200.0)
    assert out.status is Status.FIRE
    assert labels_of(out.releases) == ["a", "b", "c"]
    assert out.own.fire.reason is FireReason.MAX
    assert out.own.fire.passed == {"a": 0, "b": 1, "c": 2}
    assert out.own.fire.time == 200.0


def test_partial_without_relaxations_is_classic():
    b = PartialBarrierMachine("b", 2)
    assert b.spec.classic
    b.enter("a", 0, 0.0)
    assert b.tick(1e6) == []


# ---------------------------------------------------------------------------- precedence
def test_max_fires_before_min_wait_and_percent():
    b = PartialBarrierMachine("b", 3, percent=50, min_wait=10.0, timeout=100.0)
    b.enter("a", 0, 0.0)
    b.enter("b", 1, 1.0)                      # 2 >= ceil(1.5) but min_wait not elapsed
    out = b.enter("c", 2, 2.0)
    assert out.own.fire.reason is FireReason.MAX and out.own.fire.time == 2.0


def test_timeout_counts_from_first_entry_and_fires_whatever_the_count():
    b = PartialBarrierMachine("b", 10, timeout=5.0)
    b.enter("a", 0, 1.0)
    b.enter("b", 1, 3.0)
    assert b.next_deadline() == 6.0
    assert b.tick(5.999) == []
    rel = b.tick(6.0)
    assert labels_of(rel) == ["a", "b"]
    assert rel[0].fire.reason is FireReason.TIMEOUT and rel[0].fire.time == 6.0


def test_timeout_overrides_min_wait_that_comes_later():
    b = PartialBarrierMachine("b", 4, timeout=3.0, min_wait=5.0)
    b.enter("a", 0, 0.0)
    rel = b.tick(10.0)
    assert rel[0].fire.reason is FireReason.TIMEOUT and rel[0].fire.time == 3.0


def test_timeout_wins_a_tie_with_min_wait():
    b = PartialBarrierMachine("b", 4, timeout=5.0, min_wait=5.0)
    b.enter("a", 0, 0.0)
    assert b.tick(5.0)[0].fire.reason is FireReason.TIMEOUT


def test_percent_alone_fires_at_the_rounded_up_count():
    b = PartialBarrierMachine("b", 10, percent=25)   # ceil(2.5) = 3
    assert b.spec.percent_threshold == 3
    b.enter("a", 0, 0.0)
    assert b.enter("b", 1, 1.0).waiting
    out = b.enter("c", 2, 2.0)
    assert out.own.fire.reason is FireReason.EARLY and labels_of(out.releases) == ["a", "b", "c"]


def test_percent_threshold_is_exact_for_decimal_percentages():
    assert PartialBarrierMachine("b", 30, percent=10).spec.percent_threshold == 3
    assert PartialBarrierMachine("b", 3, percent=100).spec.percent_threshold == 3
    assert PartialBarrierMachine("b", 7, percent=1).spec.percent_threshold == 1


def test_min_wait_alone_fires_after_min_wait_with_any_count():
    b = PartialBarrierMachine("b", 10, min_wait=4.0)
    b.enter("a", 0, 2.0)
    assert b.next_deadline() == 6.0
    rel = b.tick(6.0)
    assert labels_of(rel) == ["a"] and rel[0].fire.reason is FireReason.EARLY


def test_percent_and_min_wait_both_needed_percent_first():
    b = PartialBarrierMachine("b", 4, percent=50, min_wait=10.0)
    b.enter("a", 0, 0.0)
    assert b.enter("b", 1, 1.0).waiting       # percent met, min_wait not
    assert b.tick(9.99) == []
    rel = b.tick(10.0)
    assert labels_of(rel) == ["a", "b"] and rel[0].fire.time == 10.0


def test_percent_and_min_wait_both_needed_min_wait_first():
    b = PartialBarrierMachine("b", 4, percent=75, min_wait=1.0)
    b.enter("a", 0, 0.0)
    assert b.tick(5.0) == []                  # min_wait met, 1 < 3
    assert b.enter("b", 1, 6.0).waiting
    out = b.enter("c", 2, 7.0)
    assert out.own.fire.time == 7.0 and labels_of(out.releases) == ["a", "b", "c"]


def test_late_tick_gives_the_same_result_as_punctual_ticks():
    def run(ticks):
        b = PartialBarrierMachine("b", 5, percent=40, min_wait=3.0, timeout=8.0)
        b.enter("a", 0, 0.0)
        b.enter("b", 1, 1.0)
        out = []
        for t in ticks:
            out += b.tick(t)
        return [(r.label, r.time, r.fire.reason) for r in out]
    assert run([1.5, 2.0, 3.0, 4.0]) == run([100.0]) == [("a", 3.0, FireReason.EARLY), ("b", 3.0, FireReason.EARLY)]


# ---------------------------------------------------------------------------- labels
def test_duplicate_label_copies_count_once_and_all_pass():
    b = PartialBarrierMachine("b", 3)
    b.enter("x", 0, 0.0)
    b.enter("x", 1, 0.5)                      # a replica of task x on rank 1
    assert b.enter("y", 2, 1.0).waiting       # 2 unique labels of 3
    out = b.enter("z", 3, 2.0)
    assert sorted((r.label, r.rank) for r in out.releases) == [("x", 0), ("x", 1), ("y", 2), ("z", 3)]
    assert out.own.fire.passed == {"x": 0, "y": 2, "z": 3}   # first rank of each label


def test_repeated_entry_is_idempotent():
    b = PartialBarrierMachine("b", 2)
    assert b.enter("a", 0, 0.0).waiting
    assert b.enter("a", 0, 0.1).waiting       # the same (label, rank) again: no double count
    assert b.entered(0) == {"a": 0}
    out = b.enter("b", 1, 1.0)
    assert len(out.releases) == 2
    again = b.enter("a", 0, 2.0, round=0)     # after the fire: same answer, nothing new released
    assert again.own == out.releases[0] and again.releases == ()


def test_bad_label_and_rank_are_rejected():
    b = PartialBarrierMachine("b", 2)
    with pytest.raises(TypeError):
        b.enter(3, 0, 0.0)
    with pytest.raises(ValueError):
        b.enter("a", -1, 0.0)


# ---------------------------------------------------------------------------- late arrivals and rounds
def test_late_pass_returns_late_fire_with_the_fire_info():
    b = PartialBarrierMachine("b", 3, timeout=1.0)
    b.enter("a", 0, 0.0)
    fired = b.tick(1.0)
    out = b.enter("c", 2, 5.0, round=0)
    assert out.status is Status.LATE_FIRE
    assert out.own.fire == fired[0].fire and out.own.time == 5.0
    assert out.own.fire.passed == {"a": 0}


def test_late_catch_up_raises_with_next_round():
    b = PartialBarrierMachine("b", 2, timeout=1.0, late="catch_up")
    b.enter("a", 0, 0.0)
    b.tick(1.0)                               # round 0 fires with a only
    b.enter("a", 0, 2.0)                      # a enters round 1 (its own next round)
    b.enter("b", 1, 2.5, round=1)
    assert b.current_round == 2               # round 1 fired by max
    with pytest.raises(CatchUp) as ei:
        b.enter("c", 2, 3.0, round=0)
    cu = ei.value
    assert cu.round == 0 and cu.next_round == 2 and cu.fire.passed == {"a": 0}
    assert b.next_round_of("c", 2) == 2       # its default round skips ahead


def test_rounds_follow_each_label_and_rank():
    b = PartialBarrierMachine("b", 2)
    for r in range(3):
        b.enter("a", 0, float(r))
        out = b.enter("b", 1, r + 0.5)
        assert out.own.round == r and out.own.fire.round == r
    assert b.current_round == 3
    assert b.fire_info(1).passed == {"a": 0, "b": 1}


def test_entering_a_future_round_is_a_protocol_error():
    b = PartialBarrierMachine("b", 2)
    with pytest.raises(BarrierProtocolError):
        b.enter("a", 0, 0.0, round=1)


def test_late_pass_behind_several_rounds_passes_one_by_one():
    b = PartialBarrierMachine("b", 2, timeout=1.0)
    for r in range(3):
        b.enter("a", 0, 10.0 * r)
        b.tick(10.0 * r + 1.0)
    assert b.current_round == 3
    for r in range(3):
        out = b.enter("slow", 5, 100.0 + r)
        assert out.status is Status.LATE_FIRE and out.own.round == r


def test_forgotten_rounds_give_a_clear_error():
    b = PartialBarrierMachine("b", 1, history=2)
    for r in range(5):
        b.enter("a", 0, float(r))
    with pytest.raises(BarrierProtocolError, match="older"):
        b.enter("z", 1, 9.0, round=0)


# ---------------------------------------------------------------------------- callbacks
def test_callback_sees_the_default_and_can_veto_then_force_on_its_own_timer():
    calls = []
    allow = {"fire": False}

    def cb(label, rank, default):
        calls.append((label, rank, default))
        return allow["fire"]

    b = PartialBarrierMachine("b", 2, callback=cb, callback_timeout=3.0)
    assert b.enter("a", 0, 0.0).waiting
    assert calls == [("a", 0, False)]
    assert b.enter("b", 1, 1.0).waiting       # max reached (default True) but vetoed
    assert calls[-1] == ("b", 1, True)
    assert b.next_deadline() == 4.0           # 3 s after its last invocation
    assert b.tick(4.0) == []                  # re-invoked with nobody arriving, still vetoes
    assert calls[-1] == (None, None, True)
    allow["fire"] = True
    rel = b.tick(7.0)                         # re-invoked again at 7.0 and forces
    assert calls[-1] == (None, None, True) and len(calls) == 4
    assert labels_of(rel) == ["a", "b"] and rel[0].fire.time == 7.0 and rel[0].fire.reason is FireReason.MAX


def test_callback_can_force_a_fire_the_rules_would_not_take():
    b = PartialBarrierMachine("b", 5, callback=lambda label, rank, default: label == "boss")
    b.enter("a", 0, 0.0)
    out = b.enter("boss", 1, 1.0)
    assert out.own.fire.reason is FireReason.CALLBACK and labels_of(out.releases) == ["a", "boss"]


def test_timeout_overrides_a_callback_veto():
    b = PartialBarrierMachine("b", 5, timeout=2.0, callback=lambda *a: False)
    b.enter("a", 0, 0.0)
    assert b.tick(2.0)[0].fire.reason is FireReason.TIMEOUT


def test_callback_is_consulted_when_a_timer_makes_the_rules_fire():
    calls = []
    b = PartialBarrierMachine("b", 5, min_wait=2.0, callback=lambda l, r, d: calls.append((l, r, d)) or False)
    b.enter("a", 0, 0.0)
    assert b.tick(2.0) == [] and calls[-1] == (None, None, True)


def test_a_raising_callback_falls_back_to_the_default():
    def cb(label, rank, default):
        raise RuntimeError("boom")
    b = PartialBarrierMachine("b", 2, callback=cb)
    b.enter("a", 0, 0.0)
    assert b.enter("b", 1, 1.0).status is Status.FIRE


# ---------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, param", [
    (dict(max=0), "max"), (dict(max=2, percent=0), "percent"), (dict(max=2, percent=100.5), "percent"),
    (dict(max=2, timeout=0), "timeout"), (dict(max=2, timeout=-1), "timeout"), (dict(max=2, min_wait=-1), "min_wait"),
    (dict(max=2, late="skip"), "late"), (dict(max=2, callback_timeout=1.0), "callback_timeout"),
    (dict(max=2, timeout=math.nan), "timeout"), (dict(max=True), "max"),
])
def test_bad_parameters_name_the_parameter(kwargs, param):
    with pytest.raises(BarrierSpecError) as ei:
        PartialBarrierMachine("b", **kwargs)
    assert ei.value.param == param


# ---------------------------------------------------------------------------- reference model
def reference_fire(arrivals, mx, timeout, percent, min_wait):
    """Independent model: (fire time, reason, labels passed) for strictly increasing arrival times."""
    t0 = arrivals[0]
    cands = []  # (time, priority, reason, includes the arrival at that time)
    if timeout is not None:
        cands.append((t0 + timeout, 0, "timeout", False))
    if len(arrivals) >= mx:
        cands.append((arrivals[mx - 1], 2, "max", True))
    if percent is not None or min_wait is not None:
        thr = 1 if percent is None else max(1, math.ceil(round(percent * mx / 100, 9)))
        if len(arrivals) >= thr:
            mw = t0 if min_wait is None else t0 + min_wait
            if mw > arrivals[thr - 1]:
                cands.append((mw, 1, "early", False))
            else:
                cands.append((arrivals[thr - 1], 2, "early", True))
    if not cands:
        return None
    t, _, reason, incl = min(cands)
    if incl and arrivals.index(t) + 1 >= mx:  # the entry that completes max: the max rule is checked first
        reason = "max"
    passed = [i for i, a in enumerate(arrivals) if a < t or (incl and a == t)]
    return t, reason, passed


@settings(max_examples=200, deadline=None)
@given(gaps=st.lists(st.integers(1, 5), min_size=1, max_size=8), mx=st.integers(1, 8),
       timeout=st.one_of(st.none(), st.integers(1, 30)),
       percent=st.one_of(st.none(), st.sampled_from([10, 25, 50, 60, 75, 100])),
       min_wait=st.one_of(st.none(), st.integers(0, 20)))
def test_fire_matches_reference_model(gaps, mx, timeout, percent, min_wait):
    arrivals = [0]
    for g in gaps[1:]:
        arrivals.append(arrivals[-1] + g)
    arrivals = arrivals[:mx]                  # never more unique labels than max
    b = PartialBarrierMachine("b", mx, timeout=timeout, percent=percent, min_wait=min_wait)
    seen = []
    for i, a in enumerate(arrivals):
        seen += b.enter(f"t{i}", i, float(a), round=0).releases if b.current_round == 0 else []
    seen += b.tick(1e9)
    ref = reference_fire(arrivals, mx, timeout, percent, min_wait)
    if ref is None:
        assert seen == []
        return
    t, reason, passed = ref
    fired = [r for r in seen if r.status is Status.FIRE]
    assert fired, (arrivals, ref)
    assert fired[0].fire.time == t
    assert fired[0].fire.reason.value == reason
    assert sorted(fired[0].fire.passed) == sorted(f"t{i}" for i in passed)


def test_old_state_machine_names_warn_and_give_the_machines() -> None:
    """The state machines once shared their names with the job-bound barriers of ``collectives``."""
    import collectives
    import collectives.barrier as pure
    for old, new in (("Barrier", BarrierMachine), ("PartialBarrier", PartialBarrierMachine),
                     ("SemaphoreBarrier", pure.SemaphoreBarrierMachine)):
        with pytest.warns(DeprecationWarning, match=f"renamed {new.__name__}"):
            assert getattr(pure, old) is new
        assert getattr(collectives, old) is not new          # the job-bound barrier keeps the name
    with pytest.raises(AttributeError):
        pure.NoSuchBarrier  # noqa: B018
