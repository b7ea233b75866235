"""A doorbell: what the MPI channel's waiting poll needs of ``threading.Event``, where ringing it costs
an attribute store unless a thread is asleep on it.

Every released message rings the bell (its credit and buffer go back at the next poll), almost always
from the thread that runs the engine, with nobody asleep: ``threading.Event.set`` would take a lock
and notify an empty condition each time.
"""

from __future__ import annotations

import threading

__all__ = ["Doorbell"]


class Doorbell:
    """``set`` / ``is_set`` / ``clear`` / ``wait`` as ``threading.Event``'s. Thread-safe.

    A sleeper counts itself (``_sleepers``) before it looks at the flag; a ringer sets the flag before
    it looks at the count. So either the sleeper sees the flag and does not sleep, or the ringer sees
    the sleeper and sets the event it sleeps on."""

    __slots__ = ("_flag", "_sleepers", "_event", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._sleepers = 0
        self._event = threading.Event()
        self._lock = threading.Lock()     # guards _sleepers among sleepers

    def set(self) -> None:
        self._flag = True
        if self._sleepers:
            self._event.set()

    def is_set(self) -> bool:
        return self._flag

    def clear(self) -> None:
        self._flag = False
        if self._event.is_set():
            self._event.clear()

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until the bell rings or ``timeout`` passes; whether it rang (the flag)."""
        with self._lock:
            self._sleepers += 1
        try:
            if self._flag:
                return True
            self._event.wait(timeout)
            if not self._flag and self._event.is_set():
                self._event.clear()   # set for a ring that was cleared meanwhile: do not wake again
            return self._flag
        finally:
            with self._lock:
                self._sleepers -= 1
