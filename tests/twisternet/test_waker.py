"""The self-pipe waker (twisternet.waker) that the TCP channel and the bootstrap master and session share."""

from __future__ import annotations

import select
import selectors
import threading

import pytest

from twisternet.waker import Waker

pytestmark = pytest.mark.timeout(60)


def _readable(w: Waker, timeout: float = 0.0) -> bool:
    return bool(select.select([w], [], [], timeout)[0])


def test_a_wake_makes_it_readable_until_drained() -> None:
    w = Waker()
    try:
        assert not _readable(w)
        w.wake()
        assert _readable(w)
        w.drain()
        assert not _readable(w)
    finally:
        w.close()


def test_wakes_before_a_drain_write_one_byte_and_a_wake_after_it_writes_again() -> None:
    w = Waker()
    try:
        for _ in range(100_000):        # far more than a socket buffer holds: coalesced, never blocks
            w.wake()
        assert w._r.recv(1 << 20) == b"\0"
        w.drain()
        w.wake()                        # the drain re-armed it
        assert _readable(w)
    finally:
        w.close()


def test_it_wakes_a_thread_sleeping_in_a_selector() -> None:
    w = Waker()
    woke = threading.Event()

    def sleeper() -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(w, selectors.EVENT_READ)
            if sel.select(30):
                woke.set()

    t = threading.Thread(target=sleeper)
    t.start()
    try:
        w.wake()
        t.join(30)
        assert woke.is_set()
    finally:
        w.close()


def test_after_close_wake_and_drain_do_nothing() -> None:
    w = Waker()
    w.close()
    assert w.fileno() == -1
    w.wake()
    w.drain()
    w.close()
