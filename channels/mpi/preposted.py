"""Pre-posted payload receives (``TAG_PRE``): a receiver that sees one-segment rendezvous payloads
from a peer offers receives posted before their header arrives, so MPI can copy the next payload
the moment it lands. See the comment block in :class:`PrepostedMixin` for the protocol."""

from __future__ import annotations

import logging
from collections import deque

from twisternet.errors import ProtocolError

from .records import _Incoming, _PreRecv, _Release, _Send
from .state import MPIChannelState
from .wire import (
    _FLAG_INLINE,
    _FLAG_PRE,
    _FLAG_SKIP,
    _HDR,
    _INLINE_MAX,
    _KIND_RNDV,
    _PAGE,
    TAG_CTRL,
    TAG_DATA,
    TAG_PRE,
    _encode_offer,
    _pre_cap,
    _rndv_inline,
    _rndv_lengths,
)

log = logging.getLogger(__name__)


#: Most pre-posted skips a sender sends to reach a receive big enough for its payload.
_MAX_SKIPS = 2


class PrepostedMixin(MPIChannelState):
    """Pre-posted payload receives, sender and receiver side (``_pre_*`` state).

    A mixin of :class:`~channels.mpi.channel.MPIChannel`, not an object of its own: a
    pre-posted receive is a request in the channel's table, recycles buffers of the channel's
    cache and delivers into the channel's per-(peer, edge) order."""

    def _pre_fits(self, peer: int, n: int) -> bool:
        """Whether a payload of ``n`` bytes can go into ``peer``'s next pre-posted receive. If that one
        is too small but a later offer is big enough and at most ``_MAX_SKIPS`` receives away, the
        smaller ones are used up first with empty sends (skips)."""
        offers = self._pre_offers[peer]
        used = self._pre_used[peer]
        while len(offers) > 1 and offers[1][0] <= used:
            offers.popleft()
        first, cap = offers[0]
        if first > used:
            return False
        if n <= cap:
            return True
        for first, cap in list(offers)[1:]:
            if cap >= n:
                if first - used > _MAX_SKIPS:
                    return False
                skip = _HDR.pack(_KIND_RNDV, _FLAG_PRE | _FLAG_SKIP, 0, 0, 0)
                for _ in range(first - used):
                    self._submit([b"", self._MPI.BYTE], TAG_PRE, _Send(peer, b""))
                    self._submit(skip, TAG_DATA, _Send(peer, skip))
                    self.stats["pre_skips"] += 1
                self._pre_used[peer] = first
                return True
        return False

    # --- pre-posted payload receives -----------------------------------------------------------------
    #
    # A rendezvous payload is normally received only once its header has been read, so the copy waits
    # for the receiver's Python between "header arrived" and "Irecv posted". For a peer that sends
    # payloads of one segment, the receiver instead keeps a payload receive posted ahead on TAG_PRE
    # (into a recycled buffer placed like the last payload within a page), so MPI can copy the next
    # payload the moment it arrives. The sender must know the receive is big enough: the receiver
    # offers, by a control message, "pre-posted receives number `first` on have room for `cap` bytes"
    # (cap only grows; a sender too big for the next receive uses it up with an empty send, a *skip*,
    # when a big enough one follows within _MAX_SKIPS), and the sender flags the header of each payload
    # it sent that way. MPI's non-overtaking rule matches the n-th TAG_PRE send with the n-th TAG_PRE
    # receive, and the headers say which messages those are. At most one receive per peer is posted
    # ahead (re-posted when its buffer comes back), others are posted when their header arrives, so
    # correctness never depends on timing. Offers are bounded in total by ``memory_limit`` and never
    # withdrawn; a peer's goodbye or loss cancels the receive posted ahead for it.

    def _pre_offer(self, peer: int, n: int, page: int) -> None:
        """A payload of ``n`` bytes in one segment (at ``page`` within a page) came from ``peer``
        without a pre-posted receive: offer receives big enough for it from now on, if memory allows."""
        self._pre_page[peer] = page
        have = self._pre_cap[peer]
        if n <= have or n < self._eager_limit or self._bye_sent or peer in self._bye_from or peer in self._lost:
            return
        cap = _pre_cap(n)
        if self._pre_total + cap - have > self._pre_budget:
            return
        msg = _encode_offer(self._pre_posted[peer], cap)
        try:
            self._submit(msg, TAG_CTRL, _Send(peer, msg), urgent=True)
        except self._MPI.Exception as e:
            self._lose(peer, f"MPI error offering pre-posted receives: {e.Get_error_string()}")
            return
        self._pre_total += cap - have
        self._pre_cap[peer] = cap

    def _post_pre(self, peer: int, cap: int) -> _PreRecv:
        """Post ``peer``'s next pre-posted receive, of ``cap`` bytes."""
        store = self._bulk_cache.take(cap + _INLINE_MAX + _PAGE)
        start = _INLINE_MAX + (self._pre_page[peer] - self._MPI.Get_address(store) - _INLINE_MAX) % _PAGE
        op = _PreRecv(peer, store, start, cap)
        self._post(self._comm.Irecv([store[start:start + cap], self._MPI.BYTE], peer, TAG_PRE), op)
        self._pre_posted[peer] += 1
        return op

    def _pre_claim(self, peer: int, buf: bytearray, flags: int, page: int, edge: int, size: int) -> None:
        """A header whose payload went to ``peer``'s next pre-posted receive (posted now if it was not)."""
        q = self._pre_q[peer]
        if flags & _FLAG_SKIP:
            self._post_data_recv(peer, buf)
            op = q.popleft() if q else self._post_pre(peer, 0)
            op.skip = True
            if op.done:
                self._pre_early -= 1
                self._pre_recycle(op)
            return
        lengths = _rndv_lengths(buf, size)
        off = 0
        if flags & _FLAG_INLINE:
            start = _rndv_inline(buf, lengths, peer)
            off = lengths[0]
            if len(lengths) != 2:
                raise ProtocolError(f"pre-posted rendezvous header from rank {peer} announces {len(lengths)} segments")
        elif len(lengths) != 1:
            raise ProtocolError(f"pre-posted rendezvous header from rank {peer} announces {len(lengths)} segments")
        n = lengths[-1]
        op = q.popleft() if q else self._post_pre(peer, n)
        if op.done:
            self._pre_early -= 1
        if n > op.cap:
            raise ProtocolError(f"rank {peer} sent {n} bytes to a pre-posted receive of {op.cap}")
        store = op.store
        op.store = None
        target = store[op.start - off:op.start + n]
        if off:
            target[:off] = memoryview(buf)[start:start + off]
        self._post_data_recv(peer, buf)
        self._pre_page[peer] = (page + off) % _PAGE
        self.stats["pre_received"] += 1
        self._slot_grow(peer, size)
        inc = _Incoming(peer, edge, memoryview(target), _Release(self, peer, edge, size, store, False), op.done)
        key = (peer, edge)
        order = self._order.get(key)
        if not op.done:
            op.incoming = inc
            inc.left = 1
            self._bulk_pending[peer] += 1
            self._bulk_active += 1
        elif not order:
            self._ready(inc)
            return
        if order is None:
            order = self._order[key] = deque()
        order.append(inc)
        if op.done:
            self._ready(inc)

    def _pre_done(self, op: _PreRecv) -> None:
        op.done = True
        if op.skip:
            self._pre_recycle(op)
            return
        inc = op.incoming
        if inc is None:
            self._pre_early += 1
            return  # its header has not been read yet; it claims the payload
        op.incoming = None
        self._bulk_pending[op.peer] -= 1
        self._bulk_active -= 1
        inc.left = 0
        self._ready(inc)

    def _pre_recycle(self, op: _PreRecv) -> None:
        if op.store is not None:
            self._bulk_cache.put(op.store)
            op.store = None

    def _pre_rearm(self, peer: int) -> None:
        """Post ``peer``'s next receive ahead of its header, if it has an offer and none is posted."""
        if (self._pre_cap[peer] and not self._pre_q[peer] and not self._closed
                and peer not in self._bye_from and peer not in self._lost):
            try:
                self._pre_q[peer].append(self._post_pre(peer, self._pre_cap[peer]))
            except self._MPI.Exception as e:
                self._lose(peer, f"MPI error posting a receive: {e.Get_error_string()}")

    def _pre_drop(self, peer: int) -> None:
        """``peer`` left or was lost: cancel the receives posted ahead for it (they complete as
        cancelled and their buffers are recycled) and give its offer's memory back."""
        self._pre_total -= self._pre_cap[peer]
        self._pre_cap[peer] = 0
        self._pre_offers[peer].clear()
        q = self._pre_q[peer]
        while q:
            op = q.popleft()
            op.skip = True
            if op.done:
                self._pre_early -= 1
                self._pre_recycle(op)
                continue
            self._requests.cancel(op)

