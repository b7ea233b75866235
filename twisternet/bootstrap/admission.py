"""The master's front door: accept connections, prove each one's token on a bounded pool of threads.

At most :data:`MAX_PENDING_HANDSHAKES` handshakes run at once (one thread each); further connections are
closed unread (a joining worker retries those), and ``accept`` errors back off instead of spinning.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from twisternet.auth import PeerClosedDuringHandshake, handshake
from twisternet.errors import AuthError, ProtocolError
from twisternet.logthrottle import LogThrottle

log = logging.getLogger(__name__)

#: Handshakes the master runs at once (one thread each); further connections are closed unread until
#: one finishes (a joining worker whose connection is closed that way retries).
MAX_PENDING_HANDSHAKES = 64
#: Seconds the listener rests after ``accept`` failed (EMFILE, ENOBUFS, ...), doubling up to the
#: maximum while it keeps failing (retrying at once would spin on the still-readable listener).
ACCEPT_BACKOFF_MIN = 0.05
ACCEPT_BACKOFF_MAX = 1.0


class Admission:
    """Accepts on ``listener`` (watched in ``sel`` with the data ``"listen"``) and authenticates.

    ``admitted(sock, peer, hello)`` and ``refused(peer, why)`` are called on the handshake threads.
    """

    def __init__(self, listener: socket.socket, sel: selectors.BaseSelector, token: bytes, world: int,
                 handshake_timeout: float, admitted: Callable[[socket.socket, str, dict[str, Any]], None],
                 refused: Callable[[str, str], None]) -> None:
        #: The listening socket (watched while no ``accept`` error makes it rest).
        self.listener = listener
        self._sel = sel
        self._token = token
        self._hello = {"kind": "master", "world": world}
        self._handshake_timeout = handshake_timeout
        self._admitted = admitted
        self._refused = refused
        self._slots = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._backoff = 0.0
        self._resume: float | None = None   # while accept rests after an error: when it resumes
        self._noise = LogThrottle(log)
        #: Connections closed unread because MAX_PENDING_HANDSHAKES were already running.
        self.dropped = 0

    def watch(self) -> None:
        """Start watching the listener."""
        self._sel.register(self.listener, selectors.EVENT_READ, "listen")

    def timeout(self, now: float, timeout: float) -> float:
        """Watch the listener again once its rest is over; ``timeout`` cut to the end of the rest."""
        if self._resume is not None:
            if now >= self._resume:
                self._resume = None
                self.watch()
            else:
                timeout = min(timeout, self._resume - now)
        return timeout

    def accept(self) -> None:
        """Take the waiting connections (a bounded batch: running workers have messages too)."""
        for _ in range(64):
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._pause(e)
                return
            self._backoff = 0.0
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            if not self._slots.acquire(blocking=False):
                self.dropped += 1
                self._noise.warning("busy", "bootstrap master: closed the connection from %s unread "
                                    "(%d handshakes already running)", peer, MAX_PENDING_HANDSHAKES)
                sock.close()
                continue
            sock.setblocking(True)
            try:
                threading.Thread(target=self._authenticate, args=(sock, peer), daemon=True,
                                 name="twisternet-master-handshake").start()
            except RuntimeError as e:   # cannot start a thread (resource limit)
                self._slots.release()
                sock.close()
                self._pause(e)
                return

    def _pause(self, error: BaseException) -> None:
        """``accept`` failed: stop watching the listener for a while, backing off while it fails."""
        self._backoff = min(ACCEPT_BACKOFF_MAX, max(ACCEPT_BACKOFF_MIN, 2 * self._backoff))
        self._noise.warning("accept", "bootstrap master: accept failed (%s); not accepting for %.2fs",
                            error, self._backoff)
        if self._resume is None:
            try:
                self._sel.unregister(self.listener)
            except (KeyError, ValueError):
                pass
        self._resume = time.monotonic() + self._backoff

    def _authenticate(self, sock: socket.socket, peer: str) -> None:
        """Runs in a short-lived thread per connection, bounded by the handshake timeout."""
        try:
            hello = handshake(sock, self._token, initiator=False, timeout=self._handshake_timeout,
                              hello=self._hello)
        except (AuthError, ProtocolError) as e:
            self._noise.warning("rejected", "bootstrap master: rejected connection from %s: %s", peer, e)
            sock.close()
            if not isinstance(e, PeerClosedDuringHandshake):   # a worker retries those
                self._refused(peer, "wrong job token" if isinstance(e, AuthError) and "token" in str(e)
                              else str(e))
            return
        except Exception:
            log.exception("bootstrap master: handshake with %s failed", peer)
            sock.close()
            return
        finally:
            self._slots.release()
        self._admitted(sock, peer, hello)

    def close(self) -> None:
        """Stop watching and close the listener."""
        self._resume = None
        try:
            self._sel.unregister(self.listener)
        except (KeyError, ValueError):
            pass
        self.listener.close()
