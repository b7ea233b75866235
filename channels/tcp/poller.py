"""epoll (poll where there is none) over descriptors, each with an object, for the TCP channel.

Unlike ``selectors``, a descriptor can be muted (registered with no events) and unmuted with one
system call and no bookkeeping, which a sending thread does per message (see ``TCPChannel.push``).
"""

from __future__ import annotations

import select
from typing import Any

IN, OUT = select.POLLIN, select.POLLOUT      # the same bits as EPOLLIN and EPOLLOUT
#: Events that call for a read: a hang-up or an error is found out by reading.
READABLE = IN | select.POLLHUP | select.POLLERR
_GONE = object()


class Poller:
    """Descriptors with an object each; :meth:`poll` returns the objects of the ready ones. A muted
    descriptor still reports a hang-up or an error."""

    def __init__(self) -> None:
        self._epoll = select.epoll() if hasattr(select, "epoll") else None
        self._poll = None if self._epoll is not None else select.poll()
        self._objs: dict[int, Any] = {}

    def register(self, fd: int, events: int, obj: Any) -> None:
        (self._epoll or self._poll).register(fd, events)  # type: ignore[union-attr]
        self._objs[fd] = obj

    def modify(self, fd: int, events: int) -> None:
        (self._epoll or self._poll).modify(fd, events)  # type: ignore[union-attr]

    def unregister(self, fd: int) -> None:
        self._objs.pop(fd, None)
        try:
            (self._epoll or self._poll).unregister(fd)  # type: ignore[union-attr]
        except (KeyError, OSError, ValueError):
            pass

    def poll(self, timeout: float) -> list[tuple[Any, int]]:
        """``(object, events)`` of the ready descriptors, waiting up to ``timeout`` seconds."""
        if self._epoll is not None:
            ready = self._epoll.poll(timeout)
        else:
            ready = self._poll.poll(timeout * 1000.0)  # type: ignore[union-attr]
        if not ready:
            return []           # (the common answer of a spinning waiter's round: no generator made)
        get = self._objs.get    # another thread may unregister meanwhile (wait() runs unlocked)
        out = []
        for fd, ev in ready:
            obj = get(fd, _GONE)
            if obj is not _GONE:
                out.append((obj, ev))
        return out

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
        self._objs.clear()
