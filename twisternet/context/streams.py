"""The per-(peer, edge) streams of a Context and the tags its messages carry on the wire.

A message on a channel starts with one tag byte: ``_BATCH`` (a pool buffer of packed records),
``_DIRECT`` (one record, sent zero-copy), or ``_TAGGED`` (a new edge tag, then one of the other two; see
the ``twisternet.context`` package doc). Outgoing messages queue per (peer, edge) in an
:class:`_OutStream`; incoming records wait per (source, edge) in an :class:`_InStream` until their
handler takes them, and the credit of their message goes back once the last of them is taken
(:class:`_MsgRef`).
"""

from __future__ import annotations

import struct
from collections import deque
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from ..channel import CONTROL_EDGE_BASE, Buffer
from ..framing import BufferPool, Packer, Unpacker

if TYPE_CHECKING:
    from .state import ContextState

Handler = Callable[[int, Any], bool]
_BATCH = b"\x00"
_DIRECT = b"\x01"
#: Prefix of a message that starts a new edge tag on its stream: ``_TAGGED, epoch (u32), len (u16),
#: fingerprint (utf-8)``, then the message's own tag and payload.
_TAGGED = b"\x02"
_TAG_HEAD = struct.Struct("<IH")
#: The tag of an edge nobody tagged (raw handlers, control edges): never stamped on the wire.
_NO_TAG: tuple[int, str] = (0, "")
#: Control edge on which a closing rank tells every peer it is done (see Context.close).
_LEAVE_EDGE = CONTROL_EDGE_BASE + 3
#: Control edge on which a rank tells a peer that its records on an edge belong to another operation.
_MISMATCH_EDGE = CONTROL_EDGE_BASE + 4
#: Control edge on which a rank that lost a peer tells the others which one (before it may fail and exit
#: itself): they then name that rank, the first lost, and not the one that left in reaction.
_CAUSE_EDGE = CONTROL_EDGE_BASE + 5


class _Mark:
    """In a stream's pending records: the records after it carry edge tag ``tag`` (epoch, fingerprint)."""

    __slots__ = ("tag",)

    def __init__(self, tag: tuple[int, str]) -> None:
        self.tag = tag


def _stamp_bytes(tag: tuple[int, str]) -> bytes:
    fp = tag[1].encode()[:65535]
    return _TAGGED + _TAG_HEAD.pack(tag[0] & 0xFFFFFFFF, len(fp)) + fp


class _Sent:
    """Set once the channel has finished with a zero-copy message. Waiters do not block on it: they
    wait for the engine's notify (which follows every ``on_sent``) and re-check, so a plain flag does
    (a threading.Event costs a Condition and a lock, ~6 us, per large message)."""

    __slots__ = ("flag",)

    def __init__(self) -> None:
        self.flag = False

    def set(self) -> None:
        self.flag = True

    def is_set(self) -> bool:
        return self.flag


class _OutMsg:
    __slots__ = ("parts", "nbytes", "pool_buf", "done")

    def __init__(self, parts: list[Buffer], nbytes: int, pool_buf: bytearray | None,
                 done: _Sent | None) -> None:
        self.parts = parts
        self.nbytes = nbytes
        self.pool_buf = pool_buf
        self.done = done


class _OutStream:
    __slots__ = ("peer", "edge", "packer", "queue", "queued_bytes", "tag", "stamp")

    def __init__(self, peer: int, edge: int, pool: BufferPool) -> None:
        self.peer = peer
        self.edge = edge
        self.packer = Packer(pool)
        self.queue: deque[_OutMsg] = deque()
        self.queued_bytes = 0
        self.tag = _NO_TAG                   # the edge tag the receiver knows this stream by
        self.stamp: bytes | None = None      # the new tag, for the next message queued


class _MsgRef:
    """Counts the records of one received message still undelivered; releases credit at zero."""

    __slots__ = ("count", "release", "views")

    def __init__(self, release: Callable[[], None]) -> None:
        self.count = 0
        self.release = release
        self.views = True    # whether its records may hold views of the (reusable) receive buffer

    def done_one(self) -> None:
        self.count -= 1
        if self.count == 0:
            self.release()


class _InStream:
    __slots__ = ("src", "edge", "unpacker", "pending", "tag", "local_tag")

    def __init__(self, src: int, edge: int) -> None:
        self.src = src
        self.edge = edge
        self.unpacker = Unpacker()
        self.pending: deque[tuple[Any, _MsgRef | None]] = deque()   # (record, ref) or (_Mark, None)
        self.tag = _NO_TAG          # tag of the records being delivered (the last _Mark passed)
        self.local_tag = _NO_TAG    # this rank's own sends to itself: tag of the last one queued


class _LocalRef(_MsgRef):
    """Accounting of a record sent to this same rank (no channel, so no credit): bytes held per edge."""

    __slots__ = ("ctx", "edge", "nbytes")

    def __init__(self, ctx: ContextState, edge: int, nbytes: int) -> None:
        super().__init__(self._free)
        self.ctx, self.edge, self.nbytes = ctx, edge, nbytes
        self.count = 1
        self.views = False   # decoded from a private copy that is never reused

    def _free(self) -> None:
        with self.ctx._lock:
            self.ctx._local_bytes[self.edge] -= self.nbytes
