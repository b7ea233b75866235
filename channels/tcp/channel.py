"""The TCP channel's engine side: sending, receiving, pushing, closing and loss reports on a built mesh.

Sends are scatter-gather (``sendmsg``), so large messages go from the caller's memory to the kernel
without a copy; large incoming payloads are received straight into a buffer of their own. A peer whose
connection breaks without a ``BYE``, that stays silent for ``peer_timeout``, or that the bootstrap
master reports lost is reported lost, the reason naming where it ran (and for an ``ABORT``, why).
"""

from __future__ import annotations

import logging
import selectors
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from twisternet.channel import Buffer, Channel, ChannelHandler
from twisternet.config import Config
from twisternet.waker import Waker

from ..buffers import BufferCache
from .accept import LateConnections
from .credit import CreditLedger
from .liveness import Liveness, rank_places
from .peer import Peer
from .poller import IN, OUT, READABLE, Poller
from .receive import TCPReceive
from .wire import (
    ABORT,
    BYE,
    CREDIT,
    CREDIT_ENTRY,
    DATA,
    DATA_CREDIT,
    HDR,
    HDR_CREDIT,
    HEARTBEAT,
    MAX_ABORT_REASON,
    header,
)

log = logging.getLogger(__name__)

#: Longest (seconds) abort() spends handing its ABORT frame to peers that are still answering.
ABORT_FLUSH = 1.0
#: Most buffers one ``sendmsg`` call takes.
MAX_IOV = 512
#: While a large payload is being written or read, how long (seconds, per progress call) the channel
#: waits for that socket alone instead of going back through the engine for every chunk the socket
#: takes: a chunk is ~0.1 ms of copying at loopback speed, the round through the engine ~30 us of
#: Python. Other peers wait at most this long.
BULK_WAIT = 1e-3
#: A queue holding at least this many bytes counts as a large payload being written.
BULK_BYTES = 1 << 20
#: Seconds between two liveness checks (heartbeats due, silent peers) in ``progress``.
LIVENESS_EVERY = 0.005


class TCPChannel(TCPReceive, Channel):
    """The TCP/Unix-socket transport. Build it with :func:`create_channel`."""

    name = "tcp"

    def __init__(self, rank: int, world: int, config: Config, peers: dict[int, Peer],
                 listeners: list[socket.socket], token: bytes, session: Any = None) -> None:
        super().__init__(rank, world, config)
        self.credit = config.buffer_size * config.buffer_count
        self._peers = peers
        #: Peers frames were queued for, and maybe not all written yet (_flush_writes looks at these
        #: only, not at every peer of the job; a peer leaves the set once its queue is empty).
        self._writers: set[Peer] = set()
        self._listeners = listeners
        self.session = session
        self._handler: ChannelHandler | None = None
        self._waker = Waker()
        self._ledger = CreditLedger(self.credit, self._waker.wake)
        #: Bytes in flight per (peer, edge) (the ledger's).
        self._inflight = self._ledger.inflight
        self._events: deque[dict] = deque()                     # from the master session
        self._poller = Poller()
        self._closed_sel = False
        self._poller.register(self._waker.fileno(), IN, None)
        for ls in listeners:
            ls.setblocking(False)
            self._poller.register(ls.fileno(), IN, ls)
        for p in peers.values():
            p.sock.setblocking(False)
            self._poller.register(p.fd, IN, p)
        # Idle large buffers kept for reuse are bounded by twice the memory limit (512 MiB by default).
        self._recv_buffers = BufferCache(max(4 * self.credit, 2 * config.memory_limit))
        # Late connections (after the mesh): bounded handshakes, accept backoff, rate-limited logs.
        self._late = LateConnections(rank, token, config, self._poller)
        self._liveness = Liveness(config.heartbeat_interval, config.peer_timeout)
        self._next_liveness = 0.0
        #: Per rank: "rank R on HOST (ADDRESS; ranks on that host: ...)", for loss reports.
        self._places = rank_places(world, getattr(session, "table", None))
        #: Where service replies from the master go (barrier manager, coflow coordinator): route_services.
        self._service_route: Callable[[str, dict[str, Any]], None] | None = None
        if session is not None:
            session.on_event(self._on_session_event)

    @property
    def dropped_connections(self) -> int:
        """Late connections closed unread because MAX_PENDING_HANDSHAKES were already running."""
        return self._late.dropped

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
        if not self._ledger.fits(key, n):
            return False
        if p.lost or p.left:
            # Nothing can reach it any more; tell the core (once) instead of queueing forever.
            if not p.lost:
                p.lost = True
                self._report_lost(p, "send to a rank that has left the job")
            if token is not None and self._handler is not None:
                self._handler.on_sent(token)
            return True
        self._ledger.charge(key, n)
        idle = not p.wq and not p.want_write and not p.pushing
        if self._ledger.owes:
            # credit owed to this peer rides along in the same write (no frame, wake-up of its own)
            for e, m in self._ledger.take_owed(peer):
                self._enqueue(p, header(CREDIT, e, m), [], None)
        self._enqueue(p, header(DATA, edge, n), views, token)
        if idle and n < BULK_BYTES:
            # Small message on an idle link: write it now, from the thread that sends it, instead of
            # at the next progress round (a system call saved and no wait for the engine). What the
            # socket does not take, or an error, is left to the engine (_flush_writes / _write).
            self._write_now(p)
        return True

    can_send_small = True

    def send_small(self, peer: int, edge: int, parts: Sequence[Buffer], nbytes: int) -> bool:
        # The fast path of a small message to an idle link: one frame (with the credit owed to the peer
        # in front) built in one bytes object and written with one send(), no queue, no token.
        p = self._peers.get(peer)
        if (p is None or p.wq or p.want_write or p.pushing or p.lost or p.left or p.sock.fileno() < 0
                or self._inflight.get((peer, edge))):
            return False    # (p.sock.fileno() < 0: p.closed, without the property's call)
        ledger = self._ledger
        ledger.charge((peer, edge), nbytes)
        frames: list[Buffer]
        owed = ledger.take_owed(peer) if ledger.returns or ledger.owed else None
        if owed and len(owed) == 1:
            ((e, m),) = owed        # (the common case: the frame carries it, see DATA_CREDIT)
            frames = [HDR_CREDIT.pack(DATA_CREDIT, edge, nbytes + CREDIT_ENTRY.size, e, m), *parts]
        elif owed:
            frames = [header(CREDIT, e, m) for e, m in owed]
            frames.append(HDR.pack(DATA, edge, nbytes))
            frames.extend(parts)
        else:
            frames = [HDR.pack(DATA, edge, nbytes), *parts]
        buf = b"".join(frames)
        try:
            n = p.sock.send(buf)
        except OSError:     # (would block, or a broken link: the engine's write finds out which)
            n = 0
        if n:
            p.last_send = time.monotonic()
        if n < len(buf):
            # the engine writes the rest once the socket has room (or reports the link broken)
            rest = memoryview(buf)[n:]
            p.wq.append(rest)
            p.wq_bytes += rest.nbytes
            p.want_write = True
            self._writers.add(p)
            self._poller.modify(p.fd, IN | OUT)
        return True

    def _write_now(self, p: Peer) -> None:
        try:
            n = p.sock.sendmsg(p.wq)
        except OSError:
            return
        if n:
            p.consume(n)
            self._sent(p.written(n))

    def progress(self, timeout: float = 0.0) -> bool:
        did = self._flush_writes() if self._writers else False
        if timeout > 0 and self._ledger.owes:   # (a round that does not wait returns it below)
            did = self._send_credit_returns(self._ledger.due()) or did
        if did:
            timeout = 0.0
        if self._late.paused:
            timeout = self._late.resume(timeout)
        if timeout > 0:
            try:
                events = self._poller.poll(self._ledger.sleeping(timeout))
            finally:
                self._ledger.awake()
        else:
            events = self._poller.poll(0.0)
        for obj, mask in events:
            if obj is None:
                self._waker.drain()
                continue
            if type(obj) is not Peer:
                self._late.accept(obj)
                continue
            p: Peer = obj
            if mask & READABLE and not p.lost:
                did = self._read(p) or did
            if mask & OUT and not p.lost:
                did = self._write(p) or did
        ledger = self._ledger
        if ledger.returns or ledger.owed:       # (ledger.owes, without the property's call)
            due = ledger.due()
            if due:     # (the common answer after a read is none: no call then)
                did = self._send_credit_returns(due) or did
        if (did or events) and self._writers:
            did = self._flush_writes() or did
        if self._events:
            did = self._session_events() or did
        now = time.monotonic()
        if now >= self._next_liveness:
            # silence is measured in seconds: checking every few milliseconds is plenty
            self._next_liveness = now + LIVENESS_EVERY
            self._heartbeats()
        return did or bool(events)

    def flush_released(self) -> None:
        # credit the handlers released, if due, goes out now (releases by the thread in the engine
        # wake nobody: see CreditLedger.sleepers)
        if self._ledger.owes and self._send_credit_returns(self._ledger.due()):
            self._flush_writes()

    can_wait_unlocked = True

    def wait(self, timeout: float) -> None:
        # epoll may be waited on by one thread while another registers, reads and writes: this only
        # rings the bell (level-triggered), and progress() then finds out what happened.
        if timeout > 0 and not self._closed_sel:
            try:
                self._poller.poll(self._ledger.sleeping(timeout))
            except (OSError, ValueError):   # closed under us: the engine is stopping
                pass
            finally:
                self._ledger.awake()

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
        if not p.lost and not p.closed and p.poll_socket(IN, 0.0):
            self._read(p, wait=False)
        if not p.wq or p.lost or p.closed:
            self._end_push(p)
            return True
        return False

    def end_push(self, peer: int) -> None:
        p = self._peers.get(peer)
        if p is not None and p.pushing:
            self._end_push(p)

    def _end_push(self, p: Peer) -> None:
        p.pushing = False
        if p.lost or p.closed:
            return
        p.want_write = bool(p.wq)     # the engine writes what is left and reads what comes
        self._poller.modify(p.fd, IN | (OUT if p.want_write else 0))

    def wait_writable(self, peer: int, timeout: float) -> None:
        p = self._peers.get(peer)
        if p is None or p.lost or p.closed or timeout <= 0:
            return
        # what the peer sends is the pusher's to read too; closed under us: found out on the next push
        p.poll_socket(OUT | IN, timeout)

    def _bulk_wait(self, p: Peer, events: int, until: float) -> float:
        """Wait on ``p``'s socket alone for ``events`` (more of a large payload, or room for one) until
        ``until`` (0: ``BULK_WAIT`` from now). The deadline to keep, or 0.0 once nothing came in time."""
        now = time.monotonic()
        until = until or now + BULK_WAIT
        return until if now < until and p.poll_socket(events, until - now) else 0.0

    def wakeup(self) -> None:
        self._waker.wake()

    def has_pending(self, peer: int | None = None) -> bool:
        if peer is not None:
            p = self._peers.get(peer)
            return bool(p and p.wq and not p.lost)
        return any(p.wq and not p.lost for p in tuple(self._writers))

    def idle(self, peer: int, edge: int) -> bool:
        p = self._peers.get(peer)
        return p is not None and not p.wq and not self._inflight.get((peer, edge))

    def pending_bytes(self, peer: int) -> int:
        """Bytes queued for ``peer`` and not yet written to its socket (the coflow scheduler keeps this
        small so that its own priority-ordered queues hold the backlog)."""
        p = self._peers.get(peer)
        return p.wq_bytes if p is not None and not p.lost else 0

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self._peers.values():
            if not p.lost and not p.closed:
                self._enqueue(p, header(BYE), [], None)
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
            except Exception:
                log.debug("rank %d: error closing the master session", self.rank, exc_info=True)

    def abort(self, reason: str) -> None:
        log.info("rank %d: aborting: %s", self.rank, reason)
        try:
            self._say_abort(reason)
        except Exception:  # aborting must finish
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
        write it out for up to ABORT_FLUSH seconds (peers that went silent are not waited for)."""
        payload = memoryview(reason.encode("utf-8", "replace")[:MAX_ABORT_REASON])
        targets = [p for p in self._peers.values() if not (p.lost or p.left or p.closed or p.pushing)]
        for p in targets:
            self._enqueue(p, header(ABORT, 0, payload.nbytes), [payload], None)
        now = time.monotonic()
        deadline = now + min(ABORT_FLUSH, self.config.peer_timeout / 4)
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
    def _enqueue(self, p: Peer, head: bytes, views: list[memoryview], token: object) -> None:
        """Queue one frame for ``p`` (every frame this channel sends goes through here)."""
        p.enqueue(head, views, token)
        self._writers.add(p)     # (after the frame: see _flush_writes)

    def _flush_writes(self) -> bool:
        """Write what is queued for the peers whose socket the poller does not watch for room."""
        if not self._writers:
            return False
        did = False
        writers = self._writers
        for p in tuple(writers):
            # out of the set first, then look at its queue: a frame another thread queues meanwhile
            # is either seen here or puts the peer back in the set (_enqueue adds after queueing)
            writers.discard(p)
            if not p.wq or p.lost or p.closed:
                continue
            if not p.want_write:
                did = self._write(p) or did
            if p.wq:
                writers.add(p)
        return did

    def _write(self, p: Peer) -> bool:
        did = False
        sent_total = 0
        until = 0.0
        while p.wq:
            iov = list(p.wq)[:MAX_IOV] if len(p.wq) > MAX_IOV else list(p.wq)
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
                if p.pushing or p.wq_bytes - sent_total < BULK_BYTES:
                    break
                until = self._bulk_wait(p, OUT, until)
                if not until:
                    break
                continue
            did = True
            sent_total += n
            p.consume(n)
        if sent_total:
            self._sent(p.written(sent_total))
        want = bool(p.wq)
        if want != p.want_write and not p.pushing and not p.closed:   # a pushing peer is muted
            p.want_write = want
            self._poller.modify(p.fd, IN | (OUT if want else 0))
        return did

    def _sent(self, tokens: list[object]) -> None:
        """Tell the core these sends are written out (their memory may be reused)."""
        h = self._handler
        if h is not None:
            for token in tokens:
                h.on_sent(token)

    def _send_credit_returns(self, due: list[tuple[int, int, int]]) -> bool:
        """Queue CREDIT frames for ``due``, the released credit the caller just took from the ledger
        as due (CreditLedger.due)."""
        sent = False
        for peer, edge, n in due:
            p = self._peers.get(peer)
            if p is not None and not p.lost and not p.left:
                self._enqueue(p, header(CREDIT, edge, n), [], None)
                sent = True
        return sent

    # ------------------------------------------------------------------------------ liveness
    def _heartbeats(self) -> None:
        now = time.monotonic()
        silent, idle = self._liveness.check(self._peers.values(), now)
        for p, reason in silent:
            self._broken(p, reason)
        for p in idle:
            self._enqueue(p, header(HEARTBEAT), [], None)
            p.last_send = now
            self._write(p)

    def _eof(self, p: Peer) -> None:
        if p.left:
            # It said goodbye and hung up: nothing queued for it can be delivered any more (only
            # credit returns can be, and they no longer matter); don't let them hold up close().
            self._unregister(p)
            self._drop_queue(p)
            return
        self._broken(p, "connection closed without goodbye (process died?)")

    def _broken(self, p: Peer, reason: str, *, placed: bool = False) -> None:
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

    def _report_lost(self, p: Peer, reason: str) -> None:
        self._drop_queue(p)
        if self._handler is not None:
            self._handler.on_peer_lost(p.rank, reason)

    def _drop_queue(self, p: Peer) -> None:
        """Forget what is queued for ``p`` (it can no longer be sent), releasing its tokens."""
        self._sent(p.drop_queue())

    def _unregister(self, p: Peer) -> None:
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
            elif self._service_route is not None:
                self._service_route(ev.get("service", ""), ev)
        return did

    def route_services(self, route: Callable[[str, dict[str, Any]], None]) -> None:
        self._service_route = route

    def _teardown(self) -> None:
        for p in self._peers.values():
            self._unregister(p)
        for ls in self._listeners:
            if ls.fileno() >= 0:
                self._poller.unregister(ls.fileno())
            ls.close()
        self._late.close()
        self._waker.close()
        self._closed_sel = True
        self._poller.close()


