"""TCP channel: a full mesh of non-blocking sockets (Unix-domain between peers on one host).

Every connection, to the master and between peers, first passes the job-token challenge
(:func:`twisternet.auth.handshake`); then frames flow both ways (:mod:`channels.tcp.wire`).
Modules: ``mesh`` builds the links, ``channel`` drives them, ``receive`` reads and frames; ``peer``,
``credit``, ``liveness``, ``accept`` and ``poller`` each own one part of the state (large receive buffers
are kept in the channels' shared ``channels.buffers.BufferCache``).
"""

from __future__ import annotations

from .accept import MAX_PENDING_HANDSHAKES, LateConnections
from .channel import BULK_WAIT as _BULK_WAIT  # noqa: F401  (private names: tests drive a channel by hand)
from .channel import TCPChannel
from .credit import CreditLedger
from .liveness import Liveness
from .mesh import build_mesh, create_channel
from .mesh import tune as _tune  # noqa: F401
from .peer import Peer
from .peer import Peer as _Peer  # noqa: F401
from .poller import Poller
from .wire import ABORT, BYE, CREDIT, DATA, DATA_CREDIT, HEADER_SIZE, HEARTBEAT
from .wire import HDR as _HDR  # noqa: F401

__all__ = [
           "ABORT",
           "BYE",
           "CREDIT",
           "DATA",
           "DATA_CREDIT",
           "HEADER_SIZE",
           "HEARTBEAT",
           "MAX_PENDING_HANDSHAKES",
           "CreditLedger",
           "LateConnections",
           "Liveness",
           "Peer",
           "Poller",
           "TCPChannel",
           "build_mesh",
           "create_channel",
]
