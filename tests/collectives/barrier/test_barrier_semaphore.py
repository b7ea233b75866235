"""SemaphoreBarrierMachine on a manual clock: FIFO admission, hold timeouts, release callbacks, adaptive policy."""

from __future__ import annotations

import pytest

from collectives.barrier import (AdaptiveConcurrency, AdmitReason, BarrierProtocolError, BarrierSpecError,
                                 SemaphoreBarrierMachine)


def admitted(adms):
    return [(a.label, a.reason, a.time) for a in adms]


def test_at_most_n_inside_and_fifo_admission():
    s = SemaphoreBarrierMachine("s", 2)
    assert s.enter("a", 0, 0.0).own.reason is AdmitReason.FREE
    assert s.enter("b", 1, 0.0).own is not None
    for i, lab in enumerate("cde"):
        assert s.enter(lab, 2 + i, 1.0 + i).waiting
    assert s.holders == ["a", "b"] and s.waiting == ["c", "d", "e"]
    assert admitted(s.release("b", 5.0)) == [("c", AdmitReason.RELEASE, 5.0)]
    assert admitted(s.release("a", 6.0)) == [("d", AdmitReason.RELEASE, 6.0)]
    assert s.holders == ["c", "d"] and s.waiting == ["e"]


def test_newcomer_does_not_jump_the_queue():
    s = SemaphoreBarrierMachine("s", 1)
    s.enter("a", 0, 0.0)
    s.enter("b", 1, 0.0)
    s.release("a", 1.0)                       # b admitted
    assert s.enter("c", 2, 1.0).waiting


def test_hold_timeout_presumes_failure_and_admits_the_next():
    s = SemaphoreBarrierMachine("s", 1, hold_timeout=5.0)
    s.enter("a", 0, 0.0)
    s.enter("b", 1, 1.0)
    assert s.next_deadline() == 5.0
    assert s.tick(4.99) == []
    assert admitted(s.tick(5.0)) == [("b", AdmitReason.HOLD_TIMEOUT, 5.0)]
    assert s.presumed_failed == ["a"]
    assert s.release("a", 6.0) == []          # the failed holder's late release is ignored
    assert s.holders == ["b"]


def test_hold_timeouts_chain_in_time_order():
    s = SemaphoreBarrierMachine("s", 1, hold_timeout=5.0)
    s.enter("a", 0, 0.0)
    s.enter("b", 1, 0.0)
    s.enter("c", 2, 0.0)
    out = s.tick(12.0)                        # a fails at 5 -> b; b fails at 10 -> c
    assert admitted(out) == [("b", AdmitReason.HOLD_TIMEOUT, 5.0), ("c", AdmitReason.HOLD_TIMEOUT, 10.0)]
    assert s.next_deadline() == 15.0


def test_release_callback_decides_how_many_to_admit():
    decisions = [2, 0, None]
    seen = []

    def cb(label, rank, held):
        seen.append((label, rank, held))
        return decisions.pop(0)

    s = SemaphoreBarrierMachine("s", 1, release_callback=cb)
    s.enter("a", 0, 0.0)
    for i, lab in enumerate("bcdef"):
        s.enter(lab, i + 1, 0.0)
    assert [a.label for a in s.release("a", 3.0)] == ["b", "c"]   # 2: concurrency 1 -> 2
    assert s.limit == 2 and seen == [("a", 0, 3.0)]
    assert s.release("b", 4.0) == []                              # 0: concurrency 2 -> 1, c still inside
    assert s.limit == 1
    assert [a.label for a in s.release("c", 5.0)] == ["d"]        # None: the default policy (1)


def test_adaptive_policy_grows_then_shrinks_concurrency():
    s = SemaphoreBarrierMachine("s", 1, policy=AdaptiveConcurrency(window=1), max_concurrency=3)
    s.enter("a", 0, 0.0)
    for i, lab in enumerate("bcdefg"):
        s.enter(lab, i + 1, 0.0)
    assert [a.label for a in s.release("a", 1.0)] == ["b", "c"]   # durations [1] -> 2, limit 2
    assert [a.label for a in s.release("b", 2.0)] == ["d", "e"]   # [1, 1]: 2 -> limit 3 (the cap)
    assert s.limit == 3
    assert [a.label for a in s.release("c", 5.0)] == []           # [1,1,4]: recent 4 vs median 1 -> 0
    assert s.limit == 2


def test_releasing_a_waiting_label_withdraws_it():
    s = SemaphoreBarrierMachine("s", 1)
    s.enter("a", 0, 0.0)
    s.enter("b", 1, 0.0)
    assert s.release("b", 1.0) == [] and s.waiting == []


def test_release_of_a_stranger_is_an_error():
    s = SemaphoreBarrierMachine("s", 1)
    with pytest.raises(BarrierProtocolError):
        s.release("ghost", 0.0)


def test_repeated_enter_is_idempotent():
    s = SemaphoreBarrierMachine("s", 1)
    first = s.enter("a", 0, 0.0).own
    assert s.enter("a", 0, 1.0).own == first
    s.enter("b", 1, 1.0)
    assert s.enter("b", 1, 2.0).waiting and s.waiting == ["b"]


def test_bad_parameters():
    with pytest.raises(BarrierSpecError):
        SemaphoreBarrierMachine("s", 0)
    with pytest.raises(BarrierSpecError):
        SemaphoreBarrierMachine("s", 1, hold_timeout=0)
    with pytest.raises(BarrierSpecError):
        SemaphoreBarrierMachine("s", 3, max_concurrency=2)
