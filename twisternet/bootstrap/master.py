"""The bootstrap master: gathers every worker's listen addresses into one table, then watches the job.

Once ``world`` workers joined (:mod:`.roster`), every worker receives the whole table at once; then
both sides send heartbeats, a worker whose link drops without ``bye`` or stays silent past
``peer_timeout`` is announced to the others as ``peer_lost``, and service requests go to
:mod:`.service_host`. With a ``join_timeout``, a job not complete in time fails: every joined worker
gets an ``error`` saying who joined and who was refused, and the master stops after ``fail_linger``.
"""

from __future__ import annotations

import collections
import logging
import selectors
import socket
import threading
import time
from typing import Any
from collections.abc import Callable, Iterable

from twisternet.errors import ConfigError, ProtocolError
from twisternet.waker import Waker

from .admission import Admission
from .join import check_token
from .roster import Roster
from .service_host import (
    Reply,
    ServiceDeadline,
    ServiceHandle,
    ServiceHost,
    ServiceTick,
)
from .wire import MAX_REASON, FrameReader, encode_message

log = logging.getLogger(__name__)

#: Bytes the master may queue for one worker that does not read before declaring it lost.
_MAX_OUTBUF = 64 << 20


class _Conn:
    """One authenticated worker connection, as the master sees it."""

    __slots__ = (
        "closing",
        "frames",
        "gave_up",
        "hello",
        "joined_at",
        "last_rx",
        "out",
        "peer",
        "rank",
        "sock",
    )

    def __init__(self, sock: socket.socket, peer: str, hello: dict[str, Any]) -> None:
        self.sock = sock
        self.peer = peer
        self.hello = hello
        self.rank: int | None = None
        self.frames = FrameReader()
        self.out = bytearray()
        self.last_rx = time.monotonic()
        self.closing = False  # close once ``out`` is flushed
        self.joined_at = self.last_rx
        self.gave_up: str | None = None   # why the worker said it aborts, before its link drops


class Master:
    """The bootstrap master: assigns ranks, distributes the address table, relays failures, hosts services.

    It binds in the constructor (so :attr:`address` is known at once) and serves from
    :meth:`serve_forever` (foreground) or :meth:`start` (a daemon thread).
    """

    def __init__(self, world: int, token: bytes, host: str = "0.0.0.0", port: int = 0, *,
                 handshake_timeout: float = 5.0, peer_timeout: float = 15.0,
                 heartbeat_interval: float | None = None, join_timeout: float | None = None,
                 fail_linger: float | None = None) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ConfigError("world", f"must be an integer >= 1, got {world!r}")
        for name, value in (("handshake_timeout", handshake_timeout), ("peer_timeout", peer_timeout)):
            if not value > 0:
                raise ConfigError(name, f"must be > 0 seconds, got {value!r}")
        if heartbeat_interval is None:
            heartbeat_interval = min(1.0, peer_timeout / 4)
        if not 0 < heartbeat_interval < peer_timeout:
            raise ConfigError("heartbeat_interval", "must be > 0 and smaller than peer_timeout")
        self.world = world
        self._token = check_token(token)
        self.handshake_timeout = handshake_timeout
        self.peer_timeout = peer_timeout
        self.heartbeat_interval = heartbeat_interval
        self.join_timeout = join_timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=max(128, world))
        self._listener.setblocking(False)
        #: The bound (host, port); the port is resolved when 0 was asked for.
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        #: Exit status once serving ended: 0 all workers left cleanly, 1 otherwise; None while serving.
        self.exit_code: int | None = None

        self._sel = selectors.DefaultSelector()
        self._waker = Waker()
        self._lock = threading.Lock()
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._services = ServiceHost()
        self._admission = Admission(self._listener, self._sel, self._token, world, handshake_timeout,
                                    self._admitted, self._refused_early)
        self._conns: dict[socket.socket, _Conn] = {}
        self._roster: Roster[_Conn] = Roster(world)             # authenticated workers waiting for the table
        self._by_rank: dict[int, _Conn] = {}     # running connections
        self._status: list[str] = ["absent"] * world   # absent / running / left / lost
        #: Per rank once the job runs: "rank R on HOST (ADDRESS; ranks on that host: ...)".
        self._places: list[str] = [f"rank {r}" for r in range(world)]
        self._phase = "joining"                  # joining / running / failed / done
        self._fail: dict[str, Any] | None = None
        self._failed_at = 0.0
        #: After the job failed to start, seconds the master keeps refusing late joiners (with the
        #: reason) before it stops serving.
        self._fail_linger = max(10.0, 2 * peer_timeout) if fail_linger is None else max(0.0, fail_linger)
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        self._serving = False
        self._shut = False
        self._done = threading.Event()
        self._started_at = time.monotonic()

    # ---------------------------------------------------------------- public API
    @property
    def dropped_connections(self) -> int:
        """Connections closed unread because MAX_PENDING_HANDSHAKES were already running."""
        return self._admission.dropped

    def start(self) -> Master:
        """Serve in a daemon thread; returns self."""
        with self._lock:
            if self._serving or self._shut:
                raise RuntimeError("master already started or stopped")
            self._serving = True
            self._thread = threading.Thread(target=self._serve, name="twisternet-master", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> int:
        """Serve in the calling thread until every worker left or was lost (or :meth:`stop`).

        Returns 0 when all workers left cleanly, 1 if one was lost or the job failed to start.
        """
        with self._lock:
            if self._serving or self._shut:
                raise RuntimeError("master already started or stopped")
            self._serving = True
        return self._serve()

    def _serve(self) -> int:
        self._started_at = time.monotonic()
        try:
            self._loop()
        finally:
            self._shutdown()
        return self.exit_code if self.exit_code is not None else 1

    def stop(self) -> None:
        """Tell connected workers the master shuts down, stop serving and release the port."""
        with self._lock:
            self._stop_requested = True
            serving = self._serving
            thread = self._thread
        if not serving:
            self._shutdown()
            return
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    @property
    def failure(self) -> str | None:
        """Why the job failed to start (the message every joined worker was sent), or None."""
        return None if self._fail is None else str(self._fail.get("message"))

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until serving ended; return :attr:`exit_code` (None if still serving at ``timeout``)."""
        self._done.wait(timeout)
        return self.exit_code

    def add_service(self, name: str, handle: ServiceHandle, tick: ServiceTick | None = None,
                    next_deadline: ServiceDeadline | None = None) -> None:
        """Route worker messages ``{"service": name, ...}`` to ``handle(src_rank, msg)``.

        ``handle`` and ``tick`` return (rank, msg) pairs that are sent to those workers as
        ``{"type": "service", "service": name, **msg}`` (``msg`` must not use the key ``"type"``).
        ``tick()`` runs once ``next_deadline()`` (a :func:`time.monotonic` time, or None) has passed.
        All callbacks run on the master's thread, one at a time, once the job started. A request for
        an unknown service, or a ``handle`` that raises, is answered with ``{"type": "service",
        "service": name, "error": "..."}``.
        """
        if not isinstance(name, str) or not name:
            raise ValueError("service name must be a non-empty string")
        if (tick is None) != (next_deadline is None):
            raise ValueError("tick and next_deadline must be given together")
        self._post(lambda: self._services.add(name, handle, tick, next_deadline))

    def on_peer_lost(self, hook: Callable[[int], Iterable[tuple[str, int, dict[str, Any]]]]) -> None:
        """Call ``hook(rank)`` on the master's thread when a running worker is lost; it returns
        ``(service, rank, msg)`` replies to send (as :meth:`add_service` replies are), e.g. a barrier
        released without the lost rank."""
        self._post(lambda: self._services.add_lost_hook(hook))

    def report_lost(self, rank: int, reason: str) -> None:
        """Declare ``rank`` lost (e.g. its process died): every other worker gets ``peer_lost`` at once."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {rank!r}")
        self._post(lambda: self._lose(rank, str(reason)))

    # ---------------------------------------------------------------- cross-thread plumbing
    def _post(self, fn: Callable[[], None]) -> None:
        with self._lock:
            queued = self._serving
            if queued:
                self._commands.append(fn)
        if queued:
            self._wake()
        else:
            fn()  # not serving yet (or any more): no loop thread to race with

    def _post_if_serving(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the master's thread if it is serving; drop it otherwise."""
        with self._lock:
            if not self._serving:
                return
            self._commands.append(fn)
        self._wake()

    def _wake(self) -> None:
        self._waker.wake()

    # ---------------------------------------------------------------- loop
    def _loop(self) -> None:  # noqa: C901 - the select loop, one branch per event
        self._admission.watch()
        self._sel.register(self._waker, selectors.EVENT_READ, "wake")
        next_hb = time.monotonic() + self.heartbeat_interval
        log.info("bootstrap master for %d workers listening on %s:%d", self.world, *self.address)
        while True:
            self._run_commands()
            with self._lock:
                if self._stop_requested:
                    return
            if self._phase == "done":
                return
            if self._phase == "failed" and time.monotonic() > self._failed_at + self._fail_linger:
                return  # refused late joiners long enough
            now = time.monotonic()
            timeout = max(0.0, next_hb - now)
            if self._phase == "running":  # services run once the job started
                d = self._services.next_deadline()
                if d is not None:
                    timeout = min(timeout, max(0.0, d - now))
            if self._phase == "joining" and self.join_timeout is not None:
                timeout = min(timeout, max(0.0, self._started_at + self.join_timeout - now))
            if self._phase == "failed":
                timeout = min(timeout, max(0.0, self._failed_at + self._fail_linger - now))
            timeout = self._admission.timeout(now, timeout)
            for key, mask in self._sel.select(timeout):
                if key.data == "listen":
                    self._admission.accept()
                elif key.data == "wake":
                    self._waker.drain()
                else:
                    conn: _Conn = key.data
                    if mask & selectors.EVENT_WRITE:
                        self._flush(conn)
                    if mask & selectors.EVENT_READ and conn.sock in self._conns:
                        self._read(conn)
            now = time.monotonic()
            beat = now >= next_hb
            if beat:
                next_hb = now + self.heartbeat_interval
            if self._phase == "running":
                self._send_replies(self._services.tick_due(now))
                if beat:
                    hb = encode_message({"type": "hb"})
                    for conn in list(self._by_rank.values()):
                        self._send_raw(conn, hb)
                for rank, conn in list(self._by_rank.items()):
                    if now - conn.last_rx > self.peer_timeout:
                        self._lose(rank, f"no message for {self.peer_timeout:g}s (heartbeat timeout)")
                if all(s in ("left", "lost") for s in self._status):
                    self.exit_code = 1 if "lost" in self._status else 0
                    self._phase = "done"
            elif self._phase == "joining" and self.join_timeout is not None \
                    and now - self._started_at > self.join_timeout:
                self._fail_join({"message": self._roster.timeout_message(self.address, self.join_timeout),
                                "timeout": self.join_timeout})

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                fn = self._commands.popleft()
            try:
                fn()
            except Exception:
                log.exception("bootstrap master: internal command failed")

    def _shutdown(self) -> None:
        """Say goodbye to connected workers, close every socket, mark serving as ended."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
            self._serving = False
            pending = list(self._commands)
            self._commands.clear()
        for fn in pending:  # e.g. a report_lost that raced with the end of serving
            try:
                fn()
            except Exception:
                log.exception("bootstrap master: internal command failed")
        bye = encode_message({"type": "shutdown"})
        for conn in list(self._conns.values()):
            if conn.rank is not None and not conn.closing and self._phase == "running":
                conn.out += bye
            try:  # best effort, bounded: these workers are reading their master link
                conn.sock.setblocking(True)
                conn.sock.settimeout(1.0)
                if conn.out:
                    conn.sock.sendall(conn.out)
            except OSError:
                pass
            self._close(conn)
        if self.exit_code is None:
            self.exit_code = 1 if ("lost" in self._status or self._phase == "failed") else 0
        self._admission.close()
        try:
            self._sel.unregister(self._waker)
        except (KeyError, ValueError):
            pass
        self._waker.close()
        self._sel.close()
        if self._phase != "failed":
            self._phase = "done"
        self._done.set()

    # ---------------------------------------------------------------- connections
    def _refused_early(self, peer: str, why: str) -> None:
        """A connection failed its handshake (handshake thread): remember it for the join report."""
        self._post_if_serving(lambda: self._note_refused(peer, "", why))

    def _admitted(self, sock: socket.socket, peer: str, hello: dict[str, Any]) -> None:
        """A connection proved the token (handshake thread): let the master's thread take it."""
        with self._lock:
            if self._serving:
                self._commands.append(lambda: self._on_join(sock, peer, hello))
                queued = True
            else:
                queued = False
        if queued:
            self._wake()
        else:
            sock.close()

    def _register(self, conn: _Conn) -> None:
        conn.sock.setblocking(False)
        self._conns[conn.sock] = conn
        self._sel.register(conn.sock, selectors.EVENT_READ, conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is not None:
            try:
                self._sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        try:
            conn.sock.close()
        except OSError:
            pass

    def _send_raw(self, conn: _Conn, frame: bytes) -> None:
        if conn.sock not in self._conns or conn.closing:
            return
        conn.out += frame
        if len(conn.out) > _MAX_OUTBUF:
            conn.out.clear()
            if conn.rank is not None and self._status[conn.rank] == "running":
                self._lose(conn.rank, "its master link is not draining")
            else:
                self._close(conn)
            return
        self._flush(conn)

    def _send(self, conn: _Conn, msg: dict[str, Any]) -> None:
        self._send_raw(conn, encode_message(msg))

    def _note_refused(self, peer: str, host: str, why: str) -> None:
        """Remember a connection refused while the job assembles, for the join-failure message."""
        if self._phase == "joining":
            self._roster.note_refused(peer, host, why)

    def _refuse(self, conn: _Conn, message: str, **extra: Any) -> None:
        """Send an ``error`` to a joining worker and close its connection once sent."""
        log.warning("bootstrap master: refusing worker from %s: %s", conn.peer, message)
        if self._phase == "joining":
            self._note_refused(conn.peer, str(conn.hello.get("host_id") or ""), message)
        if conn.sock not in self._conns:
            self._register(conn)
        self._send(conn, {"type": "error", "message": message, **extra})
        conn.closing = True
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.sock not in self._conns:
            return
        try:
            while conn.out:
                n = conn.sock.send(conn.out)
                del conn.out[:n]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as e:
            conn.out.clear()
            self._dropped(conn, f"connection failed: {e}")
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.out else 0)
        if conn.closing and not conn.out:
            self._close(conn)
            return
        self._sel.modify(conn.sock, events, conn)

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._dropped(conn, f"connection failed: {e}")
            return
        if not data:
            self._dropped(conn, "connection closed without a goodbye")
            return
        conn.last_rx = time.monotonic()
        try:
            messages = conn.frames.feed(data)
        except ProtocolError as e:
            self._dropped(conn, f"protocol error: {e}")
            return
        for msg in messages:
            if conn.sock not in self._conns:
                return
            self._on_message(conn, msg)

    def _dropped(self, conn: _Conn, reason: str) -> None:
        """A connection failed or closed: a joining worker frees its slot, a running one is lost."""
        was_open = conn.sock in self._conns
        self._close(conn)
        if conn in self._roster.joining:
            self._roster.joining.remove(conn)
            log.warning("bootstrap master: worker from %s left before the job started (%s)",
                        conn.peer, reason)
        elif conn.rank is not None and self._by_rank.get(conn.rank) is conn:
            self._lose(conn.rank, f"it gave up: {conn.gave_up}" if conn.gave_up else reason)
        elif was_open and not conn.closing:
            log.debug("bootstrap master: connection from %s closed: %s", conn.peer, reason)

    # ---------------------------------------------------------------- join
    def _on_join(self, sock: socket.socket, peer: str, hello: dict[str, Any]) -> None:
        conn = _Conn(sock, peer, hello)
        if self._phase == "failed":
            fail = dict(self._fail or {})
            self._refuse(conn, str(fail.pop("message", "the job failed to start")), **fail)
            return
        if self._phase != "joining":
            self._refuse(conn, f"the job already started with all {self.world} workers")
            return
        refusal = self._roster.refusal(hello)
        if refusal is not None:
            self._refuse(conn, refusal[0], **refusal[1])
            return
        rank = hello.get("rank")
        conn.rank = rank
        self._register(conn)
        self._roster.joining.append(conn)
        log.info("bootstrap master: worker from %s joined (rank %s, %d/%d)", peer,
                 "any" if rank is None else rank, len(self._roster.joining), self.world)
        if len(self._roster.joining) == self.world:
            self._start_job()

    def _start_job(self) -> None:
        ordered, table, self._places = self._roster.assign()
        now = time.monotonic()
        self._phase = "running"
        for conn in ordered:
            assert conn.rank is not None
            self._by_rank[conn.rank] = conn
            self._status[conn.rank] = "running"
            conn.last_rx = now
        self._roster.joining.clear()
        for conn in ordered:
            self._send(conn, {"type": "table", "rank": conn.rank, "world": self.world, "table": table})
        log.info("bootstrap master: all %d workers joined; table sent", self.world)

    def _fail_join(self, fail: dict[str, Any]) -> None:
        self._phase = "failed"
        self._failed_at = time.monotonic()
        self._fail = fail
        message = fail.pop("message", "the job failed to start")
        self._fail["message"] = message
        log.error("bootstrap master: %s", message)
        for conn in list(self._roster.joining):
            self._refuse(conn, message, **{k: v for k, v in fail.items() if k != "message"})
        self._roster.joining.clear()

    # ---------------------------------------------------------------- running
    def _on_message(self, conn: _Conn, msg: dict[str, Any]) -> None:
        if conn.rank is None or self._by_rank.get(conn.rank) is not conn:
            if conn in self._roster.joining and msg.get("type") == "hb":
                return
            log.warning("bootstrap master: unexpected message from %s before the job started: %r",
                        conn.peer, msg.get("type"))
            return
        rank = conn.rank
        if "service" in msg:
            self._send_replies(self._services.handle(msg["service"], rank, msg))
            return
        kind = msg.get("type")
        if kind == "hb":
            return
        if kind == "abort":     # the worker fails and is about to drop its link: remember why
            conn.gave_up = str(msg.get("reason", ""))[:MAX_REASON] or "no reason given"
            return
        if kind == "bye":
            log.info("bootstrap master: rank %d left cleanly", rank)
            self._status[rank] = "left"
            del self._by_rank[rank]
            conn.closing = True
            self._flush(conn)
            return
        log.warning("bootstrap master: unknown message type %r from rank %d", kind, rank)

    def _send_replies(self, replies: list[Reply]) -> None:
        """Send service replies to the running workers they are for."""
        for name, rank, msg in replies:
            conn = self._by_rank.get(rank)
            if conn is None:
                log.debug("bootstrap master: service %r reply to rank %r dropped (not connected)",
                          name, rank)
                continue
            try:
                self._send(conn, {**msg, "type": "service", "service": name})
            except (TypeError, ValueError) as e:
                log.error("bootstrap master: service %r reply to rank %d cannot be sent: %s",
                          name, rank, e)

    def _lose(self, rank: int, reason: str) -> None:
        """Declare ``rank`` lost once, and tell every other running worker."""
        if self._phase in ("joining", "failed"):
            if self._phase == "joining":
                for conn in list(self._roster.joining):
                    if conn.rank == rank:
                        self._roster.joining.remove(conn)
                        self._close(conn)
                self._status[rank] = "lost"
                self._fail_join({"message": f"rank {rank} was lost before the job started: {reason}",
                                 "rank": rank, "reason": reason})
            return
        if self._status[rank] in ("left", "lost"):
            return
        log.warning("bootstrap master: rank %d lost: %s: %s", rank, self._places[rank], reason)
        self._status[rank] = "lost"
        running = self._by_rank.pop(rank, None)
        if running is not None:
            self._close(running)
        # With where it ran (its host and the ranks on it): a survivor may hear of this loss first here.
        frame = encode_message({"type": "peer_lost", "rank": rank, "reason": reason, "place": self._places[rank]})
        for other in list(self._by_rank.values()):
            self._send_raw(other, frame)
        self._send_replies(self._services.on_lost(rank))


def install_job_services(master: Master) -> None:
    """Install the job-wide coordinator services (barriers, coflow coordinator, ...) on a fresh master.

    Calls :data:`SERVICES_ENTRY` (``module:function``, given the master) if that module exists; both
    ``twisternet run`` and ``twisternet master`` call this, so the services are wired in one place.
    """
    import importlib
    module_name, _, attr = SERVICES_ENTRY.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            log.debug("no %s module: the master runs without job services", module_name)
            return
        raise
    getattr(module, attr)(master)


#: ``module:function`` that adds the job-wide services to every bootstrap master.
SERVICES_ENTRY = "twisternet.services:install_on_master"
