"""Connections that arrive after the TCP mesh is built: proven (bounded), then refused.

Every peer is connected by then, so a late connection is a stranger or a retry; it must neither hold
the engine nor spin it: handshakes run on at most :data:`MAX_PENDING_HANDSHAKES` threads, ``accept``
errors back off, and the logs are rate-limited.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from twisternet.auth import handshake
from twisternet.config import Config
from twisternet.errors import AuthError, ProtocolError
from twisternet.logthrottle import LogThrottle

from .poller import IN, Poller

log = logging.getLogger(__name__)

#: Connections to a listening port that may be in their handshake at once (one thread each). Once the
#: mesh is built nobody may connect any more, so more than this are closed at once, unread.
MAX_PENDING_HANDSHAKES = 16
#: Seconds a listener rests after ``accept`` failed (EMFILE at the descriptor limit, ENOBUFS, ...),
#: doubling up to the maximum while it keeps failing: the connection stays in the kernel's queue and
#: the listener stays readable, so retrying at once spins a core and writes a log line per round.
ACCEPT_BACKOFF_MIN = 0.05
ACCEPT_BACKOFF_MAX = 1.0


class LateConnections:
    """Accepts on the channel's listeners (registered in ``poller`` with themselves as the object)."""

    def __init__(self, rank: int, token: bytes, config: Config, poller: Poller) -> None:
        self.rank = rank
        self._token = token
        self._config = config
        self._poller = poller
        self._vetting = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._backoff = 0.0
        #: Listeners resting after a failed ``accept``: fd -> (listener, resume at). Non-empty: some
        #: rest (a dict, so checking it on every progress round costs no call).
        self.paused: dict[int, tuple[socket.socket, float]] = {}
        self._noise = LogThrottle(log)
        self._closed = False
        #: Late connections closed unread because MAX_PENDING_HANDSHAKES were already running.
        self.dropped = 0

    def accept(self, ls: socket.socket) -> None:
        """Take the connections waiting on ``ls``: each gets a bounded handshake (and is then refused:
        every peer is connected already), or is closed at once while MAX_PENDING_HANDSHAKES run."""
        for _ in range(64):     # a bounded batch per round: the engine has other work
            try:
                sock, addr = ls.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._pause(ls, e)
                return
            self._backoff = 0.0
            if not self._vetting.acquire(blocking=False):
                self.dropped += 1
                self._noise.warning("busy", "rank %d: closed a connection from %s unread: %d handshakes "
                                    "already running", self.rank, addr or "a local socket",
                                    MAX_PENDING_HANDSHAKES)
                sock.close()
                continue
            try:
                threading.Thread(target=self._vet, args=(sock, addr), daemon=True,
                                 name=f"twisternet-vet-{self.rank}").start()
            except RuntimeError as e:   # cannot start a thread (resource limit)
                self._vetting.release()
                sock.close()
                self._pause(ls, e)
                return

    def _pause(self, ls: socket.socket, error: BaseException) -> None:
        """``accept`` failed: stop watching ``ls`` for a while (backing off while it keeps failing)."""
        self._backoff = min(ACCEPT_BACKOFF_MAX, max(ACCEPT_BACKOFF_MIN, 2 * self._backoff))
        self._noise.warning("accept", "rank %d: accept failed (%s); not accepting for %.2fs",
                            self.rank, error, self._backoff)
        fd = ls.fileno()
        if fd >= 0 and fd not in self.paused:
            self._poller.unregister(fd)
            self.paused[fd] = (ls, time.monotonic() + self._backoff)

    def resume(self, timeout: float) -> float:
        """Watch paused listeners again once their rest is over; ``timeout`` cut to the next resume."""
        now = time.monotonic()
        for fd, (ls, at) in list(self.paused.items()):
            if at <= now:
                del self.paused[fd]
                if ls.fileno() >= 0 and not self._closed:
                    self._poller.register(fd, IN, ls)
            else:
                timeout = min(timeout, at - now)
        return timeout

    def _vet(self, sock: socket.socket, addr: Any) -> None:
        """A connection after the mesh was built: prove it, then refuse it (every peer is connected)."""
        try:
            sock.setblocking(True)
            hello = handshake(sock, self._token, initiator=False, hello={"rank": self.rank},
                              timeout=self._config.handshake_timeout)
            self._noise.warning("late", "rank %d: refused an authenticated late connection claiming "
                                "rank %r from %s", self.rank, hello.get("rank"), addr or "a local socket")
        except (AuthError, ProtocolError, OSError) as e:
            self._noise.warning("dropped", "rank %d: dropped a connection from %s: %s", self.rank,
                                addr or "a local socket", e)
        finally:
            self._vetting.release()
            try:
                sock.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop resuming paused listeners (the channel closes them)."""
        self._closed = True
        self.paused.clear()
