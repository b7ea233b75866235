"""A self-pipe waker: lets one thread wake another that sleeps in select/poll/epoll.

One socket pair; :meth:`Waker.wake` writes a byte (at most one until the next :meth:`Waker.drain`),
and the reading end is registered with the sleeper's selector through :meth:`Waker.fileno`.
"""

from __future__ import annotations

import socket

__all__ = ["Waker"]


class Waker:
    """Wakes a thread waiting on :meth:`fileno` becoming readable. Thread-safe; closing is final."""

    def __init__(self) -> None:
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._pending = False

    def fileno(self) -> int:
        """The reading end's descriptor (-1 once closed), for select/poll/epoll and ``selectors``."""
        return self._r.fileno()

    def wake(self) -> None:
        """Make :meth:`fileno` readable. A wake-up while one is pending writes nothing more: the
        sleeper has not drained yet, so it still sees the work its callers queued before waking it."""
        if self._pending:
            return
        self._pending = True
        try:
            self._w.send(b"\0")
        except OSError:     # full (a wake-up is pending anyway) or closed
            pass

    def drain(self) -> None:
        """Consume pending wake-ups; call it before looking at the work they announce."""
        # Drain first, then clear the flag: a wake-up skipped meanwhile (flag still set) needs no byte,
        # because its caller queued its work before waking us and the drainer still sees it.
        try:
            while self._r.recv(4096):
                pass
        except OSError:     # nothing more to read (BlockingIOError), or closed
            pass
        self._pending = False

    def close(self) -> None:
        """Close both ends; later wake-ups do nothing."""
        for s in (self._r, self._w):
            try:
                s.close()
            except OSError:
                pass
