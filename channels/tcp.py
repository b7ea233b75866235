"""TCP channel: a full mesh of non-blocking sockets (Unix-domain between peers on one host).

Every connection, to the master and between peers, first passes the job-token challenge
(:func:`twisternet.auth.handshake`). Afterwards frames flow both ways::

    u8 type | u32 edge | u64 length | payload (length bytes)

``DATA`` frames carry one message; ``CREDIT`` frames return ``length`` bytes of credit for ``edge``
(no payload); ``HEARTBEAT`` keeps idle links alive; ``BYE`` says the sender leaves cleanly; ``ABORT``
says it fails, with why (UTF-8 payload), just before it drops its links. Sends are
scatter-gather (``sendmsg``), so large messages go from the caller's memory to the kernel without a
copy; large incoming payloads are received straight into a buffer of their own.

A peer whose connection breaks without a ``BYE``, or that stays silent for ``peer_timeout`` seconds,
is reported lost; so is one the bootstrap master reports lost. The reason names the rank, its host
(hostname and address, from the bootstrap table) and the ranks on that host, and for a peer that failed
(ABORT) what made it fail, e.g. the loss of a rank on another host. Connections that fail the challenge
(garbage, a wrong token, or silence past ``handshake_timeout``) are dropped and logged; the job goes on.
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import selectors
import socket
import struct
import sys
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

from twisternet.auth import handshake
from twisternet.channel import Buffer, Channel, ChannelHandler, fits_credit
from twisternet.config import Config
from twisternet.errors import AuthError, ConfigError, OperationTimeout, ProtocolError
from twisternet.logthrottle import LogThrottle

log = logging.getLogger(__name__)

_HDR = struct.Struct("<BIQ")
HEADER_SIZE = _HDR.size
DATA, CREDIT, HEARTBEAT, BYE, ABORT = 1, 2, 3, 4, 5
#: Longest reason (encoded bytes) an ABORT frame carries.
_MAX_ABORT_REASON = 4096
#: Longest (seconds) abort() spends handing its ABORT frame to peers that are still answering.
_ABORT_FLUSH = 1.0
_STAGING = 256 << 10
#: Longest a released byte of credit waits to be returned with others (see _send_credit_returns).
_CREDIT_DELAY = 1e-3
_MAX_IOV = 512
#: While a large payload is being written or read, how long (seconds, per progress call) the channel
#: waits for that socket alone instead of going back through the engine for every chunk the socket
#: takes: a chunk is ~0.1 ms of copying at loopback speed, the round through the engine ~30 us of
#: Python. Other peers wait at most this long.
_BULK_WAIT = 1e-3
#: A queue holding at least this many bytes counts as a large payload being written.
_BULK_BYTES = 1 << 20
_MAX_FRAME = 1 << 48
#: Connections to a listening port that may be in their handshake at once (one thread each). Once the
#: mesh is built nobody may connect any more, so more than this are closed at once, unread.
MAX_PENDING_HANDSHAKES = 16
#: Seconds a listener rests after ``accept`` failed (EMFILE at the descriptor limit, ENOBUFS, ...),
#: doubling up to the maximum while it keeps failing: the connection stays in the kernel's queue and
#: the listener stays readable, so retrying at once spins a core and writes a log line per round.
_ACCEPT_BACKOFF_MIN = 0.05
_ACCEPT_BACKOFF_MAX = 1.0


class _RecvBuffers:
    """Reuses large receive buffers once nothing outside this cache refers to them any more.

    A message's memory is handed over to the core (views of it may live on as numpy arrays), so a
    buffer is reused only when its reference count shows that the cache alone holds it. Fresh large
    buffers cost page faults on first touch, about as much time as receiving into them.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bufs: list[bytearray] = []
        self.total = 0

    def get(self, n: int) -> memoryview:
        bufs = self.bufs
        for i in range(len(bufs)):
            b = bufs[i]
            # references: the list slot, the local name b, getrefcount's argument
            if n <= len(b) <= 2 * n and sys.getrefcount(b) <= 3:
                return memoryview(b)[:n]
        fresh = bytearray(n)
        if n <= self.limit:
            # evict idle buffers until the new one fits
            i = 0
            while self.total + n > self.limit and i < len(bufs):
                if sys.getrefcount(bufs[i]) <= 2:
                    self.total -= len(bufs[i])
                    del bufs[i]
                else:
                    i += 1
            if self.total + n <= self.limit:
                bufs.append(fresh)
                self.total += n
        return memoryview(fresh)


_IN, _OUT = select.POLLIN, select.POLLOUT      # the same bits as EPOLLIN and EPOLLOUT
_GONE = object()
_READABLE = _IN | select.POLLHUP | select.POLLERR  # a hang-up or error is found out by reading


class _Poller:
    """epoll (poll where there is none) over descriptors with an object each. Unlike ``selectors``,
    a descriptor can be muted (registered with no events) and unmuted with one system call and no
    bookkeeping, which a sending thread does per message (see TCPChannel.push). A muted descriptor
    still reports a hang-up or an error."""

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
        get = self._objs.get    # another thread may unregister meanwhile (wait() runs unlocked)
        return [(obj, ev) for obj, ev in ((get(fd, _GONE), ev) for fd, ev in ready) if obj is not _GONE]

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
        self._objs.clear()


class _Peer:
    """One connection's state."""

    __slots__ = ("rank", "sock", "fd", "wq", "wq_bytes", "tokens", "rbuf", "rlen", "cur", "cur_pos",
                 "cur_hdr", "last_recv", "last_send", "left", "lost", "want_write", "kind", "pushing",
                 "header_next", "polls")

    def __init__(self, rank: int, sock: socket.socket, kind: str) -> None:
        self.rank = rank
        self.sock = sock
        self.fd = sock.fileno()
        self.kind = kind
        self.wq: deque[memoryview] = deque()       # flattened buffers to write
        self.wq_bytes = 0
        self.tokens: deque[tuple[int, object]] = deque()  # (bytes remaining before token done, token)
        self.rbuf = bytearray(_STAGING)
        self.rlen = 0
        self.cur: memoryview | None = None           # payload being received directly
        self.cur_pos = 0
        self.cur_hdr: tuple[int, int, int] | None = None
        # After a large payload, read the next frame header alone: if another large payload follows,
        # it is then received straight into its own buffer instead of partly into staging and copied.
        self.header_next = False
        now = time.monotonic()
        self.last_recv = now
        self.last_send = now
        self.left = False
        self.lost = False
        self.want_write = False
        self.pushing = False     # a sending thread reads and writes it itself (TCPChannel.push)
        self.polls: dict[int, Any] = {}   # events -> a poll object over this socket alone (_sock_poll)

    @property
    def closed(self) -> bool:
        """Whether our socket to this peer is closed (after its goodbye and hang-up, or a failure)."""
        return self.sock.fileno() < 0


class TCPChannel(Channel):
    """The TCP/Unix-socket transport. Build it with :func:`create_channel`."""

    name = "tcp"

    def __init__(self, rank: int, world: int, config: Config, peers: dict[int, _Peer],
                 listeners: list[socket.socket], token: bytes, session: Any = None) -> None:
        super().__init__(rank, world, config)
        self.credit = config.buffer_size * config.buffer_count
        self._peers = peers
        self._listeners = listeners
        self._token = token
        self.session = session
        self._handler: ChannelHandler | None = None
        self._inflight: dict[tuple[int, int], int] = {}
        self._returns: deque[tuple[int, int, int]] = deque()   # (peer, edge, nbytes) from release()
        self._owed: dict[tuple[int, int], int] = {}             # released bytes not yet returned
        self._owed_since = float("inf")                         # when the oldest of them was released
        self._events: deque[dict] = deque()                     # from the master session
        self._poller = _Poller()
        self._closed_sel = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._woken = False
        self._poller.register(self._wake_r.fileno(), _IN, None)
        for ls in listeners:
            ls.setblocking(False)
            self._poller.register(ls.fileno(), _IN, ls)
        for p in peers.values():
            p.sock.setblocking(False)
            self._poller.register(p.fd, _IN, p)
        # Idle large buffers kept for reuse are bounded by twice the memory limit (512 MiB by default).
        self._recv_buffers = _RecvBuffers(max(4 * self.credit, 2 * config.memory_limit))
        # Late connections (after the mesh): bounded handshakes, accept backoff, rate-limited logs.
        self._vetting = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._accept_backoff = 0.0
        self._accept_paused: dict[int, tuple[socket.socket, float]] = {}   # fd -> (listener, resume at)
        self._noise = LogThrottle(log)
        #: Late connections closed unread because MAX_PENDING_HANDSHAKES were already running.
        self.dropped_connections = 0
        #: Per rank: "rank R on HOST (ADDRESS; ranks on that host: ...)", for loss reports.
        self._places = _places(world, getattr(session, "table", None))
        if session is not None:
            session.on_event(self._on_session_event)

    # ------------------------------------------------------------------------------ interface
    def start(self, handler: ChannelHandler) -> None:
        self._handler = handler

    def send(self, peer: int, edge: int, parts: Sequence[Buffer], token: object = None) -> bool:
        p = self._peers.get(peer)
        if p is None:
            raise ValueError(f"rank {self.rank}: no peer {peer} (world {self.world})")
        views = []
        n = 0
        for part in parts:
            mv = memoryview(part)
            if mv.format != "B" or mv.ndim != 1:
                mv = mv.cast("B")
            if mv.nbytes:
                views.append(mv)
                n += mv.nbytes
        key = (peer, edge)
        inflight = self._inflight.get(key, 0)
        if not fits_credit(inflight, n, self.credit):
            return False
        if p.lost or p.left:
            # Nothing can reach it any more; tell the core (once) instead of queueing forever.
            if not p.lost:
                p.lost = True
                self._report_lost(p, "send to a rank that has left the job")
            if token is not None and self._handler is not None:
                self._handler.on_sent(token)
            return True
        self._inflight[key] = inflight + n
        self._enqueue(p, _HDR.pack(DATA, edge, n), views, token)
        return True

    def progress(self, timeout: float = 0.0) -> bool:
        did = self._flush_writes()
        did = self._send_credit_returns() or did
        if did:
            timeout = 0.0
        if self._accept_paused:
            timeout = self._resume_accept(timeout)
        events = self._poller.poll(self._credit_wait(timeout) if timeout > 0 else 0.0)
        for obj, mask in events:
            if obj is None:
                self._drain_wakeup()
                continue
            if type(obj) is not _Peer:
                self._accept(obj)
                continue
            p: _Peer = obj
            if mask & _READABLE and not p.lost:
                did = self._read(p) or did
            if mask & _OUT and not p.lost:
                did = self._write(p) or did
        did = self._send_credit_returns() or did
        did = self._flush_writes() or did
        did = self._session_events() or did
        self._heartbeats()
        return did or bool(events)

    can_wait_unlocked = True

    def wait(self, timeout: float) -> None:
        # epoll may be waited on by one thread while another registers, reads and writes: this only
        # rings the bell (level-triggered), and progress() then finds out what happened.
        if timeout > 0 and not self._closed_sel:
            try:
                self._poller.poll(self._credit_wait(timeout))
            except (OSError, ValueError):   # closed under us: the engine is stopping
                pass

    can_push = True

    def push(self, peer: int) -> bool:
        p = self._peers.get(peer)
        if p is None or p.lost or p.closed:
            return True
        if not p.pushing:
            # The pushing thread reads and writes this peer itself until it is done: the engine stops
            # watching the socket (it still hears of a hang-up), or it would wake for every CREDIT
            # frame the peer sends meanwhile and take the engine from the pusher between two messages.
            p.pushing = True
            self._poller.modify(p.fd, 0)
        if p.wq:
            self._write(p)
        if not p.lost and not p.closed and self._sock_poll(p, _IN, 0.0):
            self._read(p, wait=False)
        if not p.wq or p.lost or p.closed:
            self._end_push(p)
            return True
        return False

    def end_push(self, peer: int) -> None:
        p = self._peers.get(peer)
        if p is not None and p.pushing:
            self._end_push(p)

    def _end_push(self, p: _Peer) -> None:
        p.pushing = False
        if p.lost or p.closed:
            return
        p.want_write = bool(p.wq)     # the engine writes what is left and reads what comes
        self._poller.modify(p.fd, _IN | (_OUT if p.want_write else 0))

    def wait_writable(self, peer: int, timeout: float) -> None:
        p = self._peers.get(peer)
        if p is None or p.lost or p.closed or timeout <= 0:
            return
        # what the peer sends is the pusher's to read too; closed under us: found out on the next push
        self._sock_poll(p, _OUT | _IN, timeout)

    def _sock_poll(self, p: _Peer, events: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``events`` on ``p``'s socket alone; True if they came."""
        po = p.polls.get(events)
        if po is None:
            po = p.polls[events] = select.poll()
            po.register(p.fd, events)
        try:
            return bool(po.poll(timeout * 1000.0))
        except (OSError, ValueError):
            return False

    def _bulk_wait(self, p: _Peer, events: int, until: float) -> float:
        """Wait on ``p``'s socket alone for ``events`` (more of a large payload, or room for one) until
        ``until`` (0: ``_BULK_WAIT`` from now). The deadline to keep, or 0.0 once nothing came in time."""
        now = time.monotonic()
        until = until or now + _BULK_WAIT
        return until if now < until and self._sock_poll(p, events, until - now) else 0.0

    def wakeup(self) -> None:
        if self._woken:
            return
        self._woken = True
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass

    def has_pending(self, peer: int | None = None) -> bool:
        if peer is not None:
            p = self._peers.get(peer)
            return bool(p and p.wq and not p.lost)
        return any(p.wq and not p.lost for p in self._peers.values())

    def pending_bytes(self, peer: int) -> int:
        """Bytes queued for ``peer`` and not yet written to its socket (the coflow scheduler keeps this
        small so that its own priority-ordered queues hold the backlog)."""
        p = self._peers.get(peer)
        return p.wq_bytes if p is not None and not p.lost else 0

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self._peers.values():
            if not p.lost and not p.closed:
                self._enqueue(p, _HDR.pack(BYE, 0, 0), [], None)
        # Flush everything (our BYE last), then wait for the peers' BYE (or their loss).
        while time.monotonic() < deadline:
            pending = any(p.wq for p in self._peers.values() if not p.lost)
            waiting = any(not (p.left or p.lost) for p in self._peers.values())
            if not pending and not waiting:
                break
            self.progress(0.05)
        else:
            late = [r for r, p in self._peers.items() if not (p.left or p.lost)]
            if late:
                log.warning("rank %d: closing without a goodbye from ranks %s", self.rank, late)
        self._teardown()
        if self.session is not None:
            try:
                self.session.close()
            except Exception:  # noqa: BLE001
                log.debug("rank %d: error closing the master session", self.rank, exc_info=True)

    def abort(self, reason: str) -> None:
        log.info("rank %d: aborting: %s", self.rank, reason)
        try:
            self._say_abort(reason)
        except Exception:  # noqa: BLE001 - aborting must finish
            log.debug("rank %d: could not tell the peers why it aborts", self.rank, exc_info=True)
        self._teardown()
        if self.session is not None:
            try:
                # Leaving the master link without "bye" makes the master report this rank lost; it
                # tells the others why (the reason), as the ABORT frames did on the direct links.
                self.session.abort(reason)
            except Exception:  # noqa: BLE001
                pass

    def _say_abort(self, reason: str) -> None:
        """Queue an ABORT frame with ``reason`` behind whatever each live peer still has queued, and
        write it out for up to _ABORT_FLUSH seconds (peers that went silent are not waited for)."""
        payload = memoryview(reason.encode("utf-8", "replace")[:_MAX_ABORT_REASON])
        targets = [p for p in self._peers.values() if not (p.lost or p.left or p.closed or p.pushing)]
        for p in targets:
            self._enqueue(p, _HDR.pack(ABORT, 0, payload.nbytes), [payload], None)
        now = time.monotonic()
        deadline = now + min(_ABORT_FLUSH, self.config.peer_timeout / 4)
        silent = 2 * self.config.heartbeat_interval
        with selectors.DefaultSelector() as sel:
            while True:
                pending = [p for p in targets if p.wq and not (p.lost or p.closed)]
                for p in pending:
                    self._write(p)
                wait = [p for p in pending if p.wq and not (p.lost or p.closed)
                        and now - p.last_recv <= silent]
                now = time.monotonic()
                if not wait or now >= deadline:
                    return
                for p in wait:
                    sel.register(p.sock, selectors.EVENT_WRITE)
                sel.select(min(0.05, deadline - now))
                for p in wait:
                    sel.unregister(p.sock)

    # ------------------------------------------------------------------------------ writing
    def _enqueue(self, p: _Peer, header: bytes, views: list[memoryview], token: object) -> None:
        p.wq.append(memoryview(header))
        p.wq_bytes += len(header)
        for v in views:
            p.wq.append(v)
            p.wq_bytes += v.nbytes
        if token is not None:
            p.tokens.append((p.wq_bytes, token))

    def _flush_writes(self) -> bool:
        did = False
        for p in self._peers.values():
            if p.wq and not p.lost and not p.want_write and not p.closed:
                did = self._write(p) or did
        return did

    def _write(self, p: _Peer) -> bool:
        did = False
        sent_total = 0
        until = 0.0
        while p.wq:
            iov = list(p.wq)[:_MAX_IOV] if len(p.wq) > _MAX_IOV else list(p.wq)
            try:
                n = p.sock.sendmsg(iov)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as e:
                # A peer that said goodbye may hang up before reading what we still send (a credit
                # return, a heartbeat): its BYE may be waiting unread, behind messages. Read them
                # first (each call stops after a large payload: read until nothing more comes).
                while not (p.left or p.lost or p.closed) and self._read(p, wait=False):
                    pass
                self._broken(p, f"send failed: {e}")
                return True
            if n == 0:
                # The socket is full. A large payload: wait for room on this socket alone, briefly (a
                # pushing thread waits for room itself, outside the engine).
                if p.pushing or p.wq_bytes - sent_total < _BULK_BYTES:
                    break
                until = self._bulk_wait(p, _OUT, until)
                if not until:
                    break
                continue
            did = True
            sent_total += n
            p.last_send = time.monotonic()
            rem = n
            while rem:
                head = p.wq[0]
                if head.nbytes <= rem:
                    rem -= head.nbytes
                    p.wq.popleft()
                else:
                    p.wq[0] = head[rem:]
                    rem = 0
        if sent_total:
            self._complete_tokens(p, sent_total)
        want = bool(p.wq)
        if want != p.want_write and not p.pushing and not p.closed:   # a pushing peer is muted
            p.want_write = want
            self._poller.modify(p.fd, _IN | (_OUT if want else 0))
        return did

    def _complete_tokens(self, p: _Peer, sent: int) -> None:
        p.wq_bytes -= sent
        # token offsets are absolute positions in wq_bytes terms at enqueue time: shift them
        if p.tokens:
            h = self._handler
            if not p.wq:     # everything written: every token is done
                tokens, p.tokens = p.tokens, deque()
                if h is not None:
                    for _, token in tokens:
                        h.on_sent(token)
                return
            shifted = deque()
            for remaining, token in p.tokens:
                remaining -= sent
                if remaining <= 0:
                    if h is not None:
                        h.on_sent(token)
                else:
                    shifted.append((remaining, token))
            p.tokens = shifted

    # ------------------------------------------------------------------------------ reading
    def _read(self, p: _Peer, wait: bool = True) -> bool:
        did = False
        reads = 0
        until = 0.0
        # bounded, so one busy peer cannot starve the others: at most 64 reads, or one large payload
        # (while it arrives, ``wait`` lets us wait up to _BULK_WAIT for it on this socket alone)
        while True:
            # a large payload in progress is received straight into its own buffer, else into staging
            if p.cur is not None:
                target = p.cur[p.cur_pos:]
            elif p.header_next and p.rlen < HEADER_SIZE:
                target = memoryview(p.rbuf)[p.rlen:HEADER_SIZE]
            else:
                target = memoryview(p.rbuf)[p.rlen:]
            try:
                n = p.sock.recv_into(target)
            except (BlockingIOError, InterruptedError):
                n = -1
            except OSError as e:
                self._broken(p, f"receive failed: {e}")
                return True
            if n == 0:
                self._eof(p)
                return True
            if n > 0:
                did = True
                p.last_recv = time.monotonic()
                if p.cur is not None:
                    p.cur_pos += n
                    if p.cur_pos == len(p.cur):
                        hdr = p.cur_hdr
                        data, p.cur, p.cur_hdr = p.cur, None, None
                        assert hdr is not None
                        p.header_next = True
                        self._frame(p, hdr[0], hdr[1], hdr[2], data)
                        # Back to the engine with it: it is delivered (and its credit returned) now,
                        # not after whatever else the sender keeps streaming in behind it.
                        return True
                else:
                    p.rlen += n
                    try:
                        self._parse(p)
                    except ProtocolError as e:
                        self._broken(p, str(e))
                        return True
                if p.lost:
                    return True
                reads += 1
                if n == len(target) and (reads < 64 or p.cur is not None):
                    continue
            # The socket had no more (or this peer had its share): the poller says when it has (saves a
            # failing recv), unless the rest of a large payload is on its way: wait for it here, briefly.
            if not wait or p.cur is None or p.lost or p.closed:
                break
            until = self._bulk_wait(p, _IN, until)
            if not until:
                break
        return did

    def _parse(self, p: _Peer) -> None:
        buf = p.rbuf
        pos = 0
        end = p.rlen
        mv = memoryview(buf)
        while end - pos >= HEADER_SIZE:
            kind, edge, length = _HDR.unpack_from(buf, pos)
            if kind not in (DATA, CREDIT, HEARTBEAT, BYE, ABORT) or length > _MAX_FRAME \
                    or (kind == ABORT and length > _MAX_ABORT_REASON):
                raise ProtocolError(f"rank {p.rank}: bad frame header (type {kind}, length {length})")
            if kind not in (DATA, ABORT):
                pos += HEADER_SIZE
                self._frame(p, kind, edge, length, mv[0:0])
                continue
            if end - pos - HEADER_SIZE >= length:
                p.header_next = False      # small messages: back to reading as much as there is
                start = pos + HEADER_SIZE
                data = bytes(mv[start:start + length])
                pos = start + length
                self._frame(p, kind, edge, length, memoryview(data))
                if p.lost:
                    return
                continue
            # Payload not all here: receive the rest straight into its own buffer.
            start = pos + HEADER_SIZE
            have = end - start
            if length > _STAGING // 2 or have > 0:
                cur = self._recv_buffers.get(length)
                cur[:have] = mv[start:end]
                p.cur, p.cur_pos, p.cur_hdr = cur, have, (kind, edge, length)
                pos = end
            break
        if pos:
            rest = end - pos
            if rest:
                buf[:rest] = mv[pos:end]
            p.rlen = rest
        del mv

    def _frame(self, p: _Peer, kind: int, edge: int, length: int, data: memoryview) -> None:
        h = self._handler
        if kind == DATA:
            if h is not None:
                h.on_message(p.rank, edge, data, self._returner(p.rank, edge, length))
        elif kind == CREDIT:
            key = (p.rank, edge)
            self._inflight[key] = max(0, self._inflight.get(key, 0) - length)
            if h is not None:
                h.on_credit(p.rank, edge)
        elif kind == BYE:
            p.left = True
        elif kind == ABORT:
            self._broken(p, f"it failed: {bytes(data).decode('utf-8', 'replace')}")
        # HEARTBEAT: last_recv already updated

    def _returner(self, peer: int, edge: int, n: int) -> Callable[[], None]:
        returns = self._returns
        wake = self.wakeup
        used = [False]

        def release() -> None:
            if used[0]:
                return
            used[0] = True
            returns.append((peer, edge, n))
            wake()
        return release

    def _send_credit_returns(self) -> bool:
        """Return released credit in batches: a (peer, edge) gets its bytes back once a quarter of its
        credit is owed, or once the oldest owed byte waited ``_CREDIT_DELAY``. A stream of large
        messages then costs the sender one CREDIT frame (and one wake-up of its engine) per quarter of
        the credit instead of one per message. A sender can only be held up by what is owed if its
        next message is larger than about three quarters of the credit, and then for ``_CREDIT_DELAY``."""
        owed = self._owed
        if self._returns:
            if not owed:
                self._owed_since = time.monotonic()
            while self._returns:
                peer, edge, n = self._returns.popleft()
                owed[(peer, edge)] = owed.get((peer, edge), 0) + n
        if not owed:
            return False
        due = time.monotonic() - self._owed_since >= _CREDIT_DELAY
        batch = self.credit // 4
        sent = False
        for key in [k for k, n in owed.items() if due or n >= batch]:
            n = owed.pop(key)
            p = self._peers.get(key[0])
            if p is not None and not p.lost and not p.left:
                self._enqueue(p, _HDR.pack(CREDIT, key[1], n), [], None)
                sent = True
        if not owed:
            self._owed_since = float("inf")
        return sent

    def _credit_wait(self, timeout: float) -> float:
        """``timeout`` cut short so that owed credit is returned on time."""
        if self._owed or self._returns:
            return max(0.0, min(timeout, self._owed_since + _CREDIT_DELAY - time.monotonic()))
        return timeout

    # ------------------------------------------------------------------------------ liveness
    def _heartbeats(self) -> None:
        now = time.monotonic()
        hb = self.config.heartbeat_interval
        for p in self._peers.values():
            if p.lost or p.left:
                continue
            if now - p.last_recv > self.config.peer_timeout:
                self._broken(p, f"no data or heartbeat for {now - p.last_recv:.1f}s")
                continue
            if now - p.last_send > hb and not p.wq:
                self._enqueue(p, _HDR.pack(HEARTBEAT, 0, 0), [], None)
                p.last_send = now
                self._write(p)

    def _eof(self, p: _Peer) -> None:
        if p.left:
            # It said goodbye and hung up: nothing queued for it can be delivered any more (only
            # credit returns can be, and they no longer matter); don't let them hold up close().
            self._unregister(p)
            self._drop_queue(p)
            return
        self._broken(p, "connection closed without goodbye (process died?)")

    def _broken(self, p: _Peer, reason: str, *, placed: bool = False) -> None:
        """``p`` is lost: close its link and report it, the reason prefixed with where it ran (unless
        ``placed``: the reason already says, as the master's reports do)."""
        if p.lost:
            return
        if p.left:   # hung up after its goodbye: as in _eof
            self._unregister(p)
            self._drop_queue(p)
            return
        p.lost = True
        self._unregister(p)
        self._report_lost(p, reason if placed else f"{self._places[p.rank]}: {reason}")

    def _report_lost(self, p: _Peer, reason: str) -> None:
        self._drop_queue(p)
        if self._handler is not None:
            self._handler.on_peer_lost(p.rank, reason)

    def _drop_queue(self, p: _Peer) -> None:
        """Forget what is queued for ``p`` (it can no longer be sent), releasing its tokens."""
        p.wq.clear()
        p.wq_bytes = 0
        h = self._handler
        if h is not None:
            for _, token in p.tokens:
                h.on_sent(token)
        p.tokens.clear()

    def _unregister(self, p: _Peer) -> None:
        if not p.closed:
            self._poller.unregister(p.fd)
        try:
            p.sock.close()
        except OSError:
            pass

    def _on_session_event(self, event: dict) -> None:
        # master session thread: hand over to the progress thread
        self._events.append(event)
        self.wakeup()

    def _session_events(self) -> bool:
        did = False
        while self._events:
            ev = self._events.popleft()
            did = True
            kind = ev.get("type")
            if kind == "peer_lost":
                p = self._peers.get(int(ev.get("rank", -1)))
                if p is not None and not p.left:
                    place = ev.get("place") if isinstance(ev.get("place"), str) else self._places[p.rank]
                    self._broken(p, f"bootstrap master reports {place}: {ev.get('reason', 'lost')}",
                                 placed=True)
            elif kind == "master_lost":
                log.warning("rank %d: lost the bootstrap master; peer links continue", self.rank)
            else:
                svc = self.service_handlers.get(ev.get("service", ""))
                if svc is not None:
                    svc(ev)
        return did

    #: Handlers for service replies from the master (barrier manager, coflow coordinator), by name.
    service_handlers: dict[str, Callable[[dict], None]]

    def _drain_wakeup(self) -> None:
        # Drain first, then clear the flag: a wakeup skipped meanwhile (flag still set) needs no byte,
        # because its caller queued its work before waking us and this progress round still sees it.
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        self._woken = False

    # ------------------------------------------------------------------------------ late connections
    def _accept(self, ls: socket.socket) -> None:
        """Take the connections waiting on ``ls``: each gets a bounded handshake (and is then refused:
        every peer is connected already), or is closed at once while MAX_PENDING_HANDSHAKES run."""
        for _ in range(64):     # a bounded batch per round: the engine has other work
            try:
                sock, addr = ls.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                self._pause_accept(ls, e)
                return
            self._accept_backoff = 0.0
            if not self._vetting.acquire(blocking=False):
                self.dropped_connections += 1
                self._noise.warning("busy", "rank %d: closed a connection from %s unread: %d handshakes "
                                    "already running", self.rank, addr or "a local socket",
                                    MAX_PENDING_HANDSHAKES)
                sock.close()
                continue
            try:
                threading.Thread(target=self._vet_late, args=(sock, addr), daemon=True,
                                 name=f"twisternet-vet-{self.rank}").start()
            except RuntimeError as e:   # cannot start a thread (resource limit)
                self._vetting.release()
                sock.close()
                self._pause_accept(ls, e)
                return

    def _pause_accept(self, ls: socket.socket, error: BaseException) -> None:
        """``accept`` failed: stop watching ``ls`` for a while (backing off while it keeps failing)."""
        self._accept_backoff = min(_ACCEPT_BACKOFF_MAX, max(_ACCEPT_BACKOFF_MIN, 2 * self._accept_backoff))
        self._noise.warning("accept", "rank %d: accept failed (%s); not accepting for %.2fs",
                            self.rank, error, self._accept_backoff)
        fd = ls.fileno()
        if fd >= 0 and fd not in self._accept_paused:
            self._poller.unregister(fd)
            self._accept_paused[fd] = (ls, time.monotonic() + self._accept_backoff)

    def _resume_accept(self, timeout: float) -> float:
        """Watch paused listeners again once their rest is over; ``timeout`` cut to the next resume."""
        now = time.monotonic()
        for fd, (ls, at) in list(self._accept_paused.items()):
            if at <= now:
                del self._accept_paused[fd]
                if ls.fileno() >= 0 and not self._closed_sel:
                    self._poller.register(fd, _IN, ls)
            else:
                timeout = min(timeout, at - now)
        return timeout

    def _vet_late(self, sock: socket.socket, addr: Any) -> None:
        """A connection after the mesh was built: prove it, then refuse it (every peer is connected)."""
        try:
            sock.setblocking(True)
            hello = handshake(sock, self._token, initiator=False, hello={"rank": self.rank},
                              timeout=self.config.handshake_timeout)
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

    def _teardown(self) -> None:
        for p in self._peers.values():
            self._unregister(p)
        for ls in self._listeners:
            if ls.fileno() >= 0:
                self._poller.unregister(ls.fileno())
            ls.close()
        self._accept_paused.clear()
        for s in (self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        self._closed_sel = True
        self._poller.close()


# ---------------------------------------------------------------------------------- construction
def _tune(sock: socket.socket, config: Config, tcp: bool) -> None:
    if config.socket_buffer:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, config.socket_buffer)
            except OSError:
                pass
    if tcp:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _listeners(config: Config, bind_host: str) -> tuple[list[socket.socket], dict]:
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    tcp = socket.socket(family, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((bind_host, 0))
    tcp.listen(256)
    out = [tcp]
    listen: dict[str, Any] = {"tcp_port": tcp.getsockname()[1]}
    if not config.force_tcp and hasattr(socket, "AF_UNIX"):
        uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"\0twisternet-{os.getpid()}-{secrets.token_hex(8)}"
        uds.bind(name)
        uds.listen(256)
        out.append(uds)
        listen["uds"] = name[1:]
    return out, listen


def _connect(entry: dict, my_host: str, config: Config) -> tuple[socket.socket, str]:
    if not config.force_tcp and entry.get("uds") and entry.get("host_id") == my_host:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _tune(s, config, tcp=False)
        s.settimeout(config.connect_timeout)
        s.connect("\0" + entry["uds"])
        return s, "uds"
    host, port = entry["tcp_host"], entry["tcp_port"]
    s = socket.create_connection((host, port), timeout=config.connect_timeout)
    _tune(s, config, tcp=True)
    return s, "tcp"


def build_mesh(rank: int, world: int, table: list[dict], listeners: list[socket.socket], token: bytes,
               config: Config) -> dict[int, _Peer]:
    """Connect to every lower rank and accept every higher one, proving the token on each link."""
    from twisternet.bootstrap import host_id
    my_host = host_id()
    places = _places(world, table)
    peers: dict[int, _Peer] = {}
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + config.connect_timeout
    hello = {"rank": rank, "world": world}

    def dial(j: int) -> None:
        delay = 0.02
        while True:
            try:
                s, kind = _connect(table[j], my_host, config)
                s.settimeout(None)
                got = handshake(s, token, initiator=True, hello=hello, timeout=config.handshake_timeout)
                if got.get("rank") != j:
                    s.close()
                    raise ProtocolError(f"expected rank {j}, the peer says {got.get('rank')!r}")
                with lock:
                    peers[j] = _Peer(j, s, kind)
                return
            except (ConnectionError, socket.timeout, OSError) as e:
                if time.monotonic() + delay >= deadline:
                    with lock:
                        errors.append(f"{places[j]}: {e}")
                    return
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except (AuthError, ProtocolError) as e:
                with lock:
                    errors.append(f"{places[j]}: {e}")
                return

    dialers = [threading.Thread(target=dial, args=(j,), daemon=True) for j in range(rank)]
    for t in dialers:
        t.start()
    expected = set(range(rank + 1, world))
    sel = selectors.DefaultSelector()
    for ls in listeners:
        ls.setblocking(False)
        sel.register(ls, selectors.EVENT_READ)
    vetting: list[threading.Thread] = []
    # Handshakes at once: enough for every expected peer plus some strangers; more are closed at once.
    slots = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES + world)
    noise = LogThrottle(log)

    def vet(sock: socket.socket, addr: Any, kind: str) -> None:
        try:
            sock.setblocking(True)
            got = handshake(sock, token, initiator=False, hello=hello, timeout=config.handshake_timeout)
            j = got.get("rank")
            with lock:
                ok = isinstance(j, int) and j in expected and j not in peers
                if ok:
                    _tune(sock, config, tcp=kind == "tcp")
                    peers[j] = _Peer(j, sock, kind)
            if not ok:
                noise.warning("refused", "rank %d: refused a connection claiming rank %r", rank, j)
                sock.close()
        except (AuthError, ProtocolError, OSError) as e:
            noise.warning("dropped", "rank %d: dropped a connection from %s: %s", rank,
                          addr or "a local socket", e)
            try:
                sock.close()
            except OSError:
                pass
        finally:
            slots.release()

    try:
        while True:
            with lock:
                accepted = expected <= peers.keys()
            if accepted:
                break
            if time.monotonic() >= deadline:
                break
            for key, _ in sel.select(0.05):
                try:
                    sock, addr = key.fileobj.accept()  # type: ignore[union-attr]
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:   # e.g. EMFILE: the connection waits in the queue; rest a little
                    noise.warning("accept", "rank %d: accept failed while building the mesh: %s", rank, e)
                    time.sleep(_ACCEPT_BACKOFF_MIN)
                    continue
                if not slots.acquire(blocking=False):
                    noise.warning("busy", "rank %d: closed a connection from %s unread: too many "
                                  "handshakes at once", rank, addr or "a local socket")
                    sock.close()
                    continue
                kind = "uds" if sock.family == getattr(socket, "AF_UNIX", None) else "tcp"
                t = threading.Thread(target=vet, args=(sock, addr, kind), daemon=True)
                t.start()
                vetting = [v for v in vetting if v.is_alive()]
                vetting.append(t)
    finally:
        sel.close()
    for t in dialers:
        t.join(max(0.0, deadline - time.monotonic()) + 1)
    missing = sorted(set(range(world)) - {rank} - peers.keys())
    if missing:
        for p in peers.values():
            p.sock.close()
        for j in missing:
            if j < rank and not any(e.startswith(f"{places[j]}:") for e in errors):
                errors.append(f"{places[j]}: no answer yet")
        silent = [places[j] for j in missing if j > rank]   # they were to connect to us
        if silent:
            errors.append("no connection arrived from " + ", ".join(silent))
        raise OperationTimeout(f"{places[rank]} could not connect to ranks {missing}: {'; '.join(errors)}",
                               timeout=config.connect_timeout)
    return peers


def _places(world: int, table: Any) -> list[str]:
    """Per rank, where it runs (see :func:`twisternet.bootstrap.rank_places`); plain ``rank R`` when the
    table (from the bootstrap master) is missing or malformed."""
    from twisternet.bootstrap import rank_places
    if isinstance(table, list) and len(table) == world and all(isinstance(e, dict) for e in table):
        return rank_places([(e.get("host_id"), str(e.get("tcp_host") or "")) for e in table])
    return [f"rank {r}" for r in range(world)]


def create_channel(config: Config, **_: Any) -> TCPChannel:
    """Join the job through the bootstrap master (``config.master``) and connect to every peer."""
    from twisternet.bootstrap import join, route_to_master
    if config.master is None:
        raise ConfigError("master", "the tcp channel needs the bootstrap master's HOST:PORT "
                                    "(start the job with `twisternet run` or `twisternet worker`)")
    token = config.token_bytes
    if token is None:
        raise ConfigError("token", "the tcp channel needs the job token (TWISTERNET_TOKEN)")
    # Listen only on the interface this host reaches the master through (the one the master sees),
    # unless bind_host says otherwise.
    # Within connect_timeout: a link that is down yet may come up while the job assembles.
    started = time.monotonic()
    seen_by_master = route_to_master(config.master, config.connect_timeout)
    listeners, listen = _listeners(config, config.bind_host or seen_by_master)
    listen["tcp_host"] = config.advertise_host or seen_by_master
    try:
        left = max(1.0, config.connect_timeout - (time.monotonic() - started))
        session = join(config.master, token, listen=listen, rank=config.rank, world=config.world,
                       timeout=left, handshake_timeout=config.handshake_timeout,
                       heartbeat_interval=config.heartbeat_interval, peer_timeout=config.peer_timeout)
    except BaseException:
        for ls in listeners:
            ls.close()
        raise
    try:
        table = [dict(e) for e in session.table]
        for i, e in enumerate(table):
            # join() stores each worker's `listen` dict plus host_id
            e.setdefault("host_id", e.get("host_id"))
        peers = build_mesh(session.rank, session.world, table, listeners, token, config)
    except BaseException:
        for ls in listeners:
            ls.close()
        session.close()
        raise
    ch = TCPChannel(session.rank, session.world, config, peers, listeners, token, session)
    ch.service_handlers = {}
    log.debug("rank %d: mesh of %d peers ready (%s)", ch.rank, len(peers),
              ", ".join(f"{r}:{p.kind}" for r, p in sorted(peers.items())))
    return ch
