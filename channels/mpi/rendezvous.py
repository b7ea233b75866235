"""Rendezvous: messages larger than ``buffer_size``. The sender posts a header and then each segment
zero-copy on ``TAG_BULK``; the receiver posts one receive per segment once it reads the header and
delivers the message, in order on its (peer, edge), when every segment is in."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from twisternet.channel import Buffer

from .records import _BulkRecv, _Incoming, _Release, _Send, _SendGroup
from .state import MPIChannelState
from .wire import (
    _FLAG_INLINE,
    _FLAG_PRE,
    _HDR,
    _INLINE_MAX,
    _MAX_BLOCK,
    _PAGE,
    _U32,
    TAG_BULK,
    TAG_DATA,
    TAG_PRE,
    _pre_cap,
    _rndv_header,
    _rndv_inline,
    _rndv_lengths,
)

log = logging.getLogger(__name__)


class RendezvousMixin(MPIChannelState):
    """Rendezvous sends and the completion of their payload receives.

    A mixin of :class:`~channels.mpi.channel.MPIChannel`, not an object of its own: its
    sends go through the channel's send queue and pre-posted receives, and completed payloads are
    delivered in the channel's per-(peer, edge) order, shared with eager and slot messages."""

    def _send_rendezvous(self, peer: int, edge: int, views: list[memoryview], segments: list[Buffer],
                         size: int, token: object) -> None:
        """Send a message larger than a buffer: its header, then its ``segments`` zero-copy on TAG_BULK
        (or into the peer's pre-posted receive on TAG_PRE); ``on_sent`` once MPI is done with them."""
        MPI = self._MPI
        dtype = None
        if len(segments) > self._max_segments:
            # Too many to announce: one non-contiguous send (zero-copy, but MPI pipelines
            # it through small chunks, so it is slower than contiguous segments).
            dtype = self._gather_type([v for v in views if v.nbytes])
            segments = [dtype]
            lengths = [size]
            self.stats["noncontiguous_sent"] += 1
        else:
            lengths = [memoryview(seg).nbytes for seg in segments]
        page = 0
        if dtype is None:
            big = max(range(len(lengths)), key=lengths.__getitem__)
            page = (MPI.Get_address(segments[big]) - sum(lengths[:big])) % _PAGE
        inline: Buffer = b""
        if (dtype is None and len(segments) > 1 and lengths[0] <= _INLINE_MAX
                and _HDR.size + _U32.size + 8 * len(lengths) + lengths[0] <= self._pool_buf_size):
            # A small first segment (typically the codec's head before a large array) rides in
            # the header: one MPI message less each way per message.
            inline = segments[0]
            segments = segments[1:]
        inline_n = lengths[0] if inline else 0
        group = _SendGroup(token, len(segments))
        pre = False
        if dtype is None and len(segments) == 1:
            # The peer places its pre-posted receive like our previous payload within a page;
            # a payload placed otherwise goes the usual way (placed by its header) instead.
            bpage = (page + (lengths[0] if inline else 0)) % _PAGE
            pre = (bpage == self._pre_page_sent[peer] and bool(self._pre_offers[peer])
                   and self._pre_fits(peer, lengths[-1]))
            self._pre_page_sent[peer] = bpage
        if pre:
            # The payload first: it can land in the receive the peer posted for it before
            # the peer has even read the header.
            seg = segments[0]
            self._submit([seg, MPI.BYTE], TAG_PRE, _Send(peer, seg, None, group, True, memoryview(seg).nbytes))
            hdr = _rndv_header(edge, size, lengths, page, inline, _FLAG_PRE)
            self._submit(hdr, TAG_DATA, _Send(peer, hdr, nbytes=inline_n))
            self._pre_used[peer] += 1
            self.stats["pre_sent"] += 1
            segments = []
        else:
            hdr = _rndv_header(edge, size, lengths, page, inline)
            self._submit(hdr, TAG_DATA, _Send(peer, hdr, nbytes=inline_n))
        if dtype is not None:
            self._submit([MPI.BOTTOM, 1, dtype], TAG_BULK, _Send(peer, views, dtype, group, True, size))
        else:
            for seg in segments:
                self._submit([seg, MPI.BYTE], TAG_BULK, _Send(peer, seg, None, group, True, memoryview(seg).nbytes))
        self.stats["rendezvous_sent"] += 1

    def _gather_type(self, views: list[memoryview]) -> Any:
        """An hindexed byte datatype (relative to MPI.BOTTOM) that spans ``views`` in order."""
        MPI = self._MPI
        lengths: list[int] = []
        addrs: list[int] = []
        for v in views:
            base = MPI.Get_address(v)
            n = v.nbytes
            off = 0
            while off < n:
                step = min(_MAX_BLOCK, n - off)
                lengths.append(step)
                addrs.append(base + off)
                off += step
        return MPI.BYTE.Create_hindexed(lengths, addrs).Commit()

    def _rndv_received(self, peer: int, buf: bytearray, flags: int, page: int, edge: int, size: int) -> None:
        """A rendezvous header from ``peer`` (in the pool buffer ``buf``): post one receive per segment
        into a (recycled) buffer placed like the sender's payload within a page, and queue the message
        on its (peer, edge) until the segments are in; or hand it to the pre-posted receive it went to."""
        if flags & _FLAG_PRE:
            self._pre_claim(peer, buf, flags, page, edge, size)
            return
        lengths = _rndv_lengths(buf, size)
        bulk = lengths[-1] if len(lengths) == 2 - (not flags & _FLAG_INLINE) else 0
        # A payload of one segment makes us offer pre-posted receives (_pre_offer): take a buffer
        # one of them can use next, so it is recycled rather than a fresh one faulted in.
        store = self._bulk_cache.take(max(size, _pre_cap(bulk) + _INLINE_MAX) + _PAGE)
        skip = (page - self._MPI.Get_address(store)) % _PAGE
        target = store[skip:skip + size]
        off = 0
        if flags & _FLAG_INLINE:
            start = _rndv_inline(buf, lengths, peer)
            off = lengths[0]
            target[:off] = memoryview(buf)[start:start + off]
            lengths = lengths[1:]
        self._post_data_recv(peer, buf)
        inc = _Incoming(peer, edge, target.data, _Release(self, peer, edge, size, store, False),
                        False, len(lengths))
        key = (peer, edge)
        q = self._order.get(key)
        if q is None:
            q = self._order[key] = deque()
        q.append(inc)
        BYTE = self._MPI.BYTE
        first = off
        for n in lengths:
            self._post(self._comm.Irecv([target[off:off + n], BYTE], peer, TAG_BULK), _BulkRecv(peer, inc))
            off += n
        self._bulk_pending[peer] += len(lengths)
        if self._slot_grow(peer, size):
            self._pre_page[peer] = (page + first) % _PAGE
        elif bulk:
            self._pre_offer(peer, bulk, (page + first) % _PAGE)

    def _bulk_done(self, op: _BulkRecv) -> None:
        inc = op.incoming
        self._bulk_pending[op.peer] -= 1
        self._bulk_active -= 1
        inc.left -= 1
        if inc.left:
            return
        self._ready(inc)

    def _ready(self, inc: _Incoming) -> None:
        """``inc``'s payload is complete: deliver it and whatever waited for it on its (peer, edge)."""
        inc.ready = True
        self.stats["msgs_received"] += 1
        self.stats["bytes_received"] += inc.data.nbytes
        key = (inc.peer, inc.edge)
        q = self._order.get(key)
        on_message = self._handler.on_message  # type: ignore[union-attr]
        if not q:  # not queued behind an earlier message (a payload read into a pre-posted receive)
            self._events.append((on_message, (inc.peer, inc.edge, inc.data, inc.release)))
            return
        while q and q[0].ready:
            m = q.popleft()
            self._events.append((on_message, (m.peer, m.edge, m.data, m.release)))
        if not q:
            self._order.pop(key, None)

