"""A worker's live link to the bootstrap master: heartbeats, master events, service requests, leaving."""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from typing import Any
from collections.abc import Callable, Iterable

from twisternet.errors import ClosedError, ProtocolError
from twisternet.waker import Waker

from .wire import MAX_REASON, FrameReader, encode_message

log = logging.getLogger(__name__)


class MasterSession:
    """A worker's live link to the bootstrap master (returned by :func:`join`).

    Holds the rank, world and address table, exchanges heartbeats on a daemon thread, and reports
    master events (``peer_lost``, ``service`` replies, ``master_lost``) to :meth:`on_event` callbacks.
    """

    def __init__(self, sock: socket.socket, frames: FrameReader, rank: int, world: int,
                 table: list[dict[str, Any]], master: str, *, heartbeat_interval: float,
                 peer_timeout: float, pending: Iterable[dict[str, Any]] = ()) -> None:
        self.rank = rank
        self.world = world
        #: Index = rank: the ``listen`` map that rank sent, plus ``"host_id"``.
        self.table = table
        #: The master's HOST:PORT.
        self.master = master
        #: The local IP address of the master link (the address this host uses to reach the master).
        self.local_host: str = sock.getsockname()[0] if sock.family != socket.AF_UNIX else ""
        #: Ranks the master announced as lost.
        self.lost: set[int] = set()
        self._sock = sock
        self._frames = frames
        self._hb = heartbeat_interval
        self._peer_timeout = peer_timeout
        self._send_lock = threading.Lock()
        self._cb_lock = threading.Lock()
        self._callbacks: list[Callable[[dict[str, Any]], None]] = []
        self._backlog: list[dict[str, Any]] = []
        self._closing = False
        self._broken = False
        self._shutdown_seen = False
        self._stop = False
        self._waker = Waker()
        self._last_rx = time.monotonic()
        sock.setblocking(True)
        sock.settimeout(peer_timeout)  # bounds a sendall to a master that stopped reading
        for msg in pending:  # arrived in the same read as the table
            self._dispatch(msg)
        self._thread = threading.Thread(target=self._run, name=f"twisternet-master-link-{rank}",
                                        daemon=True)
        self._thread.start()

    def on_event(self, callback: Callable[[dict[str, Any]], None]) -> None:
        """Call ``callback(event)`` (on the link thread) for every master event; events that arrived
        before the first callback was registered are delivered to it at once."""
        with self._cb_lock:
            self._callbacks.append(callback)
            backlog, self._backlog = self._backlog, []
        for event in backlog:
            self._call(callback, event)

    def send(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` (e.g. ``{"service": "barrier", ...}``) to the master. Thread-safe.

        Raises ClosedError once the session is closed or the master link is gone.
        """
        frame = encode_message(msg)
        with self._send_lock:
            if self._closing:
                raise ClosedError("master session is closed")
            if self._broken:
                raise ClosedError("the master link is lost")
            try:
                self._sock.sendall(frame)
            except OSError as e:
                self._broken = True
                self._waker.wake()
                raise ClosedError(f"the master link is lost: {e}") from None

    def close(self) -> None:
        """Leave cleanly: say ``bye`` (so the master does not report this rank lost) and stop the link."""
        with self._send_lock:
            if self._closing:
                return
            self._closing = True
            if not self._broken:
                try:
                    self._sock.sendall(encode_message({"type": "bye"}))
                    self._sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
        if threading.current_thread() is self._thread:
            self._stop = True  # called from an event callback: the link thread ends after it
            return
        # The master closes its end after the bye; the link thread sees EOF and ends by itself.
        self._thread.join(timeout=min(5.0, self._peer_timeout))
        self._stop = True
        self._waker.wake()
        self._thread.join(timeout=2.0)
        self._waker.close()

    def abort(self, reason: str) -> None:
        """Leave *without* ``bye``, telling the master why first: it reports this rank lost to the others
        with ``reason`` (e.g. the peer loss that made this rank fail), so theirs name the first cause."""
        self._hang_up(encode_message({"type": "abort", "reason": str(reason)[:MAX_REASON]}))

    def sever(self) -> None:
        """Drop the master link at once, saying nothing, as a process that dies does: the master
        reports this rank lost ("closed without a goodbye") to the others."""
        self._hang_up(None)

    def _hang_up(self, last_words: bytes | None) -> None:
        """Send ``last_words`` (if any, best effort), then close the link without ``bye``."""
        with self._send_lock:
            if self._closing:
                return
            self._closing = True
            if not self._broken and last_words is not None:
                try:
                    self._sock.settimeout(1.0)   # best effort: a master that does not read must not hold us
                    self._sock.sendall(last_words)
                except OSError:
                    pass
            self._broken = True
        self._stop = True
        self._waker.wake()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
        try:
            self._sock.close()
        except OSError:
            pass
        self._waker.close()

    def __enter__(self) -> MasterSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- link thread
    def _emit(self, event: dict[str, Any]) -> None:
        with self._cb_lock:
            callbacks = list(self._callbacks)
            if not callbacks:
                self._backlog.append(event)
                return
        for cb in callbacks:
            self._call(cb, event)

    @staticmethod
    def _call(cb: Callable[[dict[str, Any]], None], event: dict[str, Any]) -> None:
        try:
            cb(event)
        except Exception:
            log.exception("master session: event callback failed on %r", event.get("type"))

    def _run(self) -> None:
        try:
            reason = self._link_loop()
        except Exception as e:  # never let the link thread die silently
            log.exception("master session: link thread failed")
            reason = f"link thread failed: {e}"
        finally:
            try:
                self._sock.close()
            except OSError:
                pass
        if reason is None or self._closing:
            return
        if self._shutdown_seen:
            log.info("master session (rank %d): the master shut down", self.rank)
            return
        self._broken = True
        log.warning("master session (rank %d): master lost: %s", self.rank, reason)
        self._emit({"type": "master_lost", "reason": reason})

    def _link_loop(self) -> str | None:
        """Read, dispatch and heartbeat until the link ends; return why (None: asked to stop)."""
        next_hb = time.monotonic() + self._hb
        watched: list[Any] = [self._sock, self._waker]
        while True:
            if self._stop:
                return None
            now = time.monotonic()
            if self._broken:
                return "the master link failed"
            if not self._closing and now - self._last_rx > self._peer_timeout:
                return f"no message from the master for {self._peer_timeout:g}s"
            wait = 0.2 if self._closing else max(0.0, min(next_hb, self._last_rx + self._peer_timeout) - now)
            try:
                ready, _, _ = select.select(watched, [], [], wait)
            except (OSError, ValueError):
                return "the master link was closed"
            if self._waker in ready:
                self._waker.drain()
            if self._sock in ready:
                try:
                    data = self._sock.recv(1 << 16)
                except OSError as e:
                    return f"the master connection failed: {e}"
                if not data:
                    return "the master closed the connection"
                self._last_rx = time.monotonic()
                try:
                    messages = self._frames.feed(data)
                except ProtocolError as e:
                    return str(e)
                for msg in messages:
                    self._dispatch(msg)
            if time.monotonic() >= next_hb and not self._closing:
                next_hb = time.monotonic() + self._hb
                with self._send_lock:
                    if not self._closing:
                        try:
                            self._sock.sendall(encode_message({"type": "hb"}))
                        except OSError as e:
                            return f"heartbeat to the master failed: {e}"

    def _dispatch(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "hb":
            return
        if kind == "peer_lost":
            rank = msg.get("rank")
            if isinstance(rank, int):
                self.lost.add(rank)
            self._emit(msg)
            return
        if kind == "shutdown":
            self._shutdown_seen = True
            self._emit({"type": "master_shutdown"})
            return
        self._emit(msg)
