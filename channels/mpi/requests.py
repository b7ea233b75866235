"""The request table and the progress engine of the MPI channel: posting sends (bounded per peer, the
rest queued), posting receives, and polling every outstanding request with ``Testsome``."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from twisternet.errors import TwisternetError

from .credit import _CREDIT_MAX_DELAY
from .records import (
    _BulkRecv,
    _CtrlRecv,
    _DataRecv,
    _Heartbeat,
    _PreRecv,
    _Send,
    _SendGroup,
)
from .state import MPIChannelState
from .wire import TAG_CTRL, TAG_DATA, _encode_credit

log = logging.getLogger(__name__)


#: Sends per peer handed to MPI at once; later ones wait in the channel's queue for that peer.
_MAX_POSTED_SENDS = 32

#: Seconds of polling back to back while sends or rendezvous payloads are outstanding, before the
#: usual backoff applies (a peer that does not receive must not make us burn a core).
_BUSY_SPIN = 0.05
#: Request arrays at most this long are never compacted (see RequestTable._compact).
_COMPACT_MIN = 8
#: Seconds a poll keeps testing for the header of a payload that arrived in a pre-posted receive.
_PRE_HEADER_WAIT = 5e-5
#: What RequestTable.testsome reports as failed when nothing failed (shared: never appended to).
_NO_FAILURES: list[tuple[Any, int]] = []


class RequestTable:
    """The outstanding MPI requests, each with the bookkeeping object (:mod:`.records`) saying what it
    is for. ``Testsome`` runs over one array of requests; the slots of completed ones are reused, so
    that array stays as long as the most requests ever outstanding at once."""

    __slots__ = ("_MPI", "_reqs", "_ops", "_free", "_statuses", "active")

    def __init__(self, MPI: Any) -> None:
        self._MPI = MPI
        self._reqs: list[Any] = []
        self._ops: list[Any] = []         # ``_ops[i]``: what request i is for (None: a free slot)
        self._free: list[int] = []
        self._statuses: list[Any] = []    # filled by Testsome; read only when it reports an error
        #: Requests outstanding.
        self.active = 0

    def add(self, req: Any, op: Any) -> None:
        """Track the MPI request ``req``, described by ``op``."""
        if self._free:
            i = self._free.pop()
            self._reqs[i] = req
            self._ops[i] = op
        else:
            self._reqs.append(req)
            self._ops.append(op)
        self.active += 1

    def testsome(self) -> tuple[list[Any], list[tuple[Any, int]]] | None:
        """``(done, failed)``: the ops of the requests that completed since the last call, and (only
        when MPI reports errors, MPI_ERR_IN_STATUS) ``(op, error code)`` of those that failed.
        Both leave the table. None (the common answer of a waiting poll) if neither has any."""
        MPI = self._MPI
        reqs = self._reqs
        statuses = self._statuses
        if len(statuses) < len(reqs):
            statuses.extend(MPI.Status() for _ in range(len(reqs) - len(statuses)))
        failed: list[tuple[Any, int]] = _NO_FAILURES
        try:
            idx = MPI.Request.Testsome(reqs, statuses)
        except MPI.Exception:
            failed = []
            idx = self._sort_failed(failed)
        if not idx:
            return ([], failed) if failed else None
        ops = self._ops
        free = self._free
        done = []
        for i in idx:
            done.append(ops[i])
            ops[i] = None
            free.append(i)
        self.active -= len(idx)
        if len(reqs) > _COMPACT_MIN and self.active * 4 < len(reqs):
            self._compact()
        return done, failed

    def _compact(self) -> None:
        """Drop the free slots: a burst of sends grows the arrays, and ``Testsome`` (and mpi4py's
        conversion of the list) costs ~0.5 us per slot, free or not, on every later poll."""
        keep = [i for i, op in enumerate(self._ops) if op is not None]
        self._reqs[:] = [self._reqs[i] for i in keep]
        self._ops[:] = [self._ops[i] for i in keep]
        self._free.clear()

    def _sort_failed(self, failed: list[tuple[Any, int]]) -> list[int]:
        """Testsome raised (MPI_ERR_IN_STATUS): the indices of the requests it completed without
        error; the failed ones leave the table and go to ``failed``.

        The error leaves the indices unreported, but every request Testsome completed is now
        REQUEST_NULL and the statuses hold their outcomes in ascending index order."""
        MPI = self._MPI
        null = MPI.REQUEST_NULL
        finished = [i for i, op in enumerate(self._ops) if op is not None and self._reqs[i] == null]
        completed: list[int] = []
        for k, i in enumerate(finished):
            err = self._statuses[k].Get_error() if k < len(self._statuses) else MPI.ERR_OTHER
            if err == MPI.SUCCESS:
                completed.append(i)
                continue
            failed.append((self._ops[i], err))
            self._ops[i] = None
            self._free.append(i)
            self.active -= 1
        return completed

    def cancel(self, op: Any) -> None:
        """Cancel the request ``op`` describes, if it is outstanding (it then completes as cancelled)."""
        for i, o in enumerate(self._ops):
            if o is op:
                try:
                    self._reqs[i].Cancel()
                except self._MPI.Exception:
                    pass
                return

    def outstanding(self) -> list[tuple[Any, Any]]:
        """``(request, op)`` of every outstanding request."""
        return [(self._reqs[i], op) for i, op in enumerate(self._ops) if op is not None]

    def clear(self) -> None:
        """Forget every request (at teardown, once they are freed or cancelled)."""
        self._reqs.clear()
        self._ops.clear()
        self._free.clear()
        self.active = 0


class RequestsMixin(MPIChannelState):
    """Posting requests and polling them.

    A mixin of :class:`~channels.mpi.channel.MPIChannel`, not an object of its own: every completion is
    routed to the part that owns the request (receive, rendezvous, pre-posted, slots), and the
    poll loop is the hottest path of the channel, where an extra indirection per request shows."""

    def progress(self, timeout: float = 0.0) -> bool:
        """Complete requests, deliver messages, return credit; wait up to ``timeout`` s for work.

        Thread-safe and cheap with ``timeout=0`` (one poll: the oldest receive of each peer and the
        other outstanding requests, no wait). Each poll holds the channel's poll lock and a wait
        releases it between polls, so a thread that drives the channel itself (a caller waiting for
        a reply) never waits for another thread's ``progress(timeout)``: if another thread is inside
        a poll right now, ``progress(0)`` returns False at once (that poll delivers what arrived).
        Waiting polls back to back for ``busy_poll_us`` after the last activity, then sleeps."""
        if self._closed or not self._started or self._owner_thread is not None:
            self._check_usable()
        did = self._poll_locked()
        if did or timeout <= 0:
            return did
        deadline = time.monotonic() + timeout
        wake = self._wake
        spin = self._busy_poll
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                return False
            idle = now - self._last_activity
            if idle < spin or self._slot_deferred or (
                    (self._bulk_active or self._pending_total or self._slots_in.lent) and idle < _BUSY_SPIN):
                # Just after activity, or while sends / rendezvous payloads are moving (MPI over
                # shared memory, or a NIC without offload, advances them only while we poll): poll
                # back to back, giving the CPU away between polls once the first burst is over.
                if idle >= spin:
                    os.sched_yield()
                if wake.is_set():
                    wake.clear()
                    return self._poll_locked()
                if self._poll_locked():
                    return True
                continue
            delay = self._backoff(idle)
            if self._credit_returns:
                delay = min(delay, _CREDIT_MAX_DELAY / 2)
            if wake.wait(min(delay, remaining)):
                wake.clear()
                return self._poll_locked()
            if self._poll_locked():
                return True

    def _poll_locked(self) -> bool:
        """One poll holding the poll lock; False at once if another thread holds it. A thread that
        holds it already (progress called inside ``send``) just polls."""
        me = threading.get_ident()
        if self._poll_owner == me:
            return self._poll()
        lock = self._poll_lock
        if not lock.acquire(False):
            return False
        self._poll_owner = me
        try:
            return self._poll()
        finally:
            self._poll_owner = 0
            lock.release()

    def _post(self, req: Any, op: Any) -> None:
        self._requests.add(req, op)
        if type(op) is _BulkRecv:
            self._bulk_active += 1

    def _submit(self, spec: Any, tag: int, op: _Send, urgent: bool = False) -> None:
        """Isend ``spec`` to ``op.peer``, or queue it behind the peer's earlier sends when that peer
        already has ``_MAX_POSTED_SENDS`` in MPI (``urgent`` control messages skip the queue; they
        need no ordering). Bounding posted sends keeps ``Testsome`` arrays short: MPI completes
        queued small sends one per progress call, so thousands of posted ones cost O(n) per poll."""
        peer = op.peer
        q = self._sendq[peer]
        if not urgent and (q or self._posted_sends[peer] >= _MAX_POSTED_SENDS):
            self._account_send(op)
            q.append((spec, tag, op))
            return
        req = self._comm.Isend(spec, peer, tag)
        if op.token is None and not op.bulk and type(op) is _Send and req.Test():
            # A small send MPI finished at once (copied into its shared-memory cell or socket): done,
            # never pending: no slot in the request table, no Testsome completion, no "pending" that
            # keeps the next progress calls busy-polling for it.
            if op.recycle:
                self._recycle_wire(op)
            return
        self._track_send(req, op)

    def _track_send(self, req: Any, op: _Send) -> None:
        """The send ``op`` describes was posted as ``req``: pending until the request completes."""
        self._account_send(op)
        self._post(req, op)
        self._posted_sends[op.peer] += 1

    def _account_send(self, op: _Send) -> None:
        """``op`` is pending (queued or posted) until :meth:`_unaccount_send`."""
        peer = op.peer
        self._pending_sends[peer] += 1
        self._pending_bytes[peer] += op.nbytes
        if peer not in self._lost:
            self._pending_total += 1
        if op.bulk:
            self._bulk_active += 1

    def _drain_sendq(self, peer: int) -> None:
        """Post queued sends to ``peer`` while it is below its limit of posted sends."""
        q = self._sendq[peer]
        while q and self._posted_sends[peer] < _MAX_POSTED_SENDS:
            spec, tag, op = q[0]
            try:
                req = self._comm.Isend(spec, peer, tag)
            except self._MPI.Exception as e:
                self._lose(peer, f"MPI error sending to it: {e.Get_error_string()}")
                return
            q.popleft()
            self._post(req, op)
            self._posted_sends[peer] += 1

    def _unaccount_send(self, op: _Send, posted: bool) -> None:
        peer = op.peer
        self._pending_sends[peer] -= 1
        self._pending_bytes[peer] -= op.nbytes
        if peer not in self._lost:
            self._pending_total -= 1
        if op.bulk:
            self._bulk_active -= 1
        if posted:
            self._posted_sends[peer] -= 1
        if op.datatype is not None:
            op.datatype.Free()

    def _post_data_recv(self, peer: int, buf: bytearray, op: _DataRecv | None = None) -> None:
        """Post a TAG_DATA receive from ``peer`` into ``buf``; ``op``: a completed receive of that peer,
        already out of its queue, whose record is reused (saves making one per message)."""
        if op is None:
            op = _DataRecv(peer, buf)
        else:
            op.buf = buf
            op.done = False
            op.tracked = False
        op.req = self._comm.Irecv(buf, peer, TAG_DATA)
        q = self._data_recvs[peer]
        q.append(op)
        if len(q) == 1:
            op.tracked = True
            self._requests.add(op.req, op)

    def _repost_recvs(self) -> None:
        """Post again the receives whose small messages were copied out (``_repost``). The next test of
        requests does it, not the poll that received them: the thread that waited for such a message
        goes on at once (to answer it, say), and MPI keeps what arrives meanwhile until a receive is
        posted. Those of a peer lost meanwhile stay unposted."""
        repost = self._repost
        lost = self._lost
        while repost:
            op = repost.pop()
            if op.peer not in lost:
                self._post_data_recv(op.peer, op.buf, op)

    def _post_ctrl_recv(self, peer: int, buf: bytearray) -> None:
        op = _CtrlRecv(peer, buf)
        op.req = self._comm.Irecv(buf, peer, TAG_CTRL)
        q = self._ctrl_recvs[peer]
        q.append(op)
        if len(q) == 1:
            op.tracked = True
            self._requests.add(op.req, op)

    def _advance_recvs(self, q: Any, handle: Any) -> None:
        """Handle the completed receives at the head of one peer's data or control queue, in posting
        order, and put the new head into the request table.

        Only the oldest receive of each queue is tracked: MPI matches a peer's messages (same tag)
        to receives in posting order, so the others cannot be delivered before it anyway, and
        ``Testsome`` then runs over a few requests instead of ``buffer_count`` per peer (34 requests
        with the defaults cost ~20 us per poll, a request ~0.5 us). The next receive is tested
        directly (``Test``, ~1 us) when it becomes the head, so a burst is taken in one poll."""
        while q:
            op = q[0]
            if not op.done:
                if op.tracked:
                    return
                try:
                    flag = op.req.Test()
                except self._MPI.Exception as e:
                    q.popleft()
                    self._lose(op.peer, f"MPI error on a {type(op).__name__.strip('_')} request: "
                                        f"{e.Get_error_string()}")
                    return
                if not flag:
                    op.tracked = True
                    self._requests.add(op.req, op)
                    return
                op.done = True
                self._heard[op.peer] = time.monotonic()
            q.popleft()
            handle(op)

    def _untracked_recvs(self) -> list[tuple[Any, Any]]:
        """``(request, op)`` of the posted receives not in the request table (behind their head)."""
        return [(op.req, op) for qs in (self._data_recvs, self._ctrl_recvs) for q in qs
                for op in q if not op.tracked and not op.done]

    # --- the progress engine ------------------------------------------------------------------------

    def _backoff(self, idle: float) -> float:
        """Seconds to sleep between polls after ``idle`` seconds without work."""
        if idle < self._busy_poll:
            return 0.0
        if idle < 0.01:
            return 5e-5
        if idle < 1.0:
            return 5e-4
        return 2e-3

    def _poll(self) -> bool:
        """One pass: returned buffers and credit, request completions, credit flush, callbacks."""
        if self._in_poll:
            raise TwisternetError("MPIChannel.progress was called from inside a handler callback")
        if self._owner_thread is not None:
            self._check_thread()
        self._in_poll = True
        try:
            did = False
            if self._released:
                self._drain_released()
                did = True
            completed = False
            if self._requests.active or self._repost:
                completed = self._test_once()
                if completed and self._pre_early:
                    self._await_pre_headers()
            if self._slot_deferred:         # messages waiting for a slot: wait no longer?
                now = time.monotonic()
                for peer in [p for p in self._slot_deferred if self._slot_wait_until[p] <= now]:
                    self._slot_run_deferred(peer)
            if completed or self._events:
                did = True
                self._dispatch()
                if self._released:  # consumers that release inside on_message: return it now
                    self._drain_released()
            now = time.monotonic()
            returns = self._credit_returns
            if returns.pending and (not completed or returns.full or now - returns.oldest >= _CREDIT_MAX_DELAY):
                # (a poll that received a message returns only full or old batches: see CreditReturns)
                self._flush_credit(quiet=not completed)
                now = time.monotonic()
            if now >= self._next_liveness:
                self._liveness(now)
                if self._events:
                    did = True
                    self._dispatch()
            if did:
                self._last_activity = now
            return did
        finally:
            self._in_poll = False

    def _await_pre_headers(self) -> None:
        """A payload landed in a pre-posted receive before its header was read. The header left right
        behind it, so look again now instead of after a round through the caller."""
        limit = time.monotonic() + _PRE_HEADER_WAIT
        while self._pre_early and time.monotonic() < limit:
            self._test_once()

    def _test_once(self) -> bool:
        if self._repost:
            self._repost_recvs()
        got = self._requests.testsome()
        if got is None:
            return False
        done, failed = got
        if failed:
            self._requests_failed(failed)
        if not done:
            return False
        if len(done) == 1 and type(done[0]) is _DataRecv:
            # (the common case, a message from one peer, without the sets and loops below)
            op = done[0]
            op.done = True
            self._heard[op.peer] = time.monotonic()
            self._advance_recvs(self._data_recvs[op.peer], self._data_received)
            return True
        data_peers: set[int] = set()
        ctrl_peers: set[int] = set()
        for op in done:
            if op is None:
                continue
            cls = type(op)
            if cls is _DataRecv:
                op.done = True
                data_peers.add(op.peer)
            elif cls is _Send:
                self._send_done(op)
            elif cls is _BulkRecv:
                self._heard[op.peer] = time.monotonic()
                self._bulk_done(op)
            elif cls is _PreRecv:
                self._heard[op.peer] = time.monotonic()
                self._pre_done(op)
            elif cls is _CtrlRecv:
                op.done = True
                ctrl_peers.add(op.peer)
            elif cls is _Heartbeat:
                self._beat_busy[op.peer] = False
        if data_peers or ctrl_peers:
            now = time.monotonic()
            for peer in data_peers | ctrl_peers:
                self._heard[peer] = now
        for peer in ctrl_peers:
            self._advance_recvs(self._ctrl_recvs[peer], self._ctrl_received)
        for peer in data_peers:
            self._advance_recvs(self._data_recvs[peer], self._data_received)
        return True

    def _requests_failed(self, failed: list[tuple[Any, int]]) -> None:
        """Undo the bookkeeping of requests MPI reported failed, and report their peers lost."""
        MPI = self._MPI
        for op, err in failed:
            peer = op.peer
            cls = type(op)
            if cls is _Send:
                self._unaccount_send(op, True)
            elif cls is _DataRecv or cls is _CtrlRecv:
                try:
                    (self._data_recvs if cls is _DataRecv else self._ctrl_recvs)[peer].remove(op)
                except ValueError:
                    pass
            elif cls is _BulkRecv:
                self._bulk_pending[peer] -= 1
                self._bulk_active -= 1
            elif cls is _PreRecv:
                if op.incoming is not None:
                    self._bulk_pending[peer] -= 1
                    self._bulk_active -= 1
                elif op in self._pre_q[peer]:
                    self._pre_q[peer].remove(op)
            try:
                what = MPI.Get_error_string(err)
            except MPI.Exception:
                what = f"MPI error {err}"
            self._lose(peer, f"MPI error on a {cls.__name__.strip('_')} request: {what}")

    def _send_done(self, op: _Send) -> None:
        self._unaccount_send(op, True)
        if op.recycle:
            self._recycle_wire(op)
        peer = op.peer
        if self._sendq[peer] and peer not in self._lost:
            self._drain_sendq(peer)
        group = op.token
        if group is not None:
            if type(group) is _SendGroup:
                group.left -= 1
                if group.left or group.token is None:
                    return
                group = group.token
            self._events.append((self._handler.on_sent, (group,)))  # type: ignore[union-attr]

    def _flush_credit(self, quiet: bool) -> None:
        """Send the batched credit returns that are due (all of them when ``quiet``)."""
        for peer, items in self._credit_returns.due(quiet):
            for msg in _encode_credit(items):
                try:
                    self._submit(msg, TAG_CTRL, _Send(peer, msg), urgent=True)
                except self._MPI.Exception as e:
                    self._lose(peer, f"MPI error returning credit: {e.Get_error_string()}")
                    break
                self.stats["credit_msgs_sent"] += 1

    def _dispatch(self) -> None:
        """Run queued handler callbacks; one that raises leaves the rest queued for the next call."""
        events = self._events
        while events:
            fn, args = events.popleft()
            fn(*args)

