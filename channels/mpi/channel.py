"""The :class:`MPIChannel` class, which composes the protocol parts of this package into one
:class:`~twisternet.channel.Channel`, and :func:`create_channel`, which builds it."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Sequence

from twisternet.bootstrap.addresses import host_id
from twisternet.channel import MAX_EDGE, Buffer, Channel, ChannelHandler
from twisternet.config import busy_poll_seconds
from twisternet.errors import ClosedError, ConfigError, PeerLostError, TwisternetError
from twisternet.topology import ranks_on_this_kernel

from .. import shm_slots
from ..buffers import MAX_BUFFERS, MIN_KEPT, BufferCache
from .credit import CreditLedger, CreditReturns
from .doorbell import Doorbell
from .launch import (
    _OPEN_CHANNELS,
    _import_mpi,
    _install_abort_hook,
    _level_name,
    _register_exit_hooks,
)
from .liveness import _LIVENESS_TICK, LivenessMixin
from .preposted import PrepostedMixin
from .receive import ReceiveMixin
from .records import _CtrlRecv, _DataRecv, _Incoming, _PreRecv, _Release, _Send
from .rendezvous import RendezvousMixin
from .requests import _MAX_POSTED_SENDS, RequestsMixin, RequestTable
from .slots import SlotsMixin
from .watchdog import ProgressWatchdog
from .wire import (
    _CREDIT_ENTRY,
    _CTRL_BUF_SIZE,
    _FLAG_CREDIT,
    _PIGGY_MAX,
    _HDR,
    _HDR_PIGGY_ONE,
    _KIND_BYE,
    _KIND_EAGER,
    _U32,
    TAG_DATA,
    _byte_view,
    _encode_piggy,
    _segments,
)

if TYPE_CHECKING:  # pragma: no cover - typing only; importing mpi4py initialises MPI
    from twisternet.config import Config

log = logging.getLogger(__name__)


_CTRL_RECVS_PER_PEER = 2
#: Bytes the most credit entries an eager message can carry take (see wire._FLAG_CREDIT).
_PIGGY_ROOM = _U32.size + _PIGGY_MAX * _CREDIT_ENTRY.size


class MPIChannel(ReceiveMixin, RendezvousMixin, PrepostedMixin, SlotsMixin, RequestsMixin,
                 LivenessMixin, Channel):
    """Channel over mpi4py ``Isend``/``Irecv`` with pre-posted receives, rendezvous for large messages
    and per (peer, edge) byte credits. Build it with :func:`create_channel`."""

    name = "mpi"
    #: progress/send/flush_released hold the channel's poll lock (see RequestsMixin.progress).
    thread_safe_progress = True

    def __init__(self, config: Config, comm: Any, MPI: Any) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size(), config)
        self._MPI = MPI
        #: Thread level MPI granted (an ``MPI.THREAD_*`` constant).
        self.thread_level: int = MPI.Query_thread()
        #: True when MPI gave less than THREAD_SERIALIZED: every call must come from the thread that
        #: initialised MPI, which means manual progress from that thread.
        self.requires_main_thread_progress: bool = self.thread_level < MPI.THREAD_SERIALIZED
        self._comm = comm.Dup()
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._comm.Set_name(f"twisternet-mpi<{comm.Get_name()}>")
        # Receive buffers and credits are sized from the config on both ends: all ranks must agree.
        mine = (config.buffer_size, config.buffer_count)
        # Each rank's host (MPI's processor name) rides along, so a lost peer's error can name it, and
        # its host id (twisternet.bootstrap.host_id), so that every rank knows alike which ranks share a
        # host (twisternet.topology.from_channel) without an exchange per operation.
        gathered = self._comm.allgather((mine, MPI.Get_processor_name(), host_id()))
        every = [g[0] for g in gathered]
        #: Host of every rank of the communicator, by rank.
        self.hosts: list[str] = [str(g[1]) for g in gathered]
        #: Host id of every rank, by rank: equal ids share a host (and a network namespace).
        self.host_ids: list[str] = [str(g[2]) for g in gathered]
        if any(v != mine for v in every):
            self._comm.Free()
            raise ConfigError("buffer_size", "every rank must use the same buffer_size and buffer_count; "
                              f"(buffer_size, buffer_count) by rank: {every}")

        self._eager_limit = config.buffer_size
        # the largest message send_small takes: one whose header may carry piggybacked credit
        self._small_limit = self._eager_limit - _PIGGY_ROOM
        self._pool_buf_size = config.buffer_size + _HDR.size
        # Eager messages at most this big are copied out of the pool buffer (posted again by the next poll);
        # bigger ones are handed out zero-copy and the pool slot gets a spare buffer. Either way a
        # held buffer carries at least half its size in credit, so memory stays within 2x the credit.
        self._copy_limit = config.buffer_size // 2
        # Segments a rendezvous header can announce in one pool buffer.
        self._max_segments = (self._pool_buf_size - _HDR.size - _U32.size) // 8
        self._credit = config.buffer_size * config.buffer_count
        self._credit_ledger = CreditLedger(self._credit)
        self._credit_returns = CreditReturns(max(1, self._credit // 4))
        npeers = max(1, self.world - 1)
        self._recvs_per_peer = max(1, min(config.buffer_count, config.pool_buffers // npeers))
        self._spare_cap = config.pool_buffers

        self._handler: ChannelHandler | None = None
        self._started = False
        self._closed = False
        self._owner_thread: int | None = None
        self._in_poll = False
        # Whoever polls or sends holds this (see RequestsMixin.progress), so any thread may drive the
        # channel; ``_poll_owner``: the thread holding it (0: none).
        self._poll_lock = threading.Lock()
        self._poll_owner = 0
        # busy_poll_us -1 (auto): the 1 ms window this channel has always polled after activity, unless
        # the ranks on this machine (whatever namespace each is in) outnumber its cores or the machine
        # is busy: then a polling rank takes the core (and its engine thread the GIL) from the one whose
        # message it waits for
        here = ranks_on_this_kernel(self.host_ids, self.rank)
        self._busy_poll = busy_poll_seconds(config, here, auto=1e-3)

        self._requests = RequestTable(MPI)

        # Receive side.
        self._data_recvs: list[deque[_DataRecv]] = [deque() for _ in range(self.world)]
        # Receives whose small messages were copied out, to post again at the next test of requests
        # (see RequestsMixin._repost_recvs)
        self._repost: list[_DataRecv] = []
        self._ctrl_recvs: list[deque[_CtrlRecv]] = [deque() for _ in range(self.world)]
        self._order: dict[tuple[int, int], deque[_Incoming]] = {}
        self._spares: list[bytearray] = []
        self._bulk_pending = [0] * self.world
        # Rendezvous payloads moving (either direction): MPI needs frequent polls to pipeline them.
        self._bulk_active = 0
        self._released: deque[_Release] = deque()
        # Pre-posted payload receives (see _pre_offer): capacity offered per peer (0: none), receives
        # posted so far, the posted ones no header has claimed yet, where in a page the peer's payloads
        # start, and the total capacity offered (bounded by memory_limit).
        self._pre_cap = [0] * self.world
        self._pre_posted = [0] * self.world
        self._pre_q: list[deque[_PreRecv]] = [deque() for _ in range(self.world)]
        self._pre_page = [0] * self.world
        self._pre_total = 0
        self._pre_early = 0     # payloads received whose header has not been read yet
        self._pre_budget = config.memory_limit

        # Send side.
        self._pending_sends = [0] * self.world
        self._pending_total = 0  # over peers not lost (sends to a lost peer may never complete)
        self._pending_bytes = [0] * self.world  # message bytes in those sends (see pending_bytes)
        self._posted_sends = [0] * self.world
        self._sendq: list[deque[tuple[Any, int, _Send]]] = [deque() for _ in range(self.world)]
        # Offers of pre-posted receives from each peer: (first receive number, capacity), and how
        # many of that peer's pre-posted receives we have used.
        self._pre_offers: list[deque[tuple[int, int]]] = [deque() for _ in range(self.world)]
        self._pre_used = [0] * self.world
        self._pre_page_sent = [-1] * self.world  # where in a page our last payload to each peer sat

        # Shared-memory landing slots (channels.shm_slots) between ranks on one host: ours, which peers
        # fill (_slots_in), and the peers' we fill (_slots_out).
        shared = bool(config.mpi_shared_memory) and shm_slots.supported()
        on_host = self._node_peers()   # collective: every rank calls it, whatever its own config says
        self._slot_peers = on_host if shared else set()
        if self._slot_peers:
            shm_slots.sweep_stale()
        self._slots_in = shm_slots.SlotOwner(budget=config.memory_limit, max_cap=config.memory_limit // 2)
        self._slots_out = shm_slots.SlotUser(enabled=shared)
        self._slot_slow = [False] * self.world   # a wait for a grant from that peer timed out
        self._slot_prefer = [True] * self.world  # wait for the slot of our previous message to that peer
        self._slot_probes = [0] * self.world     # sends since preferring it stopped paying off
        self._slot_want_last = [False] * self.world  # the deferred messages wait for that slot
        self._slot_wait_until = [0.0] * self.world   # messages for that peer wait for a slot till then
        # The large message waiting for a slot to come back, per peer (at most one: a second one sends
        # both through MPI, see _slot_send); smaller messages on its edge are refused meanwhile, and
        # the peers for which one was get on_credit once it has left (_slot_blocked).
        self._slot_deferred: dict[int, tuple[int, list[memoryview], list[Buffer], int, object]] = {}
        self._slot_blocked: set[int] = set()
        self._split_in: dict[tuple[int, int], _Incoming] = {}   # (peer, slot): split message being copied in

        # Liveness (as the TCP channel): when each peer was last heard from (any completed receive),
        # when we last sent it a heartbeat, and whether that heartbeat is still in MPI.
        self._peer_timeout = config.peer_timeout
        self._hb_interval = config.heartbeat_interval
        self._heard = [0.0] * self.world
        self._beat_sent = [0.0] * self.world
        self._beat_busy = [False] * self.world
        self._next_liveness = float("inf")
        self._liveness_at = time.monotonic()
        self._watchdog: ProgressWatchdog | None = None

        # Peer state.
        self._bye_from: set[int] = set()
        self._bye_sent = False
        self._lost: dict[int, str] = {}

        # Handler callbacks waiting to run (so an exception in one never corrupts channel state).
        self._events: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()

        self._wake = Doorbell()
        self._last_activity = time.monotonic()
        _OPEN_CHANNELS.add(self)
        #: Counters for tests and benchmarks.
        self.stats: dict[str, int] = {"msgs_sent": 0, "bytes_sent": 0, "msgs_received": 0,
                                      "bytes_received": 0, "eager_sent": 0, "rendezvous_sent": 0,
                                      "credit_msgs_sent": 0, "credit_piggybacked": 0, "send_refused": 0,
                                      "rndv_buffers_reused": 0, "copy_buffers_reused": 0, "wire_buffers_reused": 0,
                                      "noncontiguous_sent": 0,
                                      "pre_sent": 0, "pre_skips": 0, "pre_received": 0,
                                      "slot_sent": 0, "slot_received": 0, "slot_offers": 0,
                                      "slots_retired": 0, "slot_waits": 0, "slot_wait_timeouts": 0,
                                      "slot_deferred": 0, "slot_refused": 0, "slot_split": 0}
        # Recycled rendezvous buffers (see .buffers), bounded like the TCP channel's idle receive
        # buffers: at least one buffer of the largest message a program exchanges (up to twice
        # memory_limit) is kept, so a stream of 256 MB messages does not pay 65536 page faults each.
        self._bulk_cache = BufferCache(max(4 * self._credit, 2 * config.memory_limit), stats=self.stats,
                                       stat="rndv_buffers_reused")
        # Recycled buffers of the eager messages copied out of their pool buffers (from 64 KB, see
        # ReceiveMixin._data_received): as many as a poll can take in one burst, the pool's receives.
        # The same for the wire buffers of eager messages of 64 KB and up (see _eager_wire), returned
        # when MPI completes their sends: as many as may be posted and queued for one peer.
        self._wire_cache = BufferCache(self._credit, max(MAX_BUFFERS, 2 * _MAX_POSTED_SENDS), stats=self.stats,
                                       stat="wire_buffers_reused")
        self._copy_cache = BufferCache(self._credit, max(MAX_BUFFERS, config.pool_buffers), stats=self.stats,
                                       stat="copy_buffers_reused")

    def _node_peers(self) -> set[int]:
        """The other ranks of the communicator on this host (collective: ``MPI_Comm_split_type``)."""
        MPI = self._MPI
        try:
            node = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        except MPI.Exception as e:
            log.debug("rank %d: cannot tell which ranks share this host: %s", self.rank, e)
            return set()
        mine = node.Get_group()
        world = self._comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(mine, list(range(node.Get_size())), world)
        finally:
            mine.Free()
            world.Free()
            node.Free()
        return {r for r in ranks if r not in (self.rank, MPI.UNDEFINED)}

    # --- public API -----------------------------------------------------------------------------

    @property
    def comm(self) -> Any:
        """The channel's private communicator (a dup of the one it was built on)."""
        return self._comm

    def start(self, handler: ChannelHandler) -> None:
        """Check the thread level, pre-post the receives for every peer and begin delivering."""
        if self._started:
            raise TwisternetError("MPIChannel.start called twice")
        if self._closed:
            raise ClosedError("MPI channel is closed")
        MPI = self._MPI
        if self.requires_main_thread_progress:
            level = _level_name(MPI, self.thread_level)
            if self.config.progress != "manual" or not MPI.Is_thread_main():
                raise ConfigError(
                    "progress",
                    f"MPI provides only {level}, so the channel may only be driven from the thread that "
                    "initialised MPI: use progress='manual' and call progress from that thread (or "
                    "initialise MPI with THREAD_SERIALIZED or THREAD_MULTIPLE)")
            self._owner_thread = threading.get_ident()
        self._handler = handler
        for peer in range(self.world):
            if peer == self.rank:
                continue
            for _ in range(self._recvs_per_peer):
                self._post_data_recv(peer, bytearray(self._pool_buf_size))
            for _ in range(_CTRL_RECVS_PER_PEER):
                self._post_ctrl_recv(peer, bytearray(_CTRL_BUF_SIZE))
        now = time.monotonic()
        self._heard = [now] * self.world
        self._beat_sent = [now] * self.world
        self._next_liveness = now + min(self._hb_interval, _LIVENESS_TICK)
        self._liveness_at = now
        self._started = True
        if self.config.progress == "thread":   # a progress thread runs the liveness pass every tick
            self._watchdog = ProgressWatchdog(self, 2 * self._peer_timeout)
            self._watchdog.start()
        log.debug("MPI channel rank %d/%d started (thread level %s, %d eager receives per peer)",
                  self.rank, self.world, _level_name(MPI, self.thread_level), self._recvs_per_peer)

    def send(self, peer: int, edge: int, parts: Sequence[Buffer], token: object = None) -> bool:
        """Post one message for ``peer`` on ``edge``; False (nothing queued) when it lacks credit.
        Thread-safe: waits for a poll of another thread to finish (one poll, never its wait)."""
        return self._as_poll_owner(threading.get_ident(), self._send, peer, edge, parts, token)

    def _as_poll_owner(self, me: int, fn: Callable[..., bool], *args: Any) -> bool:
        """``fn(*args)`` with the poll lock held by thread ``me`` (already, or taken for the call)."""
        if self._poll_owner == me:
            return fn(*args)
        with self._poll_lock:
            self._poll_owner = me
            try:
                return fn(*args)
            finally:
                self._poll_owner = 0

    def _send(self, peer: int, edge: int, parts: Sequence[Buffer], token: object) -> bool:
        self._check_usable()
        if not isinstance(peer, int) or not 0 <= peer < self.world or peer == self.rank:
            raise ValueError(f"peer must be a rank in [0, {self.world}) other than {self.rank}, got {peer!r}")
        if not isinstance(edge, int) or not 0 <= edge < MAX_EDGE:
            raise ValueError(f"edge must be an int in [0, 2**31), got {edge!r}")
        if peer in self._lost:
            raise PeerLostError(peer, self._lost[peer])
        if peer in self._bye_from:
            raise ClosedError(f"rank {peer} has closed its channel; it accepts no more messages")
        if self._bye_sent:
            raise ClosedError("MPI channel is closing")
        views = [_byte_view(p) for p in parts]
        size = sum(v.nbytes for v in views)
        cost = size or 1
        key = (peer, edge)
        held = self._slot_deferred.get(peer)
        if held is not None and held[0] == edge and size <= self._eager_limit:
            # a large message on this edge waits for a slot: this one may not overtake it
            self._slot_blocked.add(peer)
            self.stats["send_refused"] += 1
            self.stats["slot_refused"] += 1
            return False
        if not self._credit_ledger.fits(key, cost):
            self.stats["send_refused"] += 1
            return False
        MPI = self._MPI
        try:
            if size <= self._eager_limit:
                # credit we owe the peer rides along if the message is sent now (no queue to wait behind)
                wire, _ = self._eager_wire(peer, edge, size, views, piggy=(
                    not self._sendq[peer] and self._posted_sends[peer] < _MAX_POSTED_SENDS
                    and size + _PIGGY_ROOM <= self._eager_limit))
                self._submit(wire, TAG_DATA, _Send(peer, wire, nbytes=size, recycle=type(wire) is memoryview))
                if token is not None:  # the parts were copied: reusable now (reported by progress)
                    self._events.append((self._handler.on_sent, (token,)))  # type: ignore[union-attr]
                self.stats["eager_sent"] += 1
            else:
                segments = _segments(views)
                if not (peer in self._slot_peers and self._slot_send(peer, edge, views, segments, size, token)):
                    self._send_rendezvous(peer, edge, views, segments, size, token)
        except MPI.Exception as e:
            self._lose(peer, f"MPI error sending to it: {e.Get_error_string()}")
            raise PeerLostError(peer, self._lost[peer]) from e
        # (read again: a slot send may have polled and taken credit returns in meanwhile)
        self._credit_ledger.charge(key, cost)
        self.stats["msgs_sent"] += 1
        self.stats["bytes_sent"] += size
        return True

    def _eager_wire(self, peer: int, edge: int, size: int, parts: Sequence[Buffer],
                    piggy: bool) -> tuple[bytes | memoryview, list[tuple[int, int]] | None]:
        """An eager message's wire bytes: its header, the credit owed to ``peer`` if ``piggy`` (taken
        from what is owed, and returned as the second item), then the ``size`` bytes of ``parts``.
        From ``MIN_KEPT`` bytes on, a view of a buffer of the wire cache (see ``_recycle_wire``), else bytes."""
        returns = self._credit_returns
        items = None
        if not piggy or peer not in returns.pending:
            head = _HDR.pack(_KIND_EAGER, 0, 0, edge, size)
        else:
            items = returns.take(peer, _PIGGY_MAX)
            self.stats["credit_piggybacked"] += 1
            if len(items) == 1:     # (the common case: one edge's credit, packed with the header)
                ((e, n),) = items
                head = _HDR_PIGGY_ONE.pack(_KIND_EAGER, _FLAG_CREDIT, 0, edge, size, 1, e, n)
            else:
                head = _HDR.pack(_KIND_EAGER, _FLAG_CREDIT, 0, edge, size) + _encode_piggy(items)
        if size < MIN_KEPT:
            return b"".join((head, *parts)), items
        # A fresh buffer this large costs a page fault per page (the freed ones go back to the system
        # when a burst of them is released at once); the cache's are reused once MPI is done with them.
        views = [_byte_view(p) for p in parts]
        total = len(head) + sum(v.nbytes for v in views)
        wire = self._wire_cache.take(total).data[:total]
        wire[:len(head)] = head
        pos = len(head)
        for v in views:
            wire[pos:pos + v.nbytes] = v
            pos += v.nbytes
        return wire, items

    def _recycle_wire(self, op: _Send) -> None:
        """MPI is done with the eager message ``op`` (``op.recycle``) sent: its buffer back to the wire
        cache (handed out again only once nothing else refers to it)."""
        self._wire_cache.put(op.keep.obj)

    def idle(self, peer: int, edge: int) -> bool:
        return (0 <= peer < self.world and not self._sendq[peer] and not self._credit_ledger.in_flight.get((peer, edge))
                and peer not in self._slot_deferred)

    #: On. It was off for a while: with the core writing small records through send_small, a partial
    #: barrier's release to one rank was lost in 2 of 8 runs under heavy load. The release came from
    #: rank 0's service timer thread after rank 0 had entered close(), and Context.send refused it
    #: there; send_small only changed the timing. That is fixed (Context.send_while_leaving).
    can_send_small = True

    def send_small(self, peer: int, edge: int, parts: Sequence[Buffer], nbytes: int) -> bool:
        # One eager Isend of a copy, if idle (see idle): what send() does for such a message, without
        # the checks the idle link, the state tested in _send_small and the caller (the Context: a
        # valid peer and edge, ``nbytes`` the parts' size) already settle. Nothing in flight on the
        # edge, so the credit rule lets it go (twisternet.channel.fits_credit).
        me = threading.get_ident()
        if (not 0 <= peer < self.world or peer == self.rank or nbytes > self._small_limit
                or (self._owner_thread is not None and me != self._owner_thread)):
            return False
        return self._as_poll_owner(me, self._send_small, peer, edge, parts, nbytes)

    def _send_small(self, peer: int, edge: int, parts: Sequence[Buffer], nbytes: int) -> bool:
        """:meth:`send_small` once it holds the poll lock (the state it tests cannot change meanwhile:
        a send queued for the peer since, say, must not be overtaken): the header (with the credit
        owed to ``peer``) and the parts joined in one buffer, one ``Isend``; in the request table only
        if MPI did not finish it at once."""
        if (self._sendq[peer] or peer in self._slot_deferred or self._credit_ledger.in_flight.get((peer, edge))
                or self._posted_sends[peer] >= _MAX_POSTED_SENDS or peer in self._lost or peer in self._bye_from
                or self._bye_sent or self._closed or not self._started):
            return False
        wire, items = self._eager_wire(peer, edge, nbytes, parts, piggy=True)
        if len(wire) - _HDR.size - (_U32.size + len(items) * _CREDIT_ENTRY.size if items else 0) != nbytes:
            for e, n in items or ():
                self._credit_returns.add(peer, e, n)    # still owed
            raise ValueError(f"send_small: the parts hold {sum(memoryview(p).nbytes for p in parts)} bytes, "
                             f"not the {nbytes} given")
        try:
            # (what _submit does, for a peer whose send queue is empty and below its limit of posted
            # sends, as tested above: no bookkeeping object unless MPI did not finish it at once)
            req = self._comm.Isend(wire, peer, TAG_DATA)
            op = _Send(peer, wire, nbytes=nbytes, recycle=type(wire) is memoryview)
            if not req.Test():
                self._track_send(req, op)
            elif op.recycle:
                self._recycle_wire(op)
        except self._MPI.Exception as e:
            self._lose(peer, f"MPI error sending to it: {e.Get_error_string()}")
            raise PeerLostError(peer, self._lost[peer]) from e
        self._credit_ledger.charge((peer, edge), nbytes or 1)
        stats = self.stats
        stats["eager_sent"] += 1
        stats["msgs_sent"] += 1
        stats["bytes_sent"] += nbytes
        return True

    def flush_released(self) -> None:
        """Return what the handlers just released (slots are granted back at once: their sender may
        be waiting for one); credit joins the usual batches."""
        if self._released and not self._in_poll and self._started and not self._closed:
            self._check_thread()
            me = threading.get_ident()
            if self._poll_owner == me:
                self._drain_released()
                return
            with self._poll_lock:
                self._poll_owner = me
                try:
                    if not self._closed:
                        self._drain_released()
                finally:
                    self._poll_owner = 0

    def wakeup(self) -> None:
        """Cut a waiting :meth:`progress` short. Thread-safe; never calls MPI."""
        self._wake.set()

    def has_pending(self, peer: int | None = None) -> bool:
        """Whether sends to ``peer`` (or to anyone) have not completed yet; sends to a lost peer
        do not count (they may never complete)."""
        if peer is None:
            return self._pending_total > 0
        return self._pending_sends[peer] > 0 and peer not in self._lost

    def pending_bytes(self, peer: int | None = None) -> int:
        """Bytes of messages handed to :meth:`send` (for ``peer``, or for anyone) that MPI has not
        finished sending yet: queued, posted, or waiting for a shared-memory slot. An eager message
        counts until MPI completes its send; a message copied into a peer's shared-memory slot is in
        that peer's memory and no longer counts (the part of a split one that goes through MPI does).
        Sends to a lost peer do not count. The coflow scheduler keeps this below ``coflow_inflight``."""
        if peer is None:
            return sum(n for p, n in enumerate(self._pending_bytes) if p not in self._lost)
        return self._pending_bytes[peer] if peer not in self._lost else 0

    def close(self, timeout: float) -> None:
        """Flush, say goodbye to every peer, wait (bounded) for theirs, then free all MPI resources."""
        if self._closed_before_start():
            return
        self._check_thread()
        deadline = time.monotonic() + max(0.0, timeout)
        try:
            # Every accepted message is posted or queued, in order, and MPI keeps a peer's TAG_DATA
            # messages in order, so the goodbye can go at once: the peer sees it after all our
            # headers. Then one phase waits for our sends to complete, for every peer's goodbye and
            # for the payloads those peers announced before it.
            for peer in list(self._slot_deferred):   # through MPI now: nothing may follow the goodbye
                self._slot_run_deferred(peer, give_up=True)
            self._bye_sent = True
            bye = _HDR.pack(_KIND_BYE, 0, 0, 0, 0)
            for peer in self._live_peers():
                try:
                    self._submit(bye, TAG_DATA, _Send(peer, bye))
                except self._MPI.Exception as e:
                    self._lose(peer, f"MPI error saying goodbye: {e.Get_error_string()}")
            while time.monotonic() < deadline and (self._waiting_for_peers() or self.has_pending()):
                self.progress(min(0.01, max(0.0, deadline - time.monotonic())))
            if self.has_pending():
                unfinished = [p for p in range(self.world) if self.has_pending(p)]
                log.warning("rank %d: closing with sends to ranks %s not completed after %gs",
                            self.rank, unfinished, timeout)
            missing = self._waiting_for_peers()
            if missing:
                log.warning("rank %d: no goodbye from ranks %s within %gs; closing anyway",
                            self.rank, missing, timeout)
            self._dispatch()
        finally:
            self._teardown()

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError("MPI channel is closed")
        if not self._started:
            raise TwisternetError("MPIChannel.start(handler) must be called first")
        if self._owner_thread is not None:
            self._check_thread()

    def _check_thread(self) -> None:
        if self._owner_thread is not None and threading.get_ident() != self._owner_thread:
            raise TwisternetError(
                f"MPI provides only {_level_name(self._MPI, self.thread_level)}: the MPI channel must be "
                "driven from the thread that initialised MPI")


def create_channel(config: Config, *, comm: Any = None, rank: int | None = None,
                   world: int | None = None, **_launch_info: Any) -> MPIChannel:
    """Build the MPI channel on ``comm`` (default ``MPI.COMM_WORLD``), initialising MPI if needed.

    Collective over ``comm``: every rank must call it (it dups the communicator). ``rank``/``world``,
    if given by the caller (or set in ``config``), must agree with the communicator. Other launch
    information passed by the core's registry is ignored.
    """
    MPI = _import_mpi()
    _register_exit_hooks()
    if config.mpi_abort_on_error:
        _install_abort_hook(MPI)
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
    for key, given in (("rank", rank), ("world", world)):
        actual = comm.Get_rank() if key == "rank" else comm.Get_size()
        for source, value in (("argument", given), ("config", getattr(config, key))):
            if value is not None and value != actual:
                raise ConfigError(key, f"{source} says {value} but the MPI communicator says {actual}")
    return MPIChannel(config, comm, MPI)

