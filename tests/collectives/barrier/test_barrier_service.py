"""BarrierService (no threads, manual time): replies, idempotence, spec agreement, errors, semaphores and
throttles over messages, and the msgpack wire format of every record (hypothesis)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectives.barrier import (Admission, AdmitReason, BarrierClient, BarrierMismatchError, BarrierRelease,
                                 BarrierService, BarrierSpec, FireInfo, FireReason, SemaphoreSpec,
                                 Status, ThrottleSpec, spec_from_dict)


def wire(x):
    """Everything the service emits must survive msgpack unchanged."""
    return msgpack.unpackb(msgpack.packb(x, use_bin_type=True), raw=False)


def enter(rid, name, label, spec, round=None):
    return {"op": "enter", "id": rid, "name": name, "label": label, "round": round,
            "spec": None if spec is None else spec.to_dict()}


SPEC = BarrierSpec(max=3, timeout=10.0)


def test_fire_replies_to_every_waiter_once():
    svc = BarrierService()
    assert svc.handle(0, enter(1, "b", "a", SPEC), 0.0) == []
    assert svc.handle(1, enter(1, "b", "b", SPEC), 1.0) == []
    out = svc.handle(2, enter(7, "b", "c", SPEC), 2.0)
    assert sorted((dst, m["id"], m["op"]) for dst, m in out) == [(0, 1, "released"), (1, 1, "released"),
                                                                  (2, 7, "released")]
    for dst, m in out:
        assert wire(m) == m
        rel = BarrierRelease.from_dict(m["release"])
        assert rel.rank == dst and rel.status is Status.FIRE and rel.fire.reason is FireReason.MAX
    assert svc.tick(100.0) == [] and svc.next_deadline() is None   # the timeout never fires a second time


def test_duplicate_requests_are_answered_consistently():
    svc = BarrierService()
    msg = enter(1, "b", "a", BarrierSpec(max=2))
    assert svc.handle(0, msg, 0.0) == []
    assert svc.handle(0, msg, 0.5) == []      # duplicate while pending: ignored, still counted once
    out = svc.handle(1, enter(1, "b", "b", BarrierSpec(max=2)), 1.0)
    assert len(out) == 2
    mine = [m for dst, m in out if dst == 0][0]
    assert svc.handle(0, msg, 2.0) == [(0, mine)]   # duplicate after the answer: the same answer


def test_timer_fire_comes_from_tick_once():
    svc = BarrierService()
    svc.handle(0, enter(1, "b", "a", SPEC), 0.0)
    assert svc.next_deadline() == 10.0
    out = svc.tick(10.0)
    assert [(d, m["op"]) for d, m in out] == [(0, "released")]
    assert svc.tick(10.0) == [] and svc.tick(11.0) == []


def test_overdue_timers_run_before_a_request():
    svc = BarrierService()
    svc.handle(0, enter(1, "b", "a", SPEC), 0.0)
    out = svc.handle(1, enter(1, "b", "b", SPEC, round=0), 12.0)   # nobody ticked at 10
    ops = [(d, m["op"], BarrierRelease.from_dict(m["release"]).status) for d, m in out]
    assert ops == [(0, "released", Status.FIRE), (1, "released", Status.LATE_FIRE)]


def test_spec_mismatch_is_sent_to_the_offender_only():
    svc = BarrierService()
    svc.handle(0, enter(1, "b", "a", BarrierSpec(max=2)), 0.0)
    out = svc.handle(1, enter(1, "b", "b", BarrierSpec(max=3)), 1.0)
    assert len(out) == 1 and out[0][0] == 1
    assert out[0][1]["op"] == "error" and out[0][1]["kind"] == "BarrierMismatchError"
    assert svc.get("b").entered(0) == {"a": 0}            # the offender was not counted
    out = svc.handle(2, enter(1, "b", "c", BarrierSpec(max=2)), 2.0)
    assert sorted(d for d, _ in out) == [0, 2]


def test_kind_mismatch_is_an_error():
    svc = BarrierService()
    svc.handle(0, enter(1, "x", "a", BarrierSpec(max=2)), 0.0)
    out = svc.handle(1, {"op": "acquire", "id": 1, "name": "x", "label": "b",
                         "spec": SemaphoreSpec(n=1).to_dict()}, 0.0)
    assert out[0][1]["kind"] == "BarrierMismatchError"


@pytest.mark.parametrize("msg", [
    "garbage", {"op": "dance", "id": 1}, {"op": "enter", "id": "x", "name": "b", "label": "a", "spec": {}},
    {"op": "enter", "id": 1, "name": "", "label": "a", "spec": {}},
    {"op": "enter", "id": 1, "name": "b", "label": "a", "spec": {"kind": "barrier", "max": -1}},
    {"op": "enter", "id": 1, "name": "b", "label": "a", "spec": {"kind": "barrier", "max": 2, "bogus": 1}},
    {"op": "enter", "id": 1, "name": "b", "label": "a", "round": -3, "spec": {"kind": "barrier", "max": 2}},
    {"op": "enter", "id": 1, "name": "b", "label": "a", "round": 4, "spec": {"kind": "barrier", "max": 2}},
    {"op": "release", "id": 1, "name": "nope", "label": "a"},
])
def test_malformed_requests_get_an_error_reply_not_an_exception(msg):
    svc = BarrierService()
    out = svc.handle(3, msg, 0.0)
    assert len(out) == 1 and out[0][0] == 3 and out[0][1]["op"] == "error"
    assert wire(out[0][1]) == out[0][1]


def test_catch_up_reply():
    svc = BarrierService()
    spec = BarrierSpec(max=3, timeout=1.0, late="catch_up")
    svc.handle(0, enter(1, "b", "a", spec), 0.0)
    svc.tick(1.0)
    out = svc.handle(1, enter(1, "b", "b", spec, round=0), 2.0)
    m = out[0][1]
    assert m["op"] == "catch_up" and m["next_round"] == 1 and m["round"] == 0 and m["rank"] == 1
    assert FireInfo.from_dict(m["fire"]).passed == {"a": 0}


def test_enter_callback_installed_on_the_service():
    svc = BarrierService()
    svc.set_enter_callback("b", lambda label, rank, default: label == "go")
    svc.handle(0, enter(1, "b", "a", BarrierSpec(max=5)), 0.0)
    out = svc.handle(1, enter(1, "b", "go", BarrierSpec(max=5)), 1.0)
    assert len(out) == 2
    assert BarrierRelease.from_dict(out[0][1]["release"]).fire.reason is FireReason.CALLBACK


def test_semaphore_over_messages_with_hold_timeout():
    svc = BarrierService()
    spec = SemaphoreSpec(n=1, hold_timeout=5.0).to_dict()
    out = svc.handle(0, {"op": "acquire", "id": 1, "name": "s", "label": "a", "spec": spec}, 0.0)
    assert out[0][1]["op"] == "admitted"
    assert svc.handle(1, {"op": "acquire", "id": 1, "name": "s", "label": "b", "spec": spec}, 1.0) == []
    out = svc.tick(5.0)
    adm = Admission.from_dict(out[0][1]["admission"])
    assert out[0][0] == 1 and adm.reason is AdmitReason.HOLD_TIMEOUT
    ack = svc.handle(0, {"op": "release", "id": 2, "name": "s", "label": "a"}, 6.0)
    assert ack == [(0, {"op": "ack", "id": 2})]
    out = svc.handle(1, {"op": "release", "id": 2, "name": "s", "label": "b"}, 7.0)
    assert out == [(1, {"op": "ack", "id": 2})]


def test_throttle_over_messages():
    svc = BarrierService()
    spec = ThrottleSpec(period=2.0, count=1).to_dict()
    out = svc.handle(0, {"op": "throttle", "id": 1, "name": "t", "label": "a", "spec": spec}, 0.0)
    assert out[0][1]["op"] == "admitted"
    assert svc.handle(1, {"op": "throttle", "id": 1, "name": "t", "label": "b", "spec": spec}, 0.5) == []
    assert svc.next_deadline() == 2.0
    out = svc.tick(2.0)
    assert out[0][0] == 1 and out[0][1]["admission"]["time"] == 2.0
    assert svc.handle(0, {"op": "complete", "id": 2, "name": "t", "label": "a"}, 3.0)[0][1]["op"] == "ack"


def test_client_and_service_without_threads():
    """A client wired to the service by hand: enter_async callbacks see the releases and rounds advance."""
    svc = BarrierService()
    outbox = {0: [], 1: []}
    clients = {r: BarrierClient(outbox[r].append) for r in (0, 1)}
    results = []
    spec = BarrierSpec(max=2)

    def pump(now):
        for r in (0, 1):
            while outbox[r]:
                for dst, reply in svc.handle(r, wire(outbox[r].pop(0)), now):
                    clients[dst].deliver(wire(reply))

    for rnd in range(2):
        clients[0].enter_async("b", "x", results.append, spec)
        clients[1].enter_async("b", "y", results.append, spec)
        pump(float(rnd))
    assert [(r.label, r.round) for r in results] == [("x", 0), ("y", 0), ("x", 1), ("y", 1)]
    assert clients[0].next_round("b", "x") == 2


def test_client_maps_error_replies_to_exceptions():
    svc = BarrierService()
    sent = []
    c = BarrierClient(sent.append)
    box = []
    svc.handle(1, enter(1, "b", "z", BarrierSpec(max=2)), 0.0)
    c.enter_async("b", "a", box.append, BarrierSpec(max=3))
    for _dst, reply in svc.handle(0, sent.pop(), 0.0):
        c.deliver(reply)
    assert isinstance(box[0], BarrierMismatchError)


def test_callbacks_are_refused_by_a_remote_client():
    c = BarrierClient(lambda m: None)
    with pytest.raises(TypeError, match="cannot cross processes"):
        c.enter("b", "a", BarrierSpec(max=2), callback=lambda *a: True, timeout=0.1)


# ---------------------------------------------------------------------------- wire format (hypothesis)
names = st.text(min_size=1, max_size=12)
times = st.floats(0, 1e9, allow_nan=False)


@given(max_=st.integers(1, 10**6), timeout=st.one_of(st.none(), st.floats(1e-3, 1e6)),
       percent=st.one_of(st.none(), st.floats(1e-3, 100)), min_wait=st.one_of(st.none(), st.floats(0, 1e6)),
       late=st.sampled_from(["pass", "catch_up"]), knee=st.booleans())
def test_barrier_spec_roundtrip(max_, timeout, percent, min_wait, late, knee):
    spec = BarrierSpec(max_, timeout, percent, min_wait, late, knee)
    assert spec_from_dict(wire(spec.to_dict())) == spec


@given(n=st.integers(1, 100), ht=st.one_of(st.none(), st.floats(1e-3, 1e6)), w=st.one_of(st.none(), st.integers(1, 50)))
def test_semaphore_spec_roundtrip(n, ht, w):
    spec = SemaphoreSpec(n, ht, w)
    assert spec_from_dict(wire(spec.to_dict())) == spec


@given(name=names, rnd=st.integers(0, 2**40), reason=st.sampled_from(list(FireReason)), t=times,
       passed=st.dictionaries(names, st.integers(0, 2**31), max_size=20), label=names,
       rank=st.integers(0, 2**31), status=st.sampled_from(list(Status)))
def test_release_roundtrip(name, rnd, reason, t, passed, label, rank, status):
    fire = FireInfo(name, rnd, reason, t, passed)
    rel = BarrierRelease(name, label, rank, rnd, status, fire, t)
    back = BarrierRelease.from_dict(wire(rel.to_dict()))
    assert back == rel and list(back.fire.passed) == list(passed)   # arrival order kept


@given(name=names, label=names, rank=st.integers(0, 2**31), reason=st.sampled_from(list(AdmitReason)), t=times)
def test_admission_roundtrip(name, label, rank, reason, t):
    adm = Admission(name, label, rank, reason, t)
    assert Admission.from_dict(wire(adm.to_dict())) == adm


def test_peer_lost_frees_semaphore_slots_and_forgets_requests():
    svc = BarrierService()
    spec = SemaphoreSpec(n=1).to_dict()
    svc.handle(0, {"op": "acquire", "id": 1, "name": "s", "label": "a", "spec": spec}, 0.0)
    assert svc.handle(1, {"op": "acquire", "id": 1, "name": "s", "label": "b", "spec": spec}, 0.0) == []
    svc.handle(2, {"op": "acquire", "id": 1, "name": "s", "label": "c", "spec": spec}, 0.0)
    svc.handle(1, enter(2, "bar", "b", BarrierSpec(max=2)), 0.0)
    out = svc.peer_lost(0, 1.0)               # rank 0 held the slot: b gets it
    assert [(d, m["op"], m["admission"]["reason"]) for d, m in out] == [(1, "admitted", "peer_lost")]
    assert svc.peer_lost(2, 1.5) == [] and svc.get("s").waiting == []
    out = svc.peer_lost(1, 2.0)               # b dies holding it; nobody waits any more
    assert out == [] and svc.get("s").holders == []
    out = svc.handle(3, enter(1, "bar", "z", BarrierSpec(max=2)), 3.0)
    assert [d for d, _ in out] == [3]         # the fire is not sent to dead rank 1


@given(order=st.permutations(list(range(4))), dups=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 8)),
                                                             max_size=12),
       ticks=st.lists(st.floats(0, 20), max_size=5))
def test_duplicates_and_ticks_never_fire_twice(order, dups, ticks):
    """Random arrival order, duplicated messages and extra ticks: every request gets one consistent answer."""
    svc = BarrierService()
    spec = BarrierSpec(max=4, percent=50, min_wait=5.0)
    msgs = {r: enter(1, "b", f"t{r}", spec, round=0) for r in range(4)}
    schedule = [(float(i), r) for i, r in enumerate(order)]
    for r, slot in dups:                                   # resend rank r's message at a random later time
        schedule.append((order.index(r) + slot * 0.5, r))
    events = sorted(schedule + [(t, None) for t in ticks], key=lambda e: e[0])
    answers = {}
    for t, r in events:
        out = svc.tick(t) if r is None else svc.handle(r, msgs[r], t)
        for dst, m in out:
            answers.setdefault((dst, m["id"]), []).append(wire(m))
    for dst, m in svc.tick(1e6):
        answers.setdefault((dst, m["id"]), []).append(wire(m))
    assert set(answers) == {(r, 1) for r in range(4)}
    fires = set()
    for (_dst, _), ms in answers.items():
        assert all(m == ms[0] for m in ms)                 # repeats are identical
        rel = BarrierRelease.from_dict(ms[0]["release"])
        fires.add((rel.fire.round, rel.fire.time, tuple(rel.fire.passed)))
    assert len(fires) == 1                                 # one fire, seen the same by everybody
