"""The MPI channel's doorbell: rings are never lost, sleepers wake, a ring with nobody asleep is a store."""

import threading

import pytest

from channels.mpi.doorbell import Doorbell

pytestmark = pytest.mark.timeout(60)


def test_a_ring_before_the_wait_is_seen_at_once_and_clear_forgets_it() -> None:
    bell = Doorbell()
    assert not bell.is_set()
    bell.set()
    assert bell.is_set() and bell.wait(60.0)
    bell.clear()
    assert not bell.is_set() and not bell.wait(0.0)


def test_a_sleeper_is_woken_by_a_ring_from_another_thread() -> None:
    bell = Doorbell()
    asleep = threading.Event()
    got: list[bool] = []

    def sleeper() -> None:
        asleep.set()
        got.append(bell.wait(60.0))

    t = threading.Thread(target=sleeper, daemon=True)
    t.start()
    asleep.wait(10)
    bell.set()           # before or after the sleeper counted itself: either way it returns now
    t.join(30)
    assert not t.is_alive() and got == [True]


def test_no_ring_is_lost_between_a_look_at_the_flag_and_the_sleep() -> None:
    """Two threads ring each other 500 times, each sleeping up to a minute: a lost ring stalls the test."""
    bells = (Doorbell(), Doorbell())
    rounds = 500
    stalled: list[int] = []

    def player(me: int) -> None:
        for i in range(rounds):
            if me == 1 or i > 0:
                while not bells[me].is_set():
                    if not bells[me].wait(30.0):
                        stalled.append(i)
                        return
                bells[me].clear()
            bells[1 - me].set()

    threads = [threading.Thread(target=player, args=(m,), daemon=True) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert [t.is_alive() for t in threads] == [False, False] and stalled == []
