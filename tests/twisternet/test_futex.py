"""twisternet.futex: kernel waits on a shared word, the wake, and the fence's use in the wake protocol."""

from __future__ import annotations

import mmap
import threading
import time

import numpy as np
import pytest

from twisternet import futex

pytestmark = pytest.mark.skipif(not futex.available(), reason="futex: Linux on x86-64 only")


def _word() -> tuple[mmap.mmap, np.ndarray, int]:
    mm = mmap.mmap(-1, 4096)                      # MAP_SHARED | MAP_ANONYMOUS
    arr = np.frombuffer(mm, np.int64, 1)
    return mm, arr, arr.ctypes.data


def test_a_word_that_changed_does_not_sleep() -> None:
    mm, arr, addr = _word()
    arr[0] = 5
    t0 = time.monotonic()
    futex.wait(addr, 4, 30.0)                     # it holds 5, not 4: back at once
    assert time.monotonic() - t0 < 10.0
    del arr
    mm.close()


def test_a_wait_ends_at_its_timeout() -> None:
    mm, arr, addr = _word()
    futex.wait(addr, 0, 0.01)                     # nobody wakes it: returns after ~10 ms
    assert arr[0] == 0
    del arr
    mm.close()


def test_wake_ends_a_wait() -> None:
    mm, arr, addr = _word()
    asleep, done = threading.Event(), threading.Event()

    def sleeper() -> None:
        while arr[0] == 0:
            asleep.set()
            futex.wait(addr, 0, 60.0)
        done.set()

    th = threading.Thread(target=sleeper, daemon=True)
    th.start()
    assert asleep.wait(30)
    arr[0] = 1
    futex.fence()
    futex.wake(addr)
    assert done.wait(30)                          # long before the 60 s timeout
    th.join(30)


def test_the_low_half_of_a_large_counter_is_compared() -> None:
    mm, arr, addr = _word()
    arr[0] = (7 << 32) | 3
    futex.wait(addr, (7 << 32) | 3, 0.01)         # equal low halves: sleeps until the timeout
    t0 = time.monotonic()
    futex.wait(addr, (7 << 32) | 2, 30.0)         # low halves differ: at once
    assert time.monotonic() - t0 < 10.0
    del arr
    mm.close()
