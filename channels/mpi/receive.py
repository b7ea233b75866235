"""Messages as MPI hands them over, in posting order per peer: data headers (eager payloads are
delivered here, the other kinds handed to their protocol), control messages, and released
messages whose buffers and credit go back."""

from __future__ import annotations

import logging
import sys
from typing import Any

from twisternet.errors import ProtocolError

from ..buffers import MIN_KEPT
from .records import _CtrlRecv, _DataRecv, _Incoming, _Release
from .state import MPIChannelState
from .wire import (
    _ANSWERS,
    _HDR,
    _FLAG_CREDIT,
    _KIND_ABORT,
    _KIND_BYE,
    _KIND_EAGER,
    _KIND_OFFER,
    _KIND_RNDV,
    _KIND_SLOT,
    _KIND_SLOT_ANSWER,
    _KIND_SLOT_DONE,
    _KIND_SLOT_GRANT,
    _KIND_SLOT_OFFER,
    _KIND_SLOT_RETIRE,
    _PIGGY_ONE,
    _PIGGY_ONE_END,
    _decode_ctrl,
    _decode_piggy,
)

log = logging.getLogger(__name__)


class ReceiveMixin(MPIChannelState):
    """Arriving data and control messages, and released messages.

    A mixin of :class:`~channels.mpi.channel.MPIChannel`, not an object of its own: it is the
    dispatcher that hands each message kind to its protocol part, all of which it calls."""

    def _data_received(self, op: _DataRecv) -> None:
        """A TAG_DATA message (taken in posting order): deliver, or start its rendezvous, or note a BYE."""
        peer = op.peer
        buf = op.buf
        kind, flags, page, edge, size = _HDR.unpack_from(buf, 0)
        if peer in self._lost:
            log.debug("rank %d: message of kind %d from lost rank %d dropped", self.rank, kind, peer)
            return
        if peer in self._bye_from:
            log.error("rank %d: message of kind %d from rank %d after its goodbye; dropped", self.rank, kind, peer)
            return
        if kind == _KIND_EAGER:
            if size > self._eager_limit:
                raise ProtocolError(f"eager message of {size} bytes from rank {peer} exceeds {self._eager_limit}")
            cost = size or 1
            off = _HDR.size
            if flags & _FLAG_CREDIT:
                n = c_edge = c_bytes = 0
                if _PIGGY_ONE_END + size <= len(buf):
                    n, c_edge, c_bytes = _PIGGY_ONE.unpack_from(buf, off)
                if n == 1:
                    # (what _decode_piggy and _credit_back do with one entry, the common case)
                    off = _PIGGY_ONE_END
                    unblocked, excess = self._credit_ledger.returned((peer, c_edge), c_bytes)
                    if excess or unblocked:
                        self._credit_checked(peer, c_edge, c_bytes, unblocked, excess)
                else:
                    off, items = _decode_piggy(buf, size, peer)
                    self._credit_back(peer, items)
            if size < MIN_KEPT:
                data = memoryview(bytes(memoryview(buf)[off:off + size]))
                # posted again by the next test of requests (see _repost_recvs): no Irecv between the
                # message and the return of the poll that delivered it
                self._repost.append(op)
                rel = _Release(self, peer, edge, cost, None, True)
            elif size <= self._copy_limit:
                # Copied into a recycled buffer (returned to the cache on release, handed out again once
                # nothing refers to it): a poll takes a burst of such messages before their handlers
                # free them, and fresh copies then cost a page fault per page (65 a 256 KB message,
                # ~8x the copy; 1.4 GB/s at 256 KB where MPI moves 13).
                store = self._copy_cache.take(size)
                data = store.data[:size]
                data[:] = memoryview(buf)[off:off + size]
                self._repost.append(op)
                rel = _Release(self, peer, edge, cost, store, False, copy=True)
            else:
                data = memoryview(buf)[off:off + size]
                self._post_data_recv(peer, self._spares.pop() if self._spares else bytearray(self._pool_buf_size))
                rel = _Release(self, peer, edge, cost, buf, True)
            self.stats["msgs_received"] += 1
            self.stats["bytes_received"] += size
            q = self._order.get((peer, edge))
            if q:
                q.append(_Incoming(peer, edge, data, rel, True))
            else:
                self._events.append((self._handler.on_message, (peer, edge, data, rel)))  # type: ignore[union-attr]
        elif kind == _KIND_RNDV:
            self._rndv_received(peer, buf, flags, page, edge, size)
        elif kind == _KIND_SLOT:
            self._slot_filled(peer, buf, flags, edge, size)
        elif kind == _KIND_SLOT_DONE:
            self._post_data_recv(peer, buf)
            self._slot_half_done(peer, edge)
        elif kind == _KIND_SLOT_ANSWER:
            self._post_data_recv(peer, buf)
            answer = _ANSWERS.get(flags)
            if answer is None:
                raise ProtocolError(f"unknown slot answer {flags} from rank {peer}")
            self._slots_in.answered(peer, answer, edge)
            if answer == "retired":
                self.stats["slots_retired"] += 1
        elif kind == _KIND_BYE:
            log.debug("rank %d: goodbye from rank %d", self.rank, peer)
            self._bye_from.add(peer)
            self._pre_drop(peer)
            self._slots_in.drop_peer(peer)
            self._slots_out.drop_peer(peer)
            if peer in self._slot_deferred:
                log.warning("rank %d: rank %d said goodbye; a message for it was still waiting for a "
                            "slot and is dropped", self.rank, peer)
            self._slot_drop_deferred(peer)
            self._credit_returns.drop(peer)
        else:
            raise ProtocolError(f"unknown message kind {kind} from rank {peer}")

    def _ctrl_received(self, op: _CtrlRecv) -> None:
        peer = op.peer
        buf = op.buf
        kind, body = _decode_ctrl(buf)
        if kind == _KIND_ABORT:
            reason = body
            self._lose(peer, f"rank {peer} aborted: {reason}" if reason else f"rank {peer} aborted")
            return
        if kind == _KIND_OFFER:
            first, cap = body
            offers = self._pre_offers[peer]
            if offers and (first < offers[-1][0] or cap <= offers[-1][1]) or not offers and first != 0:
                raise ProtocolError(f"rank {peer} offered pre-posted receives ({first}, {cap}) after {list(offers)}")
            offers.append((first, cap))
            body = ()
        elif kind in (_KIND_SLOT_OFFER, _KIND_SLOT_GRANT, _KIND_SLOT_RETIRE):
            if peer not in self._bye_from:
                self._slot_control(peer, kind, body)
            body = ()
        self._credit_back(peer, body)
        if peer not in self._lost and not self._closed:
            self._post_ctrl_recv(peer, buf)

    def _credit_back(self, peer: int, items: Any) -> None:
        """``peer`` returned credit ``[(edge, bytes), ...]`` (in a control message or piggybacked)."""
        ledger = self._credit_ledger
        for edge, nbytes in items:
            unblocked, excess = ledger.returned((peer, edge), nbytes)
            if excess or unblocked:
                self._credit_checked(peer, edge, nbytes, unblocked, excess)

    def _credit_checked(self, peer: int, edge: int, nbytes: int, unblocked: bool, excess: bool) -> None:
        """What the ledger said of ``nbytes`` returned by ``peer`` on ``edge``: more than was in flight
        (``excess``: logged), or a refused send may now go (``unblocked``: the handler hears of it)."""
        if excess:
            log.error("rank %d: rank %d returned %d bytes of credit on edge %d, more than in flight",
                      self.rank, peer, nbytes, edge)
        if unblocked:
            self._events.append((self._handler.on_credit, (peer, edge)))  # type: ignore[union-attr]

    def _owe(self, peer: int, edge: int, cost: int) -> None:
        """``cost`` bytes of a message from ``peer`` on ``edge`` were released: credit owed to it
        (returned with the next batch or piggybacked), unless it left or was lost."""
        if peer not in self._bye_from and peer not in self._lost:
            self._credit_returns.add(peer, edge, cost)

    def _drain_released(self) -> None:
        released = self._released
        spares = self._spares
        slot_news: dict[int, list[tuple[str, Any]]] = {}
        while released:
            rel = released.popleft()
            if rel.slot is not None:
                news = self._slots_in.released(rel.slot)
                rel.slot = None
                if news:
                    slot_news.setdefault(rel.peer, []).extend(news)
            elif rel.buf is not None:
                buf = rel.buf
                rel.buf = None
                # Recycle a buffer only if nothing but this frame refers to it: the consumer may keep
                # zero-copy views (e.g. decoded numpy arrays) after release, and those must stay intact.
                if sys.getrefcount(buf) <= 2:
                    if rel.pool:
                        if len(spares) < self._spare_cap:
                            spares.append(buf)
                    else:
                        (self._copy_cache if rel.copy else self._bulk_cache).put(buf)
                del buf
                if not rel.pool and not rel.copy and self._pre_cap[rel.peer]:
                    self._pre_rearm(rel.peer)   # most likely into the buffer just returned
            self._owe(rel.peer, rel.edge, rel.cost)
        for peer, news in slot_news.items():
            self._slot_tell(peer, news)

