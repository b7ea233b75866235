"""Injected clocks: the barrier state machines never read the time themselves, so tests can drive them."""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    """Anything with a ``time()`` returning seconds as a float from an arbitrary, non-decreasing origin."""

    def time(self) -> float:
        """The current time in seconds."""
        ...


class MonotonicClock:
    """The real clock: ``time.monotonic()`` (immune to wall-clock jumps)."""

    def time(self) -> float:
        """Seconds from an arbitrary origin, never going backwards."""
        return time.monotonic()


class ManualClock:
    """A clock that only moves when told to; thread-safe so a test thread may advance it under a harness."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def time(self) -> float:
        """The time last set."""
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds`` (>= 0) and return the new time."""
        if seconds < 0:
            raise ValueError(f"a clock cannot go backwards (advance by {seconds!r})")
        with self._lock:
            self._now += float(seconds)
            return self._now

    def set(self, now: float) -> None:
        """Jump to the absolute time ``now`` (not before the current time)."""
        with self._lock:
            if now < self._now:
                raise ValueError(f"a clock cannot go backwards ({now!r} < {self._now!r})")
            self._now = float(now)
