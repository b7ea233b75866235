"""Bookkeeping objects: one per outstanding MPI request (what a completed request slot was for), plus
the incoming-message record and the ``release`` callable handed out with each delivered message."""

from __future__ import annotations

from threading import get_ident
from typing import TYPE_CHECKING, Any

from twisternet.errors import TwisternetError

from .. import shm_slots

if TYPE_CHECKING:  # pragma: no cover
    from .state import MPIChannelState


# --- bookkeeping objects (one per outstanding MPI request) ------------------------------------------

class _DataRecv:
    """A pre-posted TAG_DATA receive into a pool buffer; completes strictly in posting order per peer.
    ``req``: its MPI request; ``tracked``: whether it is in the request table (only the oldest
    receive of each peer is, see :meth:`RequestsMixin._advance_recvs`)."""
    __slots__ = ("peer", "buf", "done", "req", "tracked")

    def __init__(self, peer: int, buf: bytearray) -> None:
        self.peer = peer
        self.buf = buf
        self.done = False
        self.req: Any = None
        self.tracked = False


class _CtrlRecv:
    """A pre-posted TAG_CTRL receive; like data receives, handled strictly in posting order per peer
    (MPI matches a peer's messages to them in that order; Testsome reports them by request slot).
    ``req`` and ``tracked`` as for :class:`_DataRecv`."""
    __slots__ = ("peer", "buf", "done", "req", "tracked")

    def __init__(self, peer: int, buf: bytearray) -> None:
        self.peer = peer
        self.buf = buf
        self.done = False
        self.req: Any = None
        self.tracked = False


class _Incoming:
    """A rendezvous message whose payload is arriving; ``ready`` once it may be delivered."""
    __slots__ = ("peer", "edge", "data", "release", "ready", "left")

    def __init__(self, peer: int, edge: int, data: Any, release: _Release, ready: bool, left: int = 0) -> None:
        self.peer = peer
        self.edge = edge
        self.data = data
        self.release = release
        self.ready = ready
        self.left = left  # segments still arriving


class _SendGroup:
    """The segments of one rendezvous send: ``on_sent(token)`` once all of them completed."""
    __slots__ = ("token", "left")

    def __init__(self, token: object, left: int) -> None:
        self.token = token
        self.left = left


class _BulkRecv:
    __slots__ = ("peer", "incoming")

    def __init__(self, peer: int, incoming: _Incoming) -> None:
        self.peer = peer
        self.incoming = incoming


class _PreRecv:
    """A payload receive posted before its header arrived (see MPIChannel._pre_offer): ``cap`` bytes
    at ``store[start:]``, with room before ``start`` for an inline first segment."""
    __slots__ = ("peer", "store", "start", "cap", "done", "incoming", "skip")

    def __init__(self, peer: int, store: Any, start: int, cap: int) -> None:
        self.peer = peer
        self.store = store
        self.start = start
        self.cap = cap
        self.done = False
        self.incoming: _Incoming | None = None  # set by the header that claims it
        self.skip = False                       # used up by a skip, or cancelled: only recycle it


class _Send:
    """An outstanding Isend: keeps the sent buffers (and datatype) alive until MPI is done with them.
    ``nbytes``: the bytes of message payload it carries (0 for headers and control messages), which
    count in :meth:`MPIChannel.pending_bytes` until it completes. ``recycle``: ``keep`` is a view of a
    buffer of the channel's wire cache, returned to it when the send completes."""
    __slots__ = ("peer", "keep", "datatype", "token", "bulk", "nbytes", "recycle")

    def __init__(self, peer: int, keep: Any, datatype: Any = None, token: object = None,
                 bulk: bool = False, nbytes: int = 0, recycle: bool = False) -> None:
        self.peer = peer
        self.keep = keep
        self.datatype = datatype
        self.token = token
        self.bulk = bulk
        self.nbytes = nbytes
        self.recycle = recycle


class _Heartbeat(_Send):
    """A heartbeat in MPI: at most one per peer at a time (a frozen peer must not collect them)."""

    __slots__ = ()


class _Release:
    """The ``release`` callable handed out with a message: returns its credit (and buffer) once.

    ``buf`` is the receive buffer the message was delivered in when the channel may recycle it: a
    pool buffer (``pool``), the buffer an eager message was copied into (``copy``) or a rendezvous
    buffer; ``slot``: the shared-memory slot it was delivered in."""
    __slots__ = ("channel", "peer", "edge", "cost", "buf", "pool", "copy", "slot", "done")

    def __init__(self, channel: MPIChannelState, peer: int, edge: int, cost: int, buf: Any, pool: bool,
                 slot: shm_slots.OwnedSlot | None = None, *, copy: bool = False) -> None:
        self.channel = channel
        self.peer = peer
        self.edge = edge
        self.cost = cost
        self.buf = buf
        self.pool = pool
        self.copy = copy
        self.slot = slot
        self.done = False

    def __call__(self) -> None:
        if self.done:
            raise TwisternetError(f"message from rank {self.peer} on edge {self.edge} was released twice")
        self.done = True
        ch = self.channel
        if self.buf is None and self.slot is None and ch._in_poll and ch._poll_owner == get_ident():
            # released by its handler inside the poll that delivered it (a copied-out message: only
            # credit to return): owed at once, as _drain_released would at the end of that poll
            ch._owe(self.peer, self.edge, self.cost)
            return
        ch._released.append(self)
        ch._wake.set()
