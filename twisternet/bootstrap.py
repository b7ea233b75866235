"""Bootstrap: a master process gathers every worker's listen addresses into one table, then watches them.

Protocol on a master link (TCP). The worker connects and runs :func:`twisternet.auth.handshake` as
initiator; its authenticated hello is ``{"kind": "worker", "rank": r|None, "world": n|None,
"listen": {...}, "host_id": str, "pid": int}``; the master's is ``{"kind": "master", "world": n}``.
From then on both sides exchange length-prefixed msgpack maps (u32 length, at most
:data:`MAX_MESSAGE` bytes), each with a ``"type"``:

* master -> worker: ``table`` (rank, world, table: one entry per rank), ``error`` (join refused:
  ``message``, ``key`` naming the offending setting, or ``rank``/``reason`` of a lost peer, or
  ``timeout`` when the job did not assemble in time), ``hb``, ``peer_lost`` (rank, reason, place:
  ``rank R on HOST (ADDRESS; ranks on that host: ...)``), ``service`` (a
  reply from a master-side service), ``shutdown``.
* worker -> master: ``hb``, ``bye`` (clean leave), ``abort`` (reason: why this worker fails; its link
  drops next and the others hear of its loss with that reason), and service requests
  ``{"service": name, ...}``.

The master answers nobody until ``world`` workers have joined; then every worker receives the whole table
at once. Afterwards both sides send heartbeats; a worker whose connection drops without ``bye`` or that
stays silent past ``peer_timeout`` is announced to the others as ``peer_lost``. Ranks a worker asks for
are honoured (a second claim is refused); workers that ask for none fill the free ranks in arrival order
once the job is complete.

With a ``join_timeout``, a job that is not complete in time fails: every joined worker gets an ``error``
(with ``timeout``) saying how many joined, from which hosts, and which connections the master refused and
why (a wrong job token, a world mismatch, ...); the workers raise it as OperationTimeout, and the master
stops serving after ``fail_linger`` seconds with exit status 1.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import selectors
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import msgpack

from .auth import PeerClosedDuringHandshake, handshake
from .errors import (AuthError, ClosedError, ConfigError, OperationTimeout, PeerLostError,
                     ProtocolError, TwisternetError)
from .logthrottle import LogThrottle

__all__ = ["Master", "MasterSession", "join", "host_id", "parse_address", "local_address_for", "route_to_master",
           "rank_places",
           "install_job_services", "MAX_MESSAGE", "SERVICES_ENTRY"]

log = logging.getLogger(__name__)

#: Largest message (encoded bytes) accepted on a master link.
MAX_MESSAGE = 16 << 20
#: Bytes the master may queue for one worker that does not read before declaring it lost.
_MAX_OUTBUF = 64 << 20
#: Handshakes the master runs at once (one thread each); further connections are closed unread until
#: one finishes (a joining worker whose connection is closed that way retries).
MAX_PENDING_HANDSHAKES = 64
#: Longest reason (characters) a worker's ``abort`` message may give.
_MAX_REASON = 2000
#: Refused connections the join-failure message names at most (the latest ones).
_MAX_REFUSED = 8
#: Seconds the listener rests after ``accept`` failed (EMFILE, ENOBUFS, ...), doubling up to the
#: maximum while it keeps failing (retrying at once would spin on the still-readable listener).
_ACCEPT_BACKOFF_MIN = 0.05
_ACCEPT_BACKOFF_MAX = 1.0
_LEN = struct.Struct("!I")
#: Seconds (at most; a quarter of the join timeout if less) a joined worker waits past its own join
#: deadline for the master's verdict on why the job did not start.
_VERDICT_GRACE = 3.0

ServiceHandle = Callable[[int, dict], "list[tuple[int, dict]]"]
ServiceTick = Callable[[], "list[tuple[int, dict]]"]
ServiceDeadline = Callable[[], "float | None"]


# ------------------------------------------------------------------------------------------ helpers

def encode_message(msg: dict) -> bytes:
    """One frame of a master link: u32 length + msgpack map. Raises ValueError if too large."""
    if not isinstance(msg, dict):
        raise TypeError(f"a master-link message must be a dict, got {type(msg).__name__}")
    try:
        body = msgpack.packb(msg, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"message is not msgpack-serializable: {e}") from None
    if len(body) > MAX_MESSAGE:
        raise ValueError(f"message of {len(body)} bytes exceeds the master-link limit of {MAX_MESSAGE}")
    return _LEN.pack(len(body)) + body


class _FrameReader:
    """Reassembles length-prefixed msgpack maps from a byte stream."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict]:
        """Append received bytes; return the complete messages. ProtocolError on malformed input."""
        self._buf += data
        out: list[dict] = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_MESSAGE:
                raise ProtocolError(f"message of {n} bytes exceeds the master-link limit of {MAX_MESSAGE}")
            if len(self._buf) < _LEN.size + n:
                break
            body = bytes(self._buf[_LEN.size:_LEN.size + n])
            del self._buf[:_LEN.size + n]
            try:
                msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
            except Exception as e:  # msgpack raises several unrelated types on corrupt input
                raise ProtocolError(f"undecodable message on the master link: {e}") from None
            if not isinstance(msg, dict):
                raise ProtocolError(f"master-link message must be a map, got {type(msg).__name__}")
            out.append(msg)
        return out


def host_id() -> str:
    """A string naming this host *and* network namespace: hostname/boot_id/netns-inode.

    Two processes with equal host ids can reach each other over abstract Unix sockets.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "no-boot-id"
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "no-netns"
    return f"{socket.gethostname()}/{boot}/{netns}"


def parse_address(address: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` allowed) into (host, port); ValueError names the problem."""
    if not isinstance(address, str):
        raise ValueError(f"master address must be a string HOST:PORT, got {address!r}")
    host, sep, port = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"master address must be HOST:PORT, got {address!r}")
    return host, int(port)


def route_to_master(master: str, timeout: float) -> str:
    """:func:`local_address_for` ``master``, retried until ``timeout`` while there is no route yet.

    A link that is down (ENETUNREACH, EHOSTUNREACH) may come up while the job assembles; past
    ``timeout`` an OperationTimeout names the master and this host.
    """
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            return local_address_for(master)
        except OSError as e:
            if time.monotonic() + delay >= deadline:
                raise OperationTimeout(f"could not reach the bootstrap master at {master} from "
                                       f"{socket.gethostname()}: {e}", operation="bootstrap join",
                                       timeout=timeout) from None
            time.sleep(delay)
            delay = min(2 * delay, 0.5)


def local_address_for(master: str) -> str:
    """The local IP address this host uses to reach ``master`` (HOST:PORT); no packet is sent."""
    host, port = parse_address(master)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def _hostport(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _where(peer: str, hid: object) -> str:
    """``hostname (ADDRESS)`` of a peer ``ADDRESS:PORT`` whose host id (hostname/boot/netns) is ``hid``."""
    addr = peer.rpartition(":")[0] or peer
    name = hid.split("/", 1)[0] if isinstance(hid, str) and hid else ""
    return f"{name} ({addr})" if name else addr


def _rank_list(ranks: list[int]) -> str:
    """``0-7, 9, 10``: runs of three or more consecutive ranks as ranges."""
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{ranks[i]}-{ranks[j]}")
        else:
            out.extend(str(r) for r in ranks[i:j + 1])
        i = j + 1
    return ", ".join(out)


def rank_places(hosts: list[tuple[object, str]]) -> list[str]:
    """For each rank, given (host id, address) per rank: ``rank R on HOSTNAME (ADDRESS; ranks on that
    host: ...)``, what a loss report says to name the host and every rank on it (the list is left out
    when all ranks share one host)."""
    by_host: dict[object, list[int]] = {}
    for r, (hid, _) in enumerate(hosts):
        by_host.setdefault(hid, []).append(r)
    out = []
    for r, (hid, addr) in enumerate(hosts):
        name = hid.split("/", 1)[0] if isinstance(hid, str) and hid else ""
        inside = [addr] if name and addr else []
        if len(by_host) > 1:
            inside.append(f"ranks on that host: {_rank_list(by_host[hid])}")
        text = (name or addr or "an unknown host") + (f" ({'; '.join(inside)})" if inside else "")
        out.append(f"rank {r} on {text}")
    return out


def _check_token(token: bytes) -> bytes:
    if not isinstance(token, (bytes, bytearray)) or not token:
        raise TypeError("token must be non-empty bytes")
    return bytes(token)


# ------------------------------------------------------------------------------------------- master

class _Conn:
    """One authenticated worker connection, as the master sees it."""

    __slots__ = ("sock", "peer", "hello", "rank", "frames", "out", "last_rx", "closing", "joined_at",
                 "gave_up")

    def __init__(self, sock: socket.socket, peer: str, hello: dict) -> None:
        self.sock = sock
        self.peer = peer
        self.hello = hello
        self.rank: int | None = None
        self.frames = _FrameReader()
        self.out = bytearray()
        self.last_rx = time.monotonic()
        self.closing = False  # close once ``out`` is flushed
        self.joined_at = self.last_rx
        self.gave_up: str | None = None   # why the worker said it aborts, before its link drops


class _Service:
    __slots__ = ("name", "handle", "tick", "next_deadline")

    def __init__(self, name: str, handle: ServiceHandle, tick: ServiceTick | None,
                 next_deadline: ServiceDeadline | None) -> None:
        self.name = name
        self.handle = handle
        self.tick = tick
        self.next_deadline = next_deadline


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
        self._token = _check_token(token)
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
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()
        self._commands: collections.deque[Callable[[], None]] = collections.deque()
        self._services: dict[str, _Service] = {}
        self._lost_hooks: list[Callable[[int], Iterable[tuple[str, int, dict]]]] = []
        self._handshakes = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._accept_backoff = 0.0
        self._accept_resume: float | None = None   # while accept rests after an error: when it resumes
        self._noise = LogThrottle(log)
        #: Connections closed unread because MAX_PENDING_HANDSHAKES were already running.
        self.dropped_connections = 0
        self._conns: dict[socket.socket, _Conn] = {}
        self._joining: list[_Conn] = []          # authenticated, waiting for the table
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
        #: Connections refused before the job started (peer address, host name if known, why), newest
        #: last and at most :data:`_MAX_REFUSED`: the join-failure message names them.
        self._refused: list[tuple[str, str, str]] = []
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        self._serving = False
        self._shut = False
        self._done = threading.Event()
        self._started_at = time.monotonic()

    # ---------------------------------------------------------------- public API
    def start(self) -> "Master":
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
        svc = _Service(name, handle, tick, next_deadline)

        def install() -> None:
            if name in self._services:
                log.warning("service %r replaced", name)
            self._services[name] = svc
        self._post(install)

    def on_peer_lost(self, hook: Callable[[int], Iterable[tuple[str, int, dict]]]) -> None:
        """Call ``hook(rank)`` on the master's thread when a running worker is lost; it returns
        ``(service, rank, msg)`` replies to send (as :meth:`add_service` replies are), e.g. a barrier
        released without the lost rank."""
        self._post(lambda: self._lost_hooks.append(hook))

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
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already pending, or closed

    # ---------------------------------------------------------------- loop
    def _loop(self) -> None:
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
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
                for svc in list(self._services.values()):
                    d = self._service_deadline(svc)
                    if d is not None:
                        timeout = min(timeout, max(0.0, d - now))
            if self._phase == "joining" and self.join_timeout is not None:
                timeout = min(timeout, max(0.0, self._started_at + self.join_timeout - now))
            if self._phase == "failed":
                timeout = min(timeout, max(0.0, self._failed_at + self._fail_linger - now))
            if self._accept_resume is not None:
                if now >= self._accept_resume:
                    self._accept_resume = None
                    self._sel.register(self._listener, selectors.EVENT_READ, "listen")
                else:
                    timeout = min(timeout, self._accept_resume - now)
            for key, mask in self._sel.select(timeout):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
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
                for svc in list(self._services.values()):
                    d = self._service_deadline(svc)
                    if d is not None and d <= now:
                        self._call_service(svc, lambda s=svc: s.tick())  # type: ignore[misc]
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
                self._fail_join({"message": self._join_timeout_message(), "timeout": self.join_timeout})

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
        self._accept_resume = None
        for s in (self._listener, self._wake_r, self._wake_w):
            try:
                self._sel.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
        self._sel.close()
        if self._phase != "failed":
            self._phase = "done"
        self._done.set()

    # ---------------------------------------------------------------- connections
    def _accept(self) -> None:
        for _ in range(64):     # a bounded batch per round: running workers have messages too
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._pause_accept(e)
                return
            self._accept_backoff = 0.0
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            if not self._handshakes.acquire(blocking=False):
                self.dropped_connections += 1
                self._noise.warning("busy", "bootstrap master: closed the connection from %s unread "
                                    "(%d handshakes already running)", peer, MAX_PENDING_HANDSHAKES)
                sock.close()
                continue
            sock.setblocking(True)
            try:
                threading.Thread(target=self._authenticate, args=(sock, peer), daemon=True,
                                 name="twisternet-master-handshake").start()
            except RuntimeError as e:   # cannot start a thread (resource limit)
                self._handshakes.release()
                sock.close()
                self._pause_accept(e)
                return

    def _pause_accept(self, error: BaseException) -> None:
        """``accept`` failed: stop watching the listener for a while, backing off while it fails."""
        self._accept_backoff = min(_ACCEPT_BACKOFF_MAX, max(_ACCEPT_BACKOFF_MIN, 2 * self._accept_backoff))
        self._noise.warning("accept", "bootstrap master: accept failed (%s); not accepting for %.2fs",
                            error, self._accept_backoff)
        if self._accept_resume is None:
            try:
                self._sel.unregister(self._listener)
            except (KeyError, ValueError):
                pass
        self._accept_resume = time.monotonic() + self._accept_backoff

    def _authenticate(self, sock: socket.socket, peer: str) -> None:
        """Runs in a short-lived thread per connection, bounded by handshake_timeout."""
        try:
            hello = handshake(sock, self._token, initiator=False, timeout=self.handshake_timeout,
                              hello={"kind": "master", "world": self.world})
        except (AuthError, ProtocolError) as e:
            self._noise.warning("rejected", "bootstrap master: rejected connection from %s: %s", peer, e)
            sock.close()
            if not isinstance(e, PeerClosedDuringHandshake):   # a worker retries those
                why = "wrong job token" if isinstance(e, AuthError) and "token" in str(e) else str(e)
                self._post_if_serving(lambda: self._note_refused(peer, "", why))
            return
        except Exception:
            log.exception("bootstrap master: handshake with %s failed", peer)
            sock.close()
            return
        finally:
            self._handshakes.release()
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

    def _send(self, conn: _Conn, msg: dict) -> None:
        self._send_raw(conn, encode_message(msg))

    def _note_refused(self, peer: str, host: str, why: str) -> None:
        """Remember a connection refused while the job assembles, for the join-failure message."""
        if self._phase != "joining":
            return
        self._refused.append((peer, host, why))
        del self._refused[:-_MAX_REFUSED]

    def _join_timeout_message(self) -> str:
        """Why the job did not start in time: who joined (from which hosts) and who was refused."""
        joined: dict[str, int] = {}
        for c in self._joining:
            where = _where(c.peer, c.hello.get("host_id"))
            joined[where] = joined.get(where, 0) + 1
        text = (f"only {len(self._joining)} of {self.world} workers joined the master at "
                f"{_hostport(self.address)} within {self.join_timeout:g}s")
        if joined:
            text += " (joined: " + ", ".join(f"{n} from {w}" for w, n in sorted(joined.items())) + ")"
        if self._refused:
            text += "; refused: " + "; ".join(f"{_where(p, h)}: {why}" for p, h, why in self._refused)
        else:
            text += "; no other worker reached it"
        return text

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
        if conn in self._joining:
            self._joining.remove(conn)
            log.warning("bootstrap master: worker from %s left before the job started (%s)",
                        conn.peer, reason)
        elif conn.rank is not None and self._by_rank.get(conn.rank) is conn:
            self._lose(conn.rank, f"it gave up: {conn.gave_up}" if conn.gave_up else reason)
        elif was_open and not conn.closing:
            log.debug("bootstrap master: connection from %s closed: %s", conn.peer, reason)

    # ---------------------------------------------------------------- join
    def _on_join(self, sock: socket.socket, peer: str, hello: dict) -> None:
        conn = _Conn(sock, peer, hello)
        if self._phase == "failed":
            fail = dict(self._fail or {})
            self._refuse(conn, str(fail.pop("message", "the job failed to start")), **fail)
            return
        if self._phase != "joining":
            self._refuse(conn, f"the job already started with all {self.world} workers")
            return
        if hello.get("kind") != "worker":
            self._refuse(conn, f"expected a worker hello, got kind {hello.get('kind')!r}")
            return
        world, rank, listen, hid = (hello.get("world"), hello.get("rank"), hello.get("listen"),
                                    hello.get("host_id"))
        if world is not None and world != self.world:
            self._refuse(conn, f"worker expects world={world!r} but the master runs world={self.world}",
                         key="world")
            return
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
                self._refuse(conn, f"requested rank {rank!r} is not in [0, {self.world})", key="rank")
                return
            holder = next((c for c in self._joining if c.rank == rank), None)
            if holder is not None:
                self._refuse(conn, f"rank {rank} is already taken by the worker from {holder.peer} "
                                   f"(pid {holder.hello.get('pid')})", key="rank")
                return
        if not isinstance(listen, dict):
            self._refuse(conn, "worker hello lacks a 'listen' map")
            return
        if not isinstance(hid, str):
            self._refuse(conn, "worker hello lacks a 'host_id' string")
            return
        if len(self._joining) >= self.world:  # defensive: the table goes out as soon as it is full
            self._refuse(conn, f"the job is full ({self.world} workers)")
            return
        conn.rank = rank
        self._register(conn)
        self._joining.append(conn)
        log.info("bootstrap master: worker from %s joined (rank %s, %d/%d)", peer,
                 "any" if rank is None else rank, len(self._joining), self.world)
        if len(self._joining) == self.world:
            self._start_job()

    def _start_job(self) -> None:
        from .topology import number_workers
        number_workers(self._joining, self.world)   # host-contiguous, deterministic (twisternet.topology)
        ordered = sorted(self._joining, key=lambda c: c.rank)  # type: ignore[arg-type,return-value]
        table = []
        for conn in ordered:
            entry = dict(conn.hello["listen"])
            if "host_id" in entry:
                log.warning("bootstrap master: rank %d's listen map has a 'host_id' key; replaced",
                            conn.rank)
            entry["host_id"] = conn.hello["host_id"]
            table.append(entry)
        self._places = rank_places([(c.hello.get("host_id"), c.peer.rpartition(":")[0] or c.peer)
                                    for c in ordered])
        now = time.monotonic()
        self._phase = "running"
        for conn in ordered:
            assert conn.rank is not None
            self._by_rank[conn.rank] = conn
            self._status[conn.rank] = "running"
            conn.last_rx = now
        self._joining = []
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
        for conn in list(self._joining):
            self._refuse(conn, message, **{k: v for k, v in fail.items() if k != "message"})
        self._joining = []

    # ---------------------------------------------------------------- running
    def _on_message(self, conn: _Conn, msg: dict) -> None:
        if conn.rank is None or self._by_rank.get(conn.rank) is not conn:
            if conn in self._joining and msg.get("type") == "hb":
                return
            log.warning("bootstrap master: unexpected message from %s before the job started: %r",
                        conn.peer, msg.get("type"))
            return
        rank = conn.rank
        if "service" in msg:
            name = msg["service"]
            svc = self._services.get(name) if isinstance(name, str) else None
            if svc is None:
                self._send(conn, {"type": "service", "service": name,
                                  "error": f"no service named {name!r} on the master"})
                return
            self._call_service(svc, lambda: svc.handle(rank, msg), src=rank)
            return
        kind = msg.get("type")
        if kind == "hb":
            return
        if kind == "abort":     # the worker fails and is about to drop its link: remember why
            conn.gave_up = str(msg.get("reason", ""))[:_MAX_REASON] or "no reason given"
            return
        if kind == "bye":
            log.info("bootstrap master: rank %d left cleanly", rank)
            self._status[rank] = "left"
            del self._by_rank[rank]
            conn.closing = True
            self._flush(conn)
            return
        log.warning("bootstrap master: unknown message type %r from rank %d", kind, rank)

    def _service_deadline(self, svc: _Service) -> float | None:
        if svc.next_deadline is None:
            return None
        try:
            return svc.next_deadline()
        except Exception:
            log.exception("bootstrap master: service %r next_deadline() failed", svc.name)
            return None

    def _call_service(self, svc: _Service, call: Callable[[], Iterable[tuple[int, dict]]],
                      src: int | None = None) -> None:
        try:
            replies = list(call() or ())
        except Exception as e:
            log.exception("bootstrap master: service %r failed", svc.name)
            if src is not None and src in self._by_rank:
                self._send(self._by_rank[src], {"type": "service", "service": svc.name,
                                                "error": f"{type(e).__name__}: {e}"})
            return
        for item in replies:
            try:
                rank, msg = item
            except (TypeError, ValueError):
                log.error("bootstrap master: service %r returned %r, not a (rank, dict) pair",
                          svc.name, item)
                continue
            if not isinstance(msg, dict) or msg.get("type", "service") != "service":
                log.error("bootstrap master: service %r reply %r is not a dict without a 'type' key; "
                          "dropped", svc.name, msg)
                continue
            conn = self._by_rank.get(rank)
            if conn is None:
                log.debug("bootstrap master: service %r reply to rank %r dropped (not connected)",
                          svc.name, rank)
                continue
            try:
                self._send(conn, {**msg, "type": "service", "service": svc.name})
            except (TypeError, ValueError) as e:
                log.error("bootstrap master: service %r reply to rank %d cannot be sent: %s",
                          svc.name, rank, e)

    def _lose(self, rank: int, reason: str) -> None:
        """Declare ``rank`` lost once, and tell every other running worker."""
        if self._phase in ("joining", "failed"):
            if self._phase == "joining":
                for conn in list(self._joining):
                    if conn.rank == rank:
                        self._joining.remove(conn)
                        self._close(conn)
                self._status[rank] = "lost"
                self._fail_join({"message": f"rank {rank} was lost before the job started: {reason}",
                                 "rank": rank, "reason": reason})
            return
        if self._status[rank] in ("left", "lost"):
            return
        log.warning("bootstrap master: rank %d lost: %s: %s", rank, self._places[rank], reason)
        self._status[rank] = "lost"
        conn = self._by_rank.pop(rank, None)
        if conn is not None:
            self._close(conn)
        # With where it ran (its host and the ranks on it): a survivor may hear of this loss first here.
        frame = encode_message({"type": "peer_lost", "rank": rank, "reason": reason, "place": self._places[rank]})
        for other in list(self._by_rank.values()):
            self._send_raw(other, frame)
        for hook in list(self._lost_hooks):
            try:
                replies = list(hook(rank) or ())
            except Exception:
                log.exception("bootstrap master: peer-lost hook failed for rank %d", rank)
                continue
            for name, to, msg in replies:
                conn = self._by_rank.get(to)
                if conn is not None and isinstance(msg, dict):
                    self._send(conn, {**msg, "type": "service", "service": name})


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


# ------------------------------------------------------------------------------------------- worker

class MasterSession:
    """A worker's live link to the bootstrap master (returned by :func:`join`).

    Holds the rank, world and address table, exchanges heartbeats on a daemon thread, and reports
    master events (``peer_lost``, ``service`` replies, ``master_lost``) to :meth:`on_event` callbacks.
    """

    def __init__(self, sock: socket.socket, frames: _FrameReader, rank: int, world: int,
                 table: list[dict], master: str, *, heartbeat_interval: float,
                 peer_timeout: float, pending: Iterable[dict] = ()) -> None:
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
        self._callbacks: list[Callable[[dict], None]] = []
        self._backlog: list[dict] = []
        self._closing = False
        self._broken = False
        self._shutdown_seen = False
        self._stop = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self._last_rx = time.monotonic()
        sock.setblocking(True)
        sock.settimeout(peer_timeout)  # bounds a sendall to a master that stopped reading
        for msg in pending:  # arrived in the same read as the table
            self._dispatch(msg)
        self._thread = threading.Thread(target=self._run, name=f"twisternet-master-link-{rank}",
                                        daemon=True)
        self._thread.start()

    def on_event(self, callback: Callable[[dict], None]) -> None:
        """Call ``callback(event)`` (on the link thread) for every master event; events that arrived
        before the first callback was registered are delivered to it at once."""
        with self._cb_lock:
            self._callbacks.append(callback)
            backlog, self._backlog = self._backlog, []
        for event in backlog:
            self._call(callback, event)

    def send(self, msg: dict) -> None:
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
                self._wakeup()
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
        self._wakeup()
        self._thread.join(timeout=2.0)
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    def abort(self, reason: str) -> None:
        """Leave *without* ``bye``, telling the master why first: it reports this rank lost to the others
        with ``reason`` (e.g. the peer loss that made this rank fail), so theirs name the first cause."""
        with self._send_lock:
            if self._closing:
                return
            self._closing = True
            if not self._broken:
                try:
                    self._sock.settimeout(1.0)   # best effort: a master that does not read must not hold us
                    self._sock.sendall(encode_message({"type": "abort", "reason": str(reason)[:_MAX_REASON]}))
                except OSError:
                    pass
            self._broken = True
        self._stop = True
        self._wakeup()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
        for s in (self._sock, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> "MasterSession":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- link thread
    def _wakeup(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def _emit(self, event: dict) -> None:
        with self._cb_lock:
            callbacks = list(self._callbacks)
            if not callbacks:
                self._backlog.append(event)
                return
        for cb in callbacks:
            self._call(cb, event)

    @staticmethod
    def _call(cb: Callable[[dict], None], event: dict) -> None:
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
                ready, _, _ = select.select([self._sock, self._wake_r], [], [], wait)
            except (OSError, ValueError):
                return "the master link was closed"
            if self._wake_r in ready:
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
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

    def _dispatch(self, msg: dict) -> None:
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


def join(master: str, token: bytes, *, listen: dict, rank: int | None = None, world: int | None = None,
         timeout: float = 60.0, handshake_timeout: float = 5.0,
         heartbeat_interval: float = 1.0, peer_timeout: float = 15.0) -> MasterSession:
    """Join the job run by the bootstrap master at ``master`` (HOST:PORT); return the live session.

    Retries connecting until ``timeout``, proves the token, sends ``listen`` (this worker's addresses)
    and waits until every worker joined. Raises ConfigError (rank taken or out of range, world
    mismatch), PeerLostError (a worker died before the job started), AuthError/ProtocolError (failed
    handshake), OperationTimeout (the master could not be reached, or the job did not start within
    ``timeout``: then with the master's account of who joined and who was refused, if it gave one).
    """
    token = _check_token(token)
    host, port = parse_address(master)
    if not isinstance(listen, dict):
        raise TypeError(f"listen must be a dict, got {type(listen).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ConfigError("rank", f"must be an integer >= 0, got {rank!r}")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        raise ConfigError("world", f"must be an integer >= 1, got {world!r}")
    if rank is not None and world is not None and rank >= world:
        raise ConfigError("rank", f"must be in [0, {world}), got {rank}")
    if not 0 < heartbeat_interval < peer_timeout:
        raise ConfigError("heartbeat_interval", "must be > 0 and smaller than peer_timeout")
    hello = {"kind": "worker", "rank": rank, "world": world, "listen": listen, "host_id": host_id(),
             "pid": os.getpid()}
    deadline = time.monotonic() + timeout
    delay = 0.05
    last_error: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise OperationTimeout(f"could not reach the bootstrap master at {master} from "
                                   f"{socket.gethostname()} ({last_error})",
                                   operation="bootstrap join", timeout=timeout)
        try:
            sock = socket.create_connection((host, port), timeout=min(remaining, 5.0))
        except OSError as e:
            last_error = e
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = handshake(sock, token, initiator=True, hello=hello,
                             timeout=max(0.001, min(handshake_timeout, deadline - time.monotonic())))
            break
        except PeerClosedDuringHandshake as e:
            # a busy master closes connections beyond its handshake limit unread: try again
            sock.close()
            last_error = e
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
        except BaseException:
            sock.close()
            raise
    try:
        if peer.get("kind") != "master":
            raise ProtocolError(f"{master} is not a bootstrap master (hello kind {peer.get('kind')!r})")
        frames = _FrameReader()
        # Past our own deadline, wait a little longer for the master's verdict: it times the join out
        # at about the same moment and says why (who joined, who was refused), which we would miss.
        grace = min(_VERDICT_GRACE, 0.25 * timeout)
        while True:
            batch = _recv_messages(sock, frames, deadline + grace, master, timeout)
            for i, msg in enumerate(batch):
                kind = msg.get("type")
                if kind == "table":
                    return _make_session(sock, frames, msg, master, world, heartbeat_interval,
                                         peer_timeout, batch[i + 1:])
                if kind == "error":
                    raise _join_error(msg)
                if kind not in ("hb",):
                    log.debug("join: ignoring %r before the table", kind)
    except BaseException:
        sock.close()
        raise


def _recv_messages(sock: socket.socket, frames: _FrameReader, deadline: float, master: str,
                   timeout: float) -> list[dict]:
    remaining = deadline - time.monotonic()
    silent = (f"the job did not start: not every worker joined the master at {master}, and it did not "
              f"say why (this worker: {socket.gethostname()})")
    if remaining <= 0:
        raise OperationTimeout(silent, operation="bootstrap join", timeout=timeout)
    sock.settimeout(remaining)
    try:
        data = sock.recv(1 << 16)
    except (socket.timeout, TimeoutError):
        raise OperationTimeout(silent, operation="bootstrap join", timeout=timeout) from None
    except OSError as e:
        raise TwisternetError(f"connection to the bootstrap master at {master} failed: {e}") from None
    if not data:
        raise TwisternetError(f"the bootstrap master at {master} closed the connection before the job "
                              "started")
    return frames.feed(data)


def _join_error(msg: dict) -> TwisternetError:
    message = str(msg.get("message", "join refused"))
    if isinstance(msg.get("timeout"), (int, float)) and not isinstance(msg.get("timeout"), bool):
        return OperationTimeout(f"the job did not start: {message}", operation="bootstrap join",
                                timeout=float(msg["timeout"]))
    if msg.get("key") in ("rank", "world"):
        return ConfigError(msg["key"], f"refused by the bootstrap master: {message}")
    if isinstance(msg.get("rank"), int):
        return PeerLostError(msg["rank"], str(msg.get("reason", message)))
    return TwisternetError(f"the bootstrap master refused this worker: {message}")


def _make_session(sock: socket.socket, frames: _FrameReader, msg: dict, master: str,
                  world: int | None, heartbeat_interval: float, peer_timeout: float,
                  pending: list[dict]) -> MasterSession:
    rank, n, table = msg.get("rank"), msg.get("world"), msg.get("table")
    if not isinstance(rank, int) or not isinstance(n, int) or not isinstance(table, list) \
            or len(table) != n or not 0 <= rank < n or not all(isinstance(e, dict) for e in table):
        raise ProtocolError(f"malformed table from the bootstrap master: {msg!r:.200}")
    if world is not None and n != world:
        raise ConfigError("world", f"the master runs world={n}, this worker expects {world}")
    session = MasterSession(sock, frames, rank, n, table, master, heartbeat_interval=heartbeat_interval,
                            peer_timeout=peer_timeout, pending=pending)
    log.info("joined the job as rank %d of %d", rank, n)
    return session
