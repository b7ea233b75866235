"""The TCP channel's receiving side: reading a peer's socket, cutting its bytes into frames, and acting
on each frame (a mixin of :class:`~channels.tcp.channel.TCPChannel`).

Small frames are read into the peer's staging buffer, as many per ``recv_into`` as the socket has; a
payload larger than half of it (or one that arrives in pieces) is received straight into a buffer of its
own (kept for reuse in a ``channels.buffers.BufferCache``), so large messages are copied once, by the
kernel.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from twisternet.errors import ProtocolError

from .peer import STAGING, Peer
from .poller import IN
from .wire import (ABORT, BYE, CREDIT, CREDIT_ENTRY, DATA, DATA_CREDIT, HDR, HEADER_SIZE, MAX_FRAME, WITH_PAYLOAD,
                   check_header)

if TYPE_CHECKING:
    from twisternet.channel import ChannelHandler

    from ..buffers import BufferCache
    from .credit import CreditLedger


class TCPReceive:
    """Reading and framing; the state it uses is made by ``TCPChannel.__init__``."""

    _handler: ChannelHandler | None
    _ledger: CreditLedger
    _recv_buffers: BufferCache

    if TYPE_CHECKING:   # the channel's own, in channel.py
        def _broken(self, p: Peer, reason: str, *, placed: bool = False) -> None: ...
        def _eof(self, p: Peer) -> None: ...
        def _bulk_wait(self, p: Peer, events: int, until: float) -> float: ...

    def _read(self, p: Peer, wait: bool = True) -> bool:
        did = False
        reads = 0
        until = 0.0
        # bounded, so one busy peer cannot starve the others: at most 64 reads, or one large payload
        # (while it arrives, ``wait`` lets us wait up to BULK_WAIT for it on this socket alone)
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
            until = self._bulk_wait(p, IN, until)
            if not until:
                break
        return did

    def _parse(self, p: Peer) -> None:
        buf = p.rbuf
        pos = 0
        end = p.rlen
        mv = memoryview(buf)
        while end - pos >= HEADER_SIZE:
            kind, edge, length = HDR.unpack_from(buf, pos)
            if (kind != DATA and (kind != DATA_CREDIT or length < CREDIT_ENTRY.size)) or length > MAX_FRAME:
                check_header(p.rank, kind, length)     # (raises for a bad one; the rest are rare kinds)
            if kind not in WITH_PAYLOAD:
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
            if length > STAGING // 2 or have > 0:
                store = self._recv_buffers.take(length)
                self._recv_buffers.put(store)     # reused once the core holds no view of it any more
                cur = store.data[:length]
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

    def _frame(self, p: Peer, kind: int, edge: int, length: int, data: memoryview) -> None:
        h = self._handler
        if kind == DATA:
            if h is not None:
                h.on_message(p.rank, edge, data, self._ledger.releaser(p.rank, edge, length))
        elif kind == DATA_CREDIT:    # (length >= CREDIT_ENTRY.size: see check_header)
            c_edge, c_bytes = CREDIT_ENTRY.unpack_from(data)
            self._ledger.returned((p.rank, c_edge), c_bytes)
            n = length - CREDIT_ENTRY.size
            if h is not None:
                h.on_credit(p.rank, c_edge)
                h.on_message(p.rank, edge, data[CREDIT_ENTRY.size:], self._ledger.releaser(p.rank, edge, n))
        elif kind == CREDIT:
            self._ledger.returned((p.rank, edge), length)
            if h is not None:
                h.on_credit(p.rank, edge)
        elif kind == BYE:
            p.left = True
        elif kind == ABORT:
            self._broken(p, f"it failed: {bytes(data).decode('utf-8', 'replace')}")
        # HEARTBEAT: last_recv already updated
