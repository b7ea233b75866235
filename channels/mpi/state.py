"""The state every part of the MPI channel shares, declared once so that each part (a mixin of
:class:`~channels.mpi.channel.MPIChannel`) is type-checked on its own.

``MPIChannel.__init__`` makes all of it; this class only declares it: annotations, no values, so it adds
nothing at run time. The methods one part calls on another are declared under ``TYPE_CHECKING`` (their
bodies live in the part that owns them).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

if TYPE_CHECKING:
    from twisternet.channel import Buffer, ChannelHandler
    from twisternet.config import Config

    from .. import shm_slots
    from ..buffers import BufferCache
    from .credit import CreditLedger, CreditReturns
    from .doorbell import Doorbell
    from .records import _BulkRecv, _CtrlRecv, _DataRecv, _Incoming, _PreRecv, _Release, _Send
    from .requests import RequestTable
    from .watchdog import ProgressWatchdog


class MPIChannelState:
    """Declarations of the attributes (and cross-part methods) of an MPIChannel; see the module doc."""

    # twisternet.channel.Channel
    rank: int
    world: int
    config: Config
    stats: dict[str, int]
    # the communicator and its limits
    _MPI: Any
    _comm: Any
    hosts: list[str]
    _eager_limit: int
    _pool_buf_size: int
    _copy_limit: int
    _max_segments: int
    _spare_cap: int
    _spares: list[bytearray]
    _busy_poll: float
    # life cycle and the poll (requests.py, channel.py)
    _handler: ChannelHandler | None
    _started: bool
    _closed: bool
    _owner_thread: int | None
    _in_poll: bool
    _poll_lock: threading.Lock
    _poll_owner: int
    _wake: Doorbell
    _events: deque[tuple[Callable[..., None], tuple[Any, ...]]]
    _requests: RequestTable
    _released: deque[_Release]
    # credit (credit.py)
    _credit_ledger: CreditLedger
    _credit_returns: CreditReturns
    # receives (receive.py) and rendezvous (rendezvous.py)
    _data_recvs: list[deque[_DataRecv]]
    _repost: list[_DataRecv]
    _ctrl_recvs: list[deque[_CtrlRecv]]
    _order: dict[tuple[int, int], deque[_Incoming]]
    _bulk_pending: list[int]
    _bulk_active: int
    _bulk_cache: BufferCache
    _copy_cache: BufferCache
    _wire_cache: BufferCache
    # pre-posted receives (preposted.py)
    _pre_cap: list[int]
    _pre_posted: list[int]
    _pre_q: list[deque[_PreRecv]]
    _pre_page: list[int]
    _pre_total: int
    _pre_early: int
    _pre_budget: int
    _pre_offers: list[deque[tuple[int, int]]]
    _pre_used: list[int]
    _pre_page_sent: list[int]
    # sends
    _pending_sends: list[int]
    _pending_total: int
    _pending_bytes: list[int]
    _posted_sends: list[int]
    _sendq: list[deque[tuple[Any, int, _Send]]]
    # shared-memory slots (slots.py)
    _slot_peers: set[int]
    _slots_in: shm_slots.SlotOwner
    _slots_out: shm_slots.SlotUser
    _slot_slow: list[bool]
    _slot_prefer: list[bool]
    _slot_probes: list[int]
    _slot_want_last: list[bool]
    _slot_wait_until: list[float]
    _slot_deferred: dict[int, tuple[int, list[memoryview], list[Buffer], int, object]]
    _slot_blocked: set[int]
    _split_in: dict[tuple[int, int], _Incoming]
    # liveness (liveness.py)
    _peer_timeout: float
    _hb_interval: float
    _heard: list[float]
    _beat_sent: list[float]
    _beat_busy: list[bool]
    _next_liveness: float
    _liveness_at: float
    _watchdog: ProgressWatchdog | None
    _bye_from: set[int]
    _bye_sent: bool
    _lost: dict[int, str]

    if TYPE_CHECKING:
        # channel.py
        def _check_thread(self) -> None: ...
        def _check_usable(self) -> None: ...
        def _recycle_wire(self, op: _Send) -> None: ...
        # requests.py
        def _post(self, req: Any, op: Any) -> None: ...
        def _post_ctrl_recv(self, peer: int, buf: bytearray) -> None: ...
        def _post_data_recv(self, peer: int, buf: bytearray, op: _DataRecv | None = None) -> None: ...
        def _submit(self, spec: Any, tag: int, op: _Send, urgent: bool = False) -> None: ...
        def _test_once(self) -> bool: ...
        def _unaccount_send(self, op: _Send, posted: bool) -> None: ...
        def _untracked_recvs(self) -> list[tuple[Any, Any]]: ...
        # receive.py
        def _ctrl_received(self, op: _CtrlRecv) -> None: ...
        def _data_received(self, op: _DataRecv) -> None: ...
        def _drain_released(self) -> None: ...
        def _owe(self, peer: int, edge: int, cost: int) -> None: ...
        # rendezvous.py
        def _bulk_done(self, op: _BulkRecv) -> None: ...
        def _ready(self, inc: _Incoming) -> None: ...
        def _rndv_received(self, peer: int, buf: bytearray, flags: int, page: int, edge: int, size: int) -> None: ...
        def _send_rendezvous(self, peer: int, edge: int, views: list[memoryview], segments: list[Buffer],
                             size: int, token: object) -> None: ...
        # preposted.py
        def _pre_claim(self, peer: int, buf: bytearray, flags: int, page: int, edge: int, size: int) -> None: ...
        def _pre_done(self, op: _PreRecv) -> None: ...
        def _pre_drop(self, peer: int) -> None: ...
        def _pre_fits(self, peer: int, n: int) -> bool: ...
        def _pre_offer(self, peer: int, n: int, page: int) -> None: ...
        def _pre_rearm(self, peer: int) -> None: ...
        # slots.py
        def _slot_control(self, peer: int, kind: int, body: Any) -> None: ...
        def _slot_drop_deferred(self, peer: int) -> None: ...
        def _slot_filled(self, peer: int, buf: bytearray, flags: int, edge: int, size: int) -> None: ...
        def _slot_grow(self, peer: int, size: int) -> bool: ...
        def _slot_half_done(self, peer: int, slot_id: int) -> None: ...
        def _slot_run_deferred(self, peer: int, give_up: bool = False) -> None: ...
        def _slot_tell(self, peer: int, actions: list[tuple[str, Any]]) -> None: ...
        # liveness.py
        def _liveness(self, now: float) -> None: ...
        def _lose(self, peer: int, reason: str) -> None: ...
