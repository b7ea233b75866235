"""LiveCoflowTable: registration, progress, priorities/rates from the policies, thread safety."""

from __future__ import annotations

import threading

import pytest

from twisternet.coflow import CoflowError, LiveCoflowTable


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_sebf_priorities_and_rates_over_ranks() -> None:
    clock = FakeClock()
    tab = LiveCoflowTable(3, "sebf", rank_capacity=1.0, clock=clock, starvation_period=None)
    # Varys example on ranks: big = 0->0 4 bytes; wide = 0->1, 1->2, 2->0 2 bytes each (Γ 2 < 4).
    assert tab.register("big", [(0, 0, 4.0)])
    assert tab.register("wide", [(0, 1, 2.0), (1, 2, 2.0), (2, 0, 2.0)])
    assert tab.priorities() == {"wide": 0, "big": 1}
    assert tab.rates() == {"wide": [1.0, 1.0, 1.0], "big": [0.0]}
    # Progress: wide sent everything except 1.5 bytes on its first flow; big sent 3.5 -> big's Γ is
    # now 0.5 < wide's 1.5, so the order flips.
    tab.report_progress("wide", 0, 0.5)
    tab.report_progress("wide", (1, 2), 2.0)
    tab.report_progress("wide", 2, 2.0)
    tab.report_progress("big", 0, 3.5)
    assert tab.remaining("wide") == [1.5, 0.0, 0.0]
    assert tab.priorities() == {"big": 0, "wide": 1}
    tab.unregister("big")
    assert tab.priorities() == {"wide": 0} and len(tab) == 1 and "big" not in tab


def test_parents_and_rejections() -> None:
    clock = FakeClock()
    tab = LiveCoflowTable(2, "deadline", rank_capacity=1.0, clock=clock)
    assert tab.register("a", [(0, 0, 4.0)], deadline=5.0)
    assert not tab.register("b", [(0, 1, 1.0)], deadline=1.5)  # in0 only has 0.2 unreserved
    assert tab.register("c", [(1, 1, 1.0)], parents=["a"])
    assert tab.rejected() == ["b"]
    pr = tab.priorities()
    assert pr["a"] == 0 and pr["b"] == 1 and "c" not in pr  # rejected ranked last; c waits for a
    tab.unregister("a")
    assert set(tab.priorities()) == {"b", "c"}


def test_bad_registrations() -> None:
    tab = LiveCoflowTable(2, "fair")
    with pytest.raises(CoflowError):
        tab.register("x", [(0, 2, 1.0)])
    with pytest.raises(CoflowError):
        tab.register("x", [(0, 1, 0.0)])
    with pytest.raises(CoflowError):
        tab.register("x", [])
    tab.register("x", [(0, 1, 1.0)])
    with pytest.raises(CoflowError):
        tab.register("x", [(0, 1, 1.0)])
    with pytest.raises(CoflowError):
        tab.report_progress("y", 0, 1.0)
    with pytest.raises(CoflowError):
        tab.report_progress("x", 3, 1.0)
    with pytest.raises(CoflowError):
        LiveCoflowTable(0)


@pytest.mark.timeout(60)
def test_thread_safety() -> None:
    tab = LiveCoflowTable(8, "sebf", rank_capacity=1000.0, starvation_period=None)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for k in range(40):
                cid = (w, k)
                tab.register(cid, [(w, (w + j) % 8, 100.0 + j) for j in range(3)])
                tab.report_progress(cid, 0, 50.0)
                pr = tab.priorities()
                assert cid in pr
                tab.rates()
                tab.unregister(cid)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[0]
    assert len(tab) == 0
