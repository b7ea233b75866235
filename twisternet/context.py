"""Context: one process's view of a job — rank, world, task plan, channel — and its progress engine.

The Context turns values into records (codec), packs small records into pool buffers per
(peer, edge) and sends large ones zero-copy, hands incoming records to the operation registered on
their edge, and runs the channel's progress either on a background thread (default) or when the
program calls :meth:`Context.progress` (``progress="manual"``).

Threading rules that operations rely on:

* Handlers registered with :meth:`register` run on the progress thread (or the thread inside
  ``progress()`` in manual mode), never while the Context holds its own locks, one at a time.
* :meth:`send` is thread-safe. Called from a user thread it blocks under back pressure. Called from
  inside a handler it never blocks (blocking there would stop the very progress that frees space):
  it queues regardless of limits. A handler that wants to propagate back pressure checks
  :meth:`can_send` and returns False (refusing its input) while the way onward is congested.
* Records on one (source rank, edge) are delivered in the order they were sent; a refused record and
  everything after it from that source on that edge wait until it is accepted.

Edge incarnations: an edge may be used by one operation after another (an operation per epoch on the
same edge id). Whoever uses an edge tags it (:meth:`tag_edges`) with an *epoch* (the how-many-th
incarnation of the edge this is, counted alike on every rank) and a *fingerprint* (what runs on it,
e.g. ``Gather(edge=7) batch ...``), and registers its handler with the same tag. The first message on a
(peer, edge) stream after the tag changed carries the new tag in front of its payload (no extra
message), and the receiver delivers a record only to a handler of the same epoch: records of a later
epoch wait (buffered) until that epoch's handler registers, records of an earlier one are dropped. A
record whose epoch matches but whose fingerprint differs means the ranks run different operations on
one edge: both the receiver and (through a notice on a control edge) the sender fail with
MismatchError, through the handler's ``on_error`` (or the Context's failure if none is registered).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import deque
from typing import Any, Callable

from . import leftovers
from .channel import CONTROL_EDGE_BASE, MAX_EDGE, Channel
from .codec import Codec, join, record_size
from .config import Config
from .errors import (BackPressureTimeout, ClosedError, MismatchError, OperationTimeout, PeerLostError,
                     ProtocolError, TwisternetError)
from .framing import BufferPool, Packer, Unpacker
from .task_plan import TaskPlan

log = logging.getLogger(__name__)

Handler = Callable[[int, Any], bool]
_BATCH = b"\x00"
_DIRECT = b"\x01"
#: Prefix of a message that starts a new edge tag on its stream: ``_TAGGED, epoch (u32), len (u16),
#: fingerprint (utf-8)``, then the message's own tag and payload.
_TAGGED = b"\x02"
_TAG_HEAD = struct.Struct("<IH")
#: The tag of an edge nobody tagged (raw handlers, control edges): never stamped on the wire.
_NO_TAG: tuple[int, str] = (0, "")
_RETRY_INTERVAL = 0.005
#: The progress thread leaves the engine to a caller that drove it within this many seconds.
_DRIVER_GRACE = 0.001
#: How long a thread sending a large (zero-copy) message waits for a busy engine before handing over.
_SEND_LOCK_WAIT = 0.002
#: How long one round of a thread driving its own large send may poll the channel (MPI) before it
#: re-checks its message: a round that returns at once costs ~30 us of Python per poll.
_DRIVE_SPIN = 0.0005
#: Control edge on which a closing rank tells every peer it is done (see Context.close).
_LEAVE_EDGE = CONTROL_EDGE_BASE + 3
#: Control edge on which a rank tells a peer that its records on an edge belong to another operation.
_MISMATCH_EDGE = CONTROL_EDGE_BASE + 4
#: Control edge on which a rank that lost a peer tells the others which one (before it may fail and exit
#: itself): they then name that rank, the first lost, and not the one that left in reaction.
_CAUSE_EDGE = CONTROL_EDGE_BASE + 5
#: How long a failing rank's close() waits for its loss notices to leave before it aborts the channel.
_NOTICE_FLUSH = 0.5


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

    def __init__(self, parts: list, nbytes: int, pool_buf: bytearray | None,
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

    def __init__(self, ctx: "Context", edge: int, nbytes: int) -> None:
        super().__init__(self._free)
        self.ctx, self.edge, self.nbytes = ctx, edge, nbytes
        self.count = 1
        self.views = False   # decoded from a private copy that is never reused

    def _free(self) -> None:
        with self.ctx._lock:
            self.ctx._local_bytes[self.edge] -= self.nbytes


class SendHandle:
    """Completion of a :meth:`Context.isend`: until :meth:`wait` returns, the sent arrays may still be read."""

    __slots__ = ("_ctx", "_done", "_dst", "_edge", "_deadline", "_limit")

    def __init__(self, ctx: "Context", done: _Sent | None, dst: int, edge: int,
                 deadline: float, limit: float) -> None:
        self._ctx, self._done, self._dst, self._edge = ctx, done, dst, edge
        self._deadline, self._limit = deadline, limit

    @property
    def done(self) -> bool:
        """Whether the channel has finished with the record's memory."""
        return self._done is None or self._done.is_set()

    def wait(self) -> None:
        """Block until sent; PeerLostError if the peer died first, BackPressureTimeout past the send's timeout."""
        if self._done is not None:
            self._ctx._wait_sent(self._done, self._dst, self._edge, self._deadline, self._limit)


class Context:
    """A process's handle on a job. Create it with :func:`twisternet.init`."""

    def __init__(self, channel: Channel, config: Config, plan: TaskPlan | None = None, *,
                 on_close: Callable[[], None] | None = None) -> None:
        self.channel = channel
        self.config = config
        self.rank = channel.rank
        self.world = channel.world
        self.plan = plan if plan is not None else TaskPlan(self.world)
        if self.plan.world != self.world:
            raise TwisternetError(f"task plan is for {self.plan.world} ranks but the job has {self.world}")
        leftovers.sweep_at_start(config)     # files of killed processes (twisternet.leftovers)
        self.codec = Codec(allow_pickle=config.allow_pickle,
                           oob_threshold=min(config.zero_copy_threshold, config.buffer_size))
        self.pool = BufferPool(config.buffer_size, config.pool_buffers)
        self._credit = config.buffer_size * config.buffer_count
        self._zc = config.zero_copy_threshold
        self._on_close = on_close

        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._gen = 0
        self._chan_lock = threading.Lock()
        self._progress_thread_id: int | None = None
        self._in_progress = threading.local()

        self._out: dict[tuple[int, int], _OutStream] = {}
        self._out_ready: set[tuple[int, int]] = set()     # streams with queued messages
        self._out_partial: dict[tuple[int, int], float] = {}  # stream -> when to send its partial buffer
        self._flush_delay = config.flush_delay
        self._sleep_until = float("inf")   # when a sleeping engine will wake by itself
        self._driven_at = 0.0              # when a caller last drove the engine itself (see _run)
        self._seen = False                 # a send completed in this progress round (notify waiters)
        self._in: dict[tuple[int, int], _InStream] = {}
        self._in_dirty: set[tuple[int, int]] = set()      # streams with deliverable records
        self._local_bytes: dict[int, int] = {}
        self._handlers: dict[int, tuple[Handler, str, tuple[int, str], Callable[[BaseException], None] | None]] = {}
        self._tags: dict[int, tuple[int, str]] = {}      # channel edge -> (epoch, fingerprint) of its user
        self._mismatched: set[tuple] = set()              # (stream, handler tag) already reported
        self._tag_errors: dict[int, Callable[[BaseException], None]] = {}   # see tag_edges
        self._refused: dict[tuple[int, int], float] = {}  # stream -> time of refusal
        self._lost: dict[int, str] = {}
        self._lost_after: dict[int, int] = {}   # peer -> the rank whose loss it reported (its cause)
        self._told: set[int] = set()            # lost ranks this rank told its peers about
        self._failure: BaseException | None = None
        #: A failure that names a programming error between ranks (an edge mismatch nobody on this rank
        #: was left to catch) rather than a broken rank: it is raised at the next blocking call, but the
        #: transport is sound, so close() still leaves collectively instead of aborting the job.
        self._reported_failure: BaseException | None = None
        self._reported_heard = False
        self._reported_pair: tuple[int, int, str, str] | None = None
        self._mismatch_pairs: set[tuple[int, int, str, str]] = set()
        self._closed = False
        self._stop = False

        #: Coflow scheduler of this process (None unless ``coflow_policy`` is set; twisternet.coflow.live).
        self.coflows: Any = None
        self._pace_until = 0.0
        if config.coflow_policy != "none":
            from .coflow.live import CoflowRuntime
            self.coflows = CoflowRuntime(self.world, self.rank, config.coflow_policy,
                                         rank_capacity=config.coflow_rank_capacity,
                                         interval=config.coflow_interval)
        # with scheduling on, records up to this size are sliced into pool buffers so others can overtake
        self._slice_limit = (min(config.coflow_slice_limit, config.buffer_size * config.pool_buffers // 2)
                             if self.coflows is not None else -1)
        self.channel.start(self)
        self._left_peers: set[int] = set()
        self._register_control(_LEAVE_EDGE, self._on_leave)
        self._register_control(_MISMATCH_EDGE, self._on_mismatch_notice)
        from .services import ServiceLink
        #: Link to the job's coordinator services (barrier manager, coflow coordinator).
        self.services = ServiceLink(self)
        if self.coflows is not None and config.coflow_coordinator and self.world > 1:
            from .coflow.coordinator import SERVICE_NAME
            self.services.subscribe(SERVICE_NAME, self.coflows.on_schedule)
            self.coflows.connect(lambda msg: self.services.send(SERVICE_NAME, msg))
        self._thread: threading.Thread | None = None
        if config.progress == "thread":
            self._thread = threading.Thread(target=self._run, name=f"twisternet-progress-{self.rank}",
                                            daemon=True)
            self._thread.start()
        #: Whether a thread sending a large message and waiting for it writes it itself (_send_own): with
        #: a progress thread (manual mode has no one to receive while a sender waits for socket room),
        #: a channel that can push, and no coflow scheduler (which decides the order of all sends).
        self._can_push = self._thread is not None and self.channel.can_push and self.coflows is None

    # ------------------------------------------------------------------------------ public API
    @property
    def tasks(self) -> list[int]:
        """All task ids of the task plan."""
        return self.plan.tasks

    @property
    def my_tasks(self) -> list[int]:
        """Tasks that run in this process."""
        return self.plan.tasks_of(self.rank)

    def register(self, edge: int, handler: Handler, *, name: str = "",
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        """Deliver records arriving on ``edge`` to ``handler(src_rank, obj) -> accepted``: those of the
        edge's current tag (see :meth:`tag_edges` and the module doc). ``on_error(exc)`` hears of records
        of another operation on the edge (MismatchError); without it, the Context fails."""
        self._check_edge(edge)
        with self._lock:
            if self._closed:
                raise ClosedError("context is closed")
            if edge in self._handlers:
                raise TwisternetError(f"edge {edge} is already used by {self._handlers[edge][1] or 'an operation'}; "
                                      "give each concurrent operation its own edge")
            self._handlers[edge] = (handler, name, self._tags.get(edge, _NO_TAG), on_error)
            for key, ins in self._in.items():
                if key[1] == edge and ins.pending:
                    self._in_dirty.add(key)
        self.channel.wakeup()

    def _register_control(self, edge: int, handler: Handler) -> None:
        """Register a core service handler on a reserved edge (>= CONTROL_EDGE_BASE)."""
        if not CONTROL_EDGE_BASE <= edge < MAX_EDGE:
            raise TwisternetError(f"control edges are in [{CONTROL_EDGE_BASE}, {MAX_EDGE}), got {edge}")
        with self._lock:
            self._handlers[edge] = (handler, "control", _NO_TAG, None)
            for key, ins in self._in.items():
                if key[1] == edge and ins.pending:
                    self._in_dirty.add(key)
        self.channel.wakeup()

    def tag_edges(self, edges: "range | list[int]", epoch: int, fingerprint: str,
                  on_error: Callable[[BaseException], None] | None = None) -> None:
        """Tag ``edges`` for what uses them now: incarnation ``epoch`` (counted alike on every rank) of an
        operation described by ``fingerprint``. Sends on them carry the tag; handlers registered after
        this take only records of the same tag (see the module doc). ``on_error`` hears of records of
        another operation arriving on one of the edges that has no handler here."""
        tag = (int(epoch), str(fingerprint))
        with self._lock:
            for e in edges:
                self._tags[e] = tag
                if on_error is not None:
                    self._tag_errors[e] = on_error
                else:
                    self._tag_errors.pop(e, None)

    def untag_edges(self, edges: "range | list[int]") -> None:
        """Forget the tags of ``edges`` (their user is gone); the next user tags them again."""
        with self._lock:
            for e in edges:
                self._tags.pop(e, None)
                self._tag_errors.pop(e, None)

    def unregister(self, edge: int) -> None:
        """Stop delivering ``edge``; records still arriving for it are kept until a new register."""
        with self._lock:
            self._handlers.pop(edge, None)

    def resume(self, edge: int) -> None:
        """A handler that refused a record on ``edge`` can accept again: offer it now."""
        with self._lock:
            for key in [k for k in self._refused if k[1] == edge]:
                del self._refused[key]
                self._in_dirty.add(key)
        self.channel.wakeup()

    def send(self, dst_rank: int, edge: int, obj: Any, *, timeout: float | None = None) -> None:
        """Send ``obj`` to ``dst_rank`` on ``edge``; blocks under back pressure (see module doc)."""
        self._send(dst_rank, edge, obj, block=True, timeout=timeout)

    def isend(self, dst_rank: int, edge: int, obj: Any, *, timeout: float | None = None) -> "SendHandle":
        """Start a send and return at once with its :class:`SendHandle` (still blocks under back pressure).

        Arrays of at least ``zero_copy_threshold`` bytes go out without a copy, so the caller must not
        modify them until ``handle.wait()`` returns (as with ``MPI_Isend``); smaller records are copied
        into the send buffers and their handle is done at once.
        """
        got = self._send(dst_rank, edge, obj, block=True, timeout=timeout, wait_sent=False)
        assert isinstance(got, SendHandle)
        return got

    def try_send(self, dst_rank: int, edge: int, obj: Any) -> bool:
        """Like :meth:`send` but returns False instead of blocking when there is no room."""
        return self._send(dst_rank, edge, obj, block=False, timeout=0.0)

    def can_send(self, dst_rank: int, edge: int) -> bool:
        """Whether a send to ``dst_rank`` on ``edge`` would go through without waiting now."""
        with self._lock:
            if dst_rank == self.rank:
                return self._local_bytes.get(edge, 0) < self._credit
            s = self._out.get((dst_rank, edge))
            return s is None or s.queued_bytes < self._credit

    def coflow(self, name: Any, *, size: float | None = None, deadline: float | None = None,
               parents: Any = ()) -> Any:
        """Context manager: operations created inside form one coflow ``name`` of ``size`` total bytes,
        finishing within ``deadline`` seconds, after the coflows ``parents``. A no-op (yielding None)
        when ``coflow_policy`` is "none"."""
        if self.coflows is None:
            import contextlib
            return contextlib.nullcontext()
        return self.coflows.group(name, size=size, deadline=deadline, parents=parents)

    def flush(self) -> None:
        """Send partly filled buffers now instead of waiting for the channel to go idle."""
        with self._lock:
            for key in list(self._out_partial):
                self._emit_partial(self._out[key])
        self._kick()

    def _kick(self, wait: float = 0.0) -> None:
        """Get queued messages moving: hand them to the channel in this thread if the engine is free
        (no thread hand-off), else wake the engine. ``wait``: how long to wait for a busy engine (a
        thread that must wait for its own large message to leave anyway had better write it itself
        than hand it over and be woken again)."""
        if (self._thread is not None and self.channel.can_wait_unlocked
                and not getattr(self._in_progress, "active", False) and not self._stop
                and self._chan_lock.acquire(timeout=wait if wait > 0 else -1, blocking=wait > 0)):
            # Bytes only: handlers are not run here, because the sender may be inside an operation
            # (holding its lock) and a handler run re-entrantly could overtake its record.
            self._progress_once(0.0, lock_held=True, deliver=False)
            with self._lock:
                # what arrived is delivered by the engine; a partly filled buffer due later needs
                # the engine awake in time
                late = bool(self._in_dirty) or (
                    bool(self._out_partial) and self._sleep_until > min(self._out_partial.values()))
            if not late:
                return
        self.channel.wakeup()

    def progress(self, timeout: float = 0.0) -> bool:
        """Run the engine once (manual mode); in thread mode, wait up to ``timeout`` for activity."""
        if self._thread is not None:
            if timeout > 0:
                with self._cond:
                    self._cond.wait(timeout)
            self._raise_failures()
            return False
        return self._progress_once(timeout)

    def wait_until(self, predicate: Callable[[], bool], *, timeout: float | None = None,
                   on_timeout: Callable[[], BaseException] | None = None) -> None:
        """Block until ``predicate()``; raise PeerLostError on a lost peer, ``on_timeout()`` on timeout."""
        limit = self.config.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + limit
        spin_until = start + self.config.spin_time
        flushed = False
        while True:
            with self._lock:
                gen = self._gen
            if predicate():
                return
            if not flushed:
                # whoever waits for an answer wants its own pending records on their way now
                flushed = True
                if self._out_partial:
                    self.flush()
            self._raise_failures()
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise (on_timeout() if on_timeout else OperationTimeout("wait_until timed out", timeout=limit))
            if now < spin_until and self._spin_once():
                continue
            self._wait_change(gen, min(remaining, 0.5))

    def notify(self) -> None:
        """Wake every waiter so it re-checks its predicate."""
        with self._cond:
            self._gen += 1
            self._cond.notify_all()

    def record_views(self) -> bool:
        """Called from a handler: whether the record it is handling may hold numpy arrays that are views
        of the channel's receive buffer, which is reused once the handler returns (anything kept longer
        must then be copied, see ``collectives.reduction.own``). False when the record was decoded
        without out-of-band arrays or came from this rank. True (the safe answer) outside a handler."""
        return getattr(self._in_progress, "views", True)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    @property
    def lost_peers(self) -> dict[int, str]:
        """Ranks lost so far, with the reason."""
        with self._lock:
            return dict(self._lost)

    def close(self, timeout: float | None = None) -> None:
        """Flush pending sends, leave the job cleanly (waiting for the peers to leave too), stop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        limit = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            broken = self._failure is not None and self._failure is not self._reported_failure
        try:
            if not self._lost and not broken:
                self._linger(deadline)
        finally:
            self._stop = True
            self.channel.wakeup()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(max(1.0, deadline - time.monotonic()))
            with self._chan_lock:
                try:
                    if broken or self._lost:
                        self._flush_notices(time.monotonic() + _NOTICE_FLUSH)
                    if broken:
                        self.channel.abort(f"rank {self.rank} failed: {self._failure!r}")
                    else:
                        self.channel.close(max(0.5, min(deadline - time.monotonic(), self.config.peer_timeout)))
                except Exception:  # noqa: BLE001 - closing must finish; log what went wrong
                    log.exception("rank %d: error while closing the channel", self.rank)
            with self._lock:
                for s in self._out.values():
                    s.packer.discard()
            self.services.close()
            self.notify()
            if self._on_close is not None:
                self._on_close()
        with self._lock:
            unheard = None if broken or self._reported_heard else self._reported_failure
        if unheard is not None:
            raise unheard  # a reported failure user code has not heard yet, raised once the job is left

    def _flush_notices(self, deadline: float) -> None:
        """Before a failing rank drops its connections: get its loss notices (and what is queued before
        them) out, for at most until ``deadline`` (engine stopped, channel lock held)."""
        def pending() -> bool:
            with self._lock:
                return any(s.queue for k, s in self._out.items() if k[1] == _CAUSE_EDGE)
        try:
            with self._lock:
                for key in [k for k in self._out_partial if k[1] == _CAUSE_EDGE]:
                    self._emit_partial(self._out[key])
            while time.monotonic() < deadline and (pending() or self.channel.has_pending()):
                self._pump()
                self.channel.progress(0.005)
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.debug("rank %d: flushing loss notices failed", self.rank, exc_info=True)

    def _linger(self, deadline: float) -> None:
        """Collective leave: tell every peer we are done, then keep the engine running (delivering,
        answering service requests as rank 0 may have to) until every live peer said the same."""
        for peer in range(self.world):
            if peer != self.rank:
                with self._lock:
                    if peer in self._lost:
                        continue
                self._send(peer, _LEAVE_EDGE, None, block=True, timeout=max(0.1, deadline - time.monotonic()),
                           closing=True)
        self.flush()
        others = set(range(self.world)) - {self.rank}
        while True:
            with self._lock:
                gen = self._gen
                done = others <= (self._left_peers | set(self._lost))
            if done:
                break
            if time.monotonic() >= deadline:
                with self._lock:
                    late = sorted(others - self._left_peers - set(self._lost))
                log.warning("rank %d: closing before ranks %s finished", self.rank, late)
                break
            self._wait_change(gen, min(0.5, deadline - time.monotonic()))
        self._drain(deadline)

    def _check_unhandled(self, key: tuple[int, int], ins: _InStream) -> None:
        """Records wait on an edge without a handler here: if the edge is tagged for this incarnation and
        they come from another operation, nobody would ever take them; report the mismatch."""
        with self._lock:
            tag = self._tags.get(key[1])
            if tag is None or not tag[1]:
                return
            marks = [obj.tag for obj, ref in ins.pending if ref is None]
            on_error = self._tag_errors.get(key[1])
        for m in marks:
            if m[0] == tag[0] and m[1] and m[1] != tag[1] and (key, tag) not in self._mismatched:
                self._mismatched.add((key, tag))
                self._edge_mismatch(key[0], key[1], m, tag, on_error, notify_peer=True)
                return

    def _edge_mismatch(self, peer: int, edge: int, theirs: tuple[int, str], mine: tuple[int, str],
                       on_error: Callable[[BaseException], None] | None, *, notify_peer: bool) -> None:
        """Rank ``peer`` runs another operation than this rank on ``edge``: fail here, tell the peer."""
        err = MismatchError(f"ranks {sorted({peer, self.rank})} run different operations on one edge: rank "
                            f"{peer} runs {theirs[1]}, rank {self.rank} runs {mine[1]} (channel edge {edge}, "
                            f"incarnation {mine[0]}); every rank must create the same operations on an edge, "
                            "in the same order", [peer, self.rank])
        log.error("rank %d: %s", self.rank, err)
        if notify_peer:
            try:
                self._send(peer, _MISMATCH_EDGE, [edge, theirs[0], mine[1], theirs[1]], block=False, timeout=0.0)
            except TwisternetError:
                log.debug("rank %d: could not tell rank %d of the mismatch", self.rank, peer, exc_info=True)
        # the same two operations meet on each channel edge they share: report the pair once
        pair = (peer, mine[0], mine[1], theirs[1])
        if on_error is not None:
            with self._lock:
                self._mismatch_pairs.add(pair)
                if self._reported_pair == pair:
                    self._reported_heard = True  # the operation raises it to user code
            on_error(err)
        else:
            with self._lock:
                if pair in self._mismatch_pairs:
                    return
                self._mismatch_pairs.add(pair)
                if self._failure is None:
                    self._failure = self._reported_failure = err
                    self._reported_pair = pair
            self.notify()

    def _on_mismatch_notice(self, src: int, obj: Any) -> bool:
        """A peer found that our records on an edge went to another operation there."""
        try:
            edge, epoch, theirs, mine = obj
        except (TypeError, ValueError):
            raise ProtocolError(f"rank {src}: bad mismatch notice {obj!r:.200}") from None
        with self._lock:
            entry = self._handlers.get(edge)
            tag = self._tags.get(edge)
            on_error = entry[3] if entry is not None and entry[2][0] == epoch else None
            if on_error is None and tag is not None and tag[0] == epoch:
                on_error = self._tag_errors.get(edge)
        self._edge_mismatch(src, edge, (epoch, str(theirs)), (epoch, str(mine)), on_error, notify_peer=False)
        return True

    def _on_leave(self, src: int, obj: Any) -> bool:
        with self._lock:
            self._left_peers.add(src)
        return True

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            # Do not wait for peers that may be waiting for us: leave quickly.
            with self._lock:
                if self._failure is None:
                    self._failure = exc if isinstance(exc, BaseException) else TwisternetError(str(exc))
            self.close(timeout=min(5.0, self.config.timeout))

    def __repr__(self) -> str:
        return f"<Context rank={self.rank} world={self.world} channel={self.channel.name}>"

    # ------------------------------------------------------------------------------ sending
    def _check_edge(self, edge: int) -> None:
        if not isinstance(edge, int) or isinstance(edge, bool) or not 0 <= edge < CONTROL_EDGE_BASE:
            raise TwisternetError(f"edge must be an int in [0, {CONTROL_EDGE_BASE}), got {edge!r}")

    def _on_engine_thread(self) -> bool:
        return threading.get_ident() == self._progress_thread_id or getattr(self._in_progress, "active", False)

    def _send(self, dst: int, edge: int, obj: Any, *, block: bool, timeout: float | None,
              closing: bool = False, wait_sent: bool = True, force: bool = False) -> "bool | SendHandle":
        if not isinstance(dst, int) or not 0 <= dst < self.world:
            raise TwisternetError(f"destination rank must be in [0, {self.world}), got {dst!r}")
        if edge < CONTROL_EDGE_BASE:
            self._check_edge(edge)
        elif not edge < MAX_EDGE:
            raise TwisternetError(f"edge must be < {MAX_EDGE}, got {edge}")
        if self._closed and not closing and not self._on_engine_thread():
            raise ClosedError("context is closed")
        parts = self.codec.encode(obj)
        n = record_size(parts)
        forced = force or self._on_engine_thread()
        limit = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        if dst == self.rank:
            sent = self._send_local(edge, parts, n, block=block, forced=forced, deadline=deadline, limit=limit)
            return sent if wait_sent else SendHandle(self, None, dst, edge, deadline, limit)
        direct = n >= self._zc and n > self._slice_limit
        if direct and block and wait_sent and not forced and self._can_push:
            return self._send_own(dst, edge, parts, n, deadline, limit)
        key = (dst, edge)
        done: _Sent | None = None
        while True:
            with self._lock:
                gen = self._gen
                s = self._stream(dst, edge)
                if direct:
                    room = s.queued_bytes < self._credit
                else:
                    need = s.packer.space_needed(n)
                    room = s.queued_bytes < self._credit and (need == 0 or self.pool.available >= need)
                if room or forced:
                    wake = False
                    if direct or not room:
                        # own channel message; zero-copy unless we must not block for its completion
                        if s.packer.pending_bytes:
                            self._emit_partial(s)
                        if forced or not block:
                            # no waiting for completion here (engine thread / try_send): send a copy
                            payload = [_DIRECT, b"".join(parts)]
                        else:
                            done = _Sent()
                            payload = [_DIRECT, *parts]
                        self._queue(s, _OutMsg(payload, n + 1, None, done))
                        wake = True
                    else:
                        had_partial = s.packer.pending_bytes > 0
                        for buf in s.packer.add(parts):
                            self._queue(s, _OutMsg([_BATCH, buf], len(buf) + 1, buf, None))
                            wake = True
                        if s.packer.pending_bytes:
                            if not had_partial:
                                self._out_partial[key] = time.monotonic() + self._flush_delay
                                # wake the engine only if it sleeps past this buffer's flush time
                                wake = wake or self._sleep_until > self._out_partial[key]
                        else:
                            self._out_partial.pop(key, None)
                    break
                if not block:
                    return False
            self._blocked(gen, deadline, limit, edge, "send blocked by back pressure")
        if wake:
            self._kick(_SEND_LOCK_WAIT if done is not None and wait_sent else 0.0)
        if not wait_sent:
            return SendHandle(self, done, dst, edge, deadline, limit)
        if done is not None:
            self._wait_sent(done, dst, edge, deadline, limit)
        return True

    def _stream(self, dst: int, edge: int) -> _OutStream:
        """The stream of messages to ``dst`` on ``edge`` (made on first use); PeerLostError if ``dst`` is
        lost. Called with ``self._lock`` held."""
        if dst in self._lost:
            raise self._lost_error(dst)
        s = self._out.get((dst, edge))
        if s is None:
            s = self._out[(dst, edge)] = _OutStream(dst, edge, self.pool)
        tag = self._tags.get(edge, _NO_TAG)
        if s.tag != tag:
            if s.packer.pending_bytes:
                self._emit_partial(s)       # the records of the old tag go first, in their own message
            s.tag = tag
            s.stamp = _stamp_bytes(tag)     # carried by the next message on the stream
        return s

    @staticmethod
    def _stamp(s: _OutStream, msg: _OutMsg) -> None:
        """Put the stream's new tag in front of ``msg`` (its first message since the tag changed)."""
        if s.stamp is not None:
            msg.parts = [s.stamp + msg.parts[0], *msg.parts[1:]]
            msg.nbytes += len(s.stamp)
            s.stamp = None

    def _send_own(self, dst: int, edge: int, parts: list, n: int, deadline: float, limit: float) -> bool:
        """Send a large message that this thread waits for anyway by writing it itself (Channel.push).

        The thread takes the engine *before* queueing the message, so the progress thread cannot pick
        it up in between, hands it to the channel, writes what the socket takes, and waits for room
        without the engine (the progress thread goes on receiving meanwhile). A message is then written
        by the thread that sent it with no hand-off either way, as a blocking socket send would be.
        If the engine stays busy for ``_SEND_LOCK_WAIT``, the message is queued for the engine instead."""
        done = _Sent()
        msg = _OutMsg([_DIRECT, *parts], n + 1, None, done)
        ch = self.channel
        while True:
            engine = self._chan_lock.acquire(timeout=_SEND_LOCK_WAIT)
            handed = False
            try:
                with self._lock:
                    gen = self._gen
                    s = self._stream(dst, edge)
                    room = s.queued_bytes < self._credit
                    if room:
                        if s.packer.pending_bytes:
                            self._emit_partial(s)
                        self._stamp(s, msg)
                        # nothing queued before it: straight to the channel if it has credit
                        handed = engine and not s.queue and ch.send(dst, edge, msg.parts, msg)
                        if not handed:
                            self._queue(s, msg)
            except BaseException:
                if engine:
                    self._chan_lock.release()
                raise
            if room:
                break
            if engine:
                self._chan_lock.release()
            self._blocked(gen, deadline, limit, edge, "send blocked by back pressure")
        if not engine:
            self.channel.wakeup()
            self._wait_sent(done, dst, edge, deadline, limit)
            return True
        left = False
        try:
            if not handed:
                self._pump()
                with self._lock:
                    handed = msg not in s.queue
            if handed:
                left = not ch.push(dst)
        finally:
            self._chan_lock.release()
        self._after_push()
        if not handed:
            # no credit for it yet: the engine hands it over and writes it once credit comes back
            self._wait_sent(done, dst, edge, deadline, limit)
            return True
        try:
            while not done.is_set():
                self._raise_failures()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BackPressureTimeout("large send did not complete", edge=edge, timeout=limit)
                ch.wait_writable(dst, min(remaining, 0.05))
                if self._chan_lock.acquire(timeout=min(remaining, 0.05)):
                    try:
                        left = not ch.push(dst)
                    finally:
                        self._chan_lock.release()
                    self._after_push()
        finally:
            if left:
                with self._chan_lock:
                    ch.end_push(dst)
        with self._lock:
            if dst in self._lost:  # its buffers were let go because the peer died, not sent
                raise self._lost_error(dst)
        return True

    def _after_push(self) -> None:
        """Wake the waiters (the stream's queue shrank, credit may have come back), and the engine if
        the push received records: handlers run on the engine, never in a sending thread."""
        self.notify()
        with self._lock:
            late = bool(self._in_dirty)
        if late:
            self.channel.wakeup()

    def _wait_sent(self, done: _Sent, dst: int, edge: int, deadline: float, limit: float) -> None:
        while not done.is_set():
            with self._lock:
                gen = self._gen
            if done.is_set():
                break
            if self._drive_send(deadline):
                continue
            self._blocked(gen, deadline, limit, edge, "large send did not complete")
        with self._lock:
            if dst in self._lost:  # its buffers were let go because the peer died, not sent
                raise self._lost_error(dst)

    def _drive_send(self, deadline: float) -> bool:
        """Over MPI, a thread waiting for its own large send to complete polls the request itself (as a
        blocking ``MPI_Send`` would), the engine thread keeping out of the way meanwhile: no hand-off
        to the engine thread and back, which costs two thread wake-ups per message. Bytes only, as in
        :meth:`_kick`. False: not done here (socket channels, or the engine is busy)."""
        if self._thread is None or getattr(self._in_progress, "active", False) or self._stop:
            return False
        self._raise_failures()
        if self.channel.can_wait_unlocked:
            # Sockets: the sender already wrote what fit (_kick); the engine thread, waiting for socket
            # room without the lock, writes the rest. Writing it here instead, waiting for room under the
            # lock, made 64-256 MB transfers collapse to a third of their speed in some runs.
            return False
        if not self._take_engine():
            return False
        self._progress_once(_DRIVE_SPIN, lock_held=True, deliver=False)
        self._driven_at = time.monotonic()
        with self._lock:
            late = bool(self._in_dirty)
        if late:
            self.channel.wakeup()    # what arrived meanwhile is delivered by the engine thread
        if time.monotonic() >= deadline:
            return False             # _blocked raises the timeout
        return True

    def _send_local(self, edge: int, parts: list, n: int, *, block: bool, forced: bool,
                    deadline: float, limit: float) -> bool:
        while True:
            with self._lock:
                gen = self._gen
                held = self._local_bytes.get(edge, 0)
                if forced or held == 0 or held + n <= self._credit:
                    self._local_bytes[edge] = held + n
                    obj = self.codec.decode(join(parts))  # copy semantics, as for a remote peer
                    key = (self.rank, edge)
                    ins = self._in.get(key)
                    if ins is None:
                        ins = self._in[key] = _InStream(self.rank, edge)
                    tag = self._tags.get(edge, _NO_TAG)
                    if ins.local_tag != tag:
                        ins.local_tag = tag
                        ins.pending.append((_Mark(tag), None))
                    ins.pending.append((obj, _LocalRef(self, edge, n)))
                    self._in_dirty.add(key)
                    break
                if not block:
                    return False
            self._blocked(gen, deadline, limit, edge, "send to own rank blocked by back pressure")
        if not forced:
            self.channel.wakeup()
        return True

    def _blocked(self, gen: int, deadline: float, limit: float, edge: int, what: str) -> None:
        """One wait of a blocked send: raise on a failure or past the deadline, else wait for a change."""
        self._raise_failures()
        if time.monotonic() >= deadline:
            raise BackPressureTimeout(what, edge=edge, timeout=limit)
        self._wait_change(gen, min(deadline - time.monotonic(), 0.5))

    def _queue(self, s: _OutStream, msg: _OutMsg) -> None:
        if s.stamp is not None:
            self._stamp(s, msg)
        s.queue.append(msg)
        s.queued_bytes += msg.nbytes
        self._out_ready.add((s.peer, s.edge))

    def _emit_partial(self, s: _OutStream) -> None:
        got = s.packer.flush()
        self._out_partial.pop((s.peer, s.edge), None)
        if got is not None:
            buf, view = got
            self._queue(s, _OutMsg([_BATCH, view], len(view) + 1, buf, None))

    # ------------------------------------------------------------------------------ engine
    def _run(self) -> None:
        self._progress_thread_id = threading.get_ident()
        unlocked = self.channel.can_wait_unlocked
        try:
            while not self._stop:
                if not unlocked:
                    if time.monotonic() - self._driven_at < _DRIVER_GRACE:
                        time.sleep(_DRIVER_GRACE)   # a sender polls its own large message (_drive_send)
                        continue
                    self._progress_once(0.05)
                    continue
                # Work under the engine lock without waiting, then wait *without* it, so a thread
                # that sends or waits for an answer can move the bytes itself at once (no hand-off).
                if time.monotonic() - self._driven_at < _DRIVER_GRACE:
                    # A caller waiting for an answer drives the engine itself right now: keep out of
                    # its way (it handles what arrives without a hand-off); take over if it stops.
                    time.sleep(_DRIVER_GRACE)
                    continue
                # One round, then the unlocked wait even if the round did something: the wait returns at
                # once if more is ready, where a second round would cost as much as the first (and keep
                # the engine from a thread that wants to send) just to find that nothing is.
                self._progress_once(0.0)
                if self._stop:
                    continue
                with self._lock:
                    if self._in_dirty:
                        continue
                    timeout = 0.05
                    if self._out_partial:
                        timeout = max(0.0, min(timeout, min(self._out_partial.values()) - time.monotonic()))
                    if self._out_ready and self.coflows is not None:
                        # scheduled sends wait for pacing tokens or channel room: poll at least this often
                        timeout = max(0.0, min(timeout, self._pace_until - time.monotonic(), 0.01))
                    self._sleep_until = time.monotonic() + timeout
                try:
                    self.channel.wait(timeout)
                finally:
                    self._sleep_until = float("inf")
        except BaseException as e:  # noqa: BLE001 - the engine must report, not vanish
            log.exception("rank %d: progress engine failed", self.rank)
            with self._lock:
                if self._failure is None:
                    self._failure = e
            self.notify()

    def _progress_once(self, timeout: float, *, lock_held: bool = False, deliver: bool = True) -> bool:
        if not lock_held:
            self._chan_lock.acquire()
        try:
            self._in_progress.active = True
            try:
                self._seen = False
                did = self._pump()
                seen = did
                if self.coflows is not None:
                    self.coflows.flush_outbox()   # coordinator reports, outside the Context lock
                if did or self._in_dirty:
                    timeout = 0.0
                else:
                    with self._lock:
                        if self._out_partial:
                            timeout = max(0.0, min(timeout, min(self._out_partial.values()) - time.monotonic()))
                        if self._out_ready and self.coflows is not None:
                            # scheduled sends wait for pacing tokens or channel room: poll at least this often
                            timeout = max(0.0, min(timeout, self._pace_until - time.monotonic(), 0.01))
                        self._sleep_until = time.monotonic() + timeout
                did = self.channel.progress(timeout) or did
                self._sleep_until = float("inf") if timeout > 0 else self._sleep_until
                if self._pump():
                    did = seen = True
                if deliver and self._deliver():
                    did = seen = True
                    self.channel.flush_released()   # what the handlers released goes back now
                seen = seen or self._seen
            finally:
                self._in_progress.active = False
        finally:
            self._chan_lock.release()
        # Waiters hear of what they can see: records handled, messages handed to the channel (room in
        # a stream's queue), sends completed. Not of the channel's own steps (a header read, a credit
        # frame, one segment of several): over MPI a large message takes about seven such steps, and
        # waking a waiter for each cost a GIL hand-off apiece.
        if seen:
            self.notify()
        return did

    def _pump(self) -> bool:
        """Hand queued messages to the channel while it has credit; flush idle partial buffers."""
        did = False
        with self._lock:
            if self._out_partial:
                now = time.monotonic()
                for key, due in list(self._out_partial.items()):
                    s = self._out[key]
                    if due <= now and not s.queue:
                        self._emit_partial(s)
            if self.coflows is not None:
                return self._pump_scheduled() or did
            for key in list(self._out_ready):
                s = self._out[key]
                while s.queue:
                    msg = s.queue[0]
                    if not self.channel.send(s.peer, s.edge, msg.parts, msg):
                        break
                    s.queue.popleft()
                    s.queued_bytes -= msg.nbytes
                    did = True
                if not s.queue:
                    self._out_ready.discard(key)
        return did

    def _pump_scheduled(self) -> bool:
        """The coflow-scheduled pump (lock held): streams in the coflows' priority order; per peer, no
        more than ``coflow_inflight`` bytes waiting in the channel, so the backlog stays here where a more
        urgent coflow can overtake; optional token-bucket pacing per flow."""
        cf = self.coflows
        cf.refresh()
        did = False
        now = time.monotonic()
        cap = self.config.coflow_inflight
        pacing = self.config.coflow_pacing
        pending = getattr(self.channel, "pending_bytes", None)
        wake = float("inf")
        for key in sorted(self._out_ready, key=lambda k: cf.edge_rank(k[1])):
            s = self._out[key]
            while s.queue:
                if pending is not None and pending(s.peer) >= cap and cf.edge_rank(s.edge) >= 0:
                    break
                msg = s.queue[0]
                if pacing:
                    wait = cf.pace(s.edge, s.peer, msg.nbytes)
                    if wait > 0:
                        wake = min(wake, now + wait)
                        break
                if not self.channel.send(s.peer, s.edge, msg.parts, msg):
                    break
                s.queue.popleft()
                s.queued_bytes -= msg.nbytes
                cf.report_sent(s.edge, s.peer, msg.nbytes)
                did = True
            if not s.queue:
                self._out_ready.discard(key)
        self._pace_until = wake
        return did

    def _deliver(self) -> bool:
        """Offer pending records to their handlers (outside the Context lock)."""
        did = False
        now = time.monotonic()
        with self._lock:
            for key, t in list(self._refused.items()):
                if now - t >= _RETRY_INTERVAL:
                    del self._refused[key]
                    self._in_dirty.add(key)
            work = [k for k in self._in_dirty if k not in self._refused]
            self._in_dirty.clear()
        for key in work:
            with self._lock:
                ins = self._in.get(key)
                entry = self._handlers.get(key[1])
            if ins is None:
                continue
            if entry is None:
                self._check_unhandled(key, ins)
                continue
            handler, _, htag, on_error = entry
            src = ins.src
            while True:
                with self._lock:
                    if not ins.pending:
                        break
                    batch = list(ins.pending)
                    ins.pending.clear()
                i = 0
                early = False
                mismatch: tuple[int, str] | None = None
                progress = self._in_progress
                try:
                    for obj, ref in batch:
                        if ref is None:            # a _Mark: the records after it carry its tag
                            ins.tag = htag if obj.tag == htag else obj.tag   # same object: cheap check
                            i += 1
                            continue
                        if ins.tag is not htag and ins.tag != htag:
                            if ins.tag[0] > htag[0]:
                                early = True       # the edge's next incarnation: wait for its handler
                                break
                            if ins.tag[0] < htag[0] or mismatch is not None:
                                ref.done_one()     # stale: an earlier incarnation of the edge
                                i += 1
                                continue
                            if ins.tag[1] and htag[1]:
                                mismatch = ins.tag  # same incarnation, another operation: drop, fail
                                ref.done_one()
                                i += 1
                                continue
                        progress.views = ref.views
                        if handler(src, obj) is False:
                            break
                        ref.done_one()
                        i += 1
                except BaseException as e:  # noqa: BLE001 - a failing handler fails the waiters
                    log.exception("rank %d: handler of edge %d raised", self.rank, key[1])
                    with self._lock:
                        if self._failure is None:
                            self._failure = e
                    return True
                finally:
                    progress.views = True     # outside a handler, record_views() gives the safe answer
                did = did or i > 0
                if mismatch is not None and (key, htag) not in self._mismatched:
                    self._mismatched.add((key, htag))
                    self._edge_mismatch(src, key[1], mismatch, htag, on_error, notify_peer=True)
                if i < len(batch):
                    with self._lock:
                        ins.pending.extendleft(reversed(batch[i:]))   # keep order: refused one first
                        if not early:
                            self._refused[key] = time.monotonic()
                        elif self._handlers.get(key[1]) is not entry:
                            # the next incarnation registered meanwhile (finding nothing pending): now
                            self._in_dirty.add(key)
                    break
        return did

    def _spin_once(self) -> bool:
        """One non-blocking progress round by this waiting thread, if it may drive the engine now."""
        if getattr(self._in_progress, "active", False) or not self._chan_lock.acquire(blocking=False):
            return False
        if self._stop:
            self._chan_lock.release()
            return False
        self._progress_once(0.0, lock_held=True)
        self._driven_at = time.monotonic()
        return True

    def _take_engine(self) -> bool:
        """Take the engine for this (waiting) thread if it is free. Over MPI the engine thread holds it
        while it polls, so ask it to step aside (it keeps out while ``_driven_at`` is recent, see
        ``_run``) and wait briefly: the thread that waits for a record (or for its own large send,
        ``_drive_send``) then moves it itself, as a blocking ``MPI_Recv``/``MPI_Send`` does, instead
        of being woken for every record the engine thread handles (a wake-up and a GIL hand-off per
        message, in the path of the next one)."""
        if self.channel.can_wait_unlocked:
            return self._chan_lock.acquire(blocking=False)
        self._driven_at = time.monotonic()   # the engine thread yields the channel (see _run)
        if self._chan_lock.acquire(blocking=False):
            return True
        self.channel.wakeup()                # the engine stops its current wait early
        return self._chan_lock.acquire(timeout=_SEND_LOCK_WAIT)

    def _wait_change(self, gen: int, timeout: float) -> None:
        if timeout <= 0:
            return
        if self._thread is None:
            # manual mode: this thread drives the engine
            if not self._chan_lock.locked() or not getattr(self._in_progress, "active", False):
                self._progress_once(min(timeout, 0.01))
            return
        # A blocked caller drives the engine itself when it is free, as MPI does: the reply it waits
        # for is then received, handled and seen in this thread, with no hand-off between threads.
        if not getattr(self._in_progress, "active", False) and self._take_engine():
            with self._lock:
                changed = self._gen != gen
            if changed or self._stop:
                self._chan_lock.release()
                return
            self._driven_at = time.monotonic() + min(timeout, 0.005)   # driving until then at most
            self._progress_once(min(timeout, 0.005), lock_held=True)
            self._driven_at = time.monotonic()
            return
        with self._cond:
            if self._gen == gen:
                self._cond.wait(timeout)

    def _drain(self, deadline: float) -> None:
        """Wait until every queued message has been handed to the channel and sent."""
        def drained() -> bool:
            with self._lock:
                busy = any(s.queue for s in self._out.values()) or bool(self._out_partial)
            return not busy and not self.channel.has_pending()
        while not drained():
            self._raise_failures()
            if time.monotonic() >= deadline:
                log.warning("rank %d: close timed out with sends still pending", self.rank)
                return
            with self._lock:
                gen = self._gen
                for key in list(self._out_partial):
                    self._emit_partial(self._out[key])
            self.channel.wakeup()
            self._wait_change(gen, 0.05)

    def _raise_failures(self) -> None:
        with self._lock:
            failure = self._failure
            lost = next(iter(self._lost.items()), None)
        if failure is not None and failure is self._reported_failure:
            if self._closed:
                failure = None  # while leaving the job: close() raises it at the end if still unheard
            else:
                self._reported_heard = True
        if failure is not None:
            # the original exception (a handler's or the engine's), so callers see what really failed
            raise failure
        if lost is not None:
            raise self._lost_error(lost[0])

    def _lost_error(self, peer: int) -> PeerLostError:
        """PeerLostError for the loss of ``peer``, naming the first rank lost: if ``peer`` (or the rank
        it left after) reported losing another rank before it went, that one; the others are "lost
        after" it."""
        with self._lock:
            roots = [r for r in self._lost if r not in self._lost_after]
            root = roots[0] if roots else peer
            reason = self._lost.get(root, "lost")
            after = sorted(r for r in self._lost if r != root)
        if after:
            reason += f"; rank{'s' if len(after) > 1 else ''} {', '.join(map(str, after))} lost after rank {root}"
        return PeerLostError(root, reason)

    def check_lost(self) -> None:
        """Raise PeerLostError (naming the first rank lost) if any peer was lost."""
        if self._lost:
            raise self._lost_error(next(iter(self._lost)))

    # ------------------------------------------------------------------------------ channel events
    def on_message(self, peer: int, edge: int, data: memoryview, release: Callable[[], None]) -> None:
        key = (peer, edge)
        with self._lock:
            ins = self._in.get(key)
            if ins is None:
                ins = self._in[key] = _InStream(peer, edge)
        tag = data[:1]
        mark = None
        if tag == _TAGGED:
            epoch, flen = _TAG_HEAD.unpack_from(data, 1)
            end = 1 + _TAG_HEAD.size + flen
            mark = _Mark((epoch, bytes(data[1 + _TAG_HEAD.size:end]).decode("utf-8", "replace")))
            data = data[end:]
            tag = data[:1]
        if tag == _BATCH:
            records = ins.unpacker.feed(data[1:])
        elif tag == _DIRECT:
            if ins.unpacker.partial:
                raise ProtocolError(f"rank {peer} edge {edge}: direct record inside a split record")
            records = [data[1:]]
        else:
            raise ProtocolError(f"rank {peer} edge {edge}: unknown message tag {bytes(tag)!r}")
        ref = _MsgRef(release)
        decoded = []
        views = False
        for r in records:
            obj, v = self.codec.decode_views(r)
            decoded.append(obj)
            views = views or v
        ref.views = views
        if edge == _CAUSE_EDGE:
            # handled at once: the sender's own loss may be reported right after this message
            for obj in decoded:
                self._on_cause(peer, obj)
            release()
            return
        if mark is not None:
            with self._lock:
                ins.pending.append((mark, None))
                self._in_dirty.add(key)
        if not decoded:
            release()  # only a piece of a split record: its bytes were copied out
            return
        ref.count = len(decoded)
        with self._lock:
            for obj in decoded:
                ins.pending.append((obj, ref))
            self._in_dirty.add(key)

    def on_credit(self, peer: int, edge: int) -> None:
        pass  # the next _pump retries every stream with queued messages

    def on_sent(self, token: object) -> None:
        self._seen = True
        msg = token
        assert isinstance(msg, _OutMsg)
        if msg.pool_buf is not None:
            self.pool.release(msg.pool_buf)
            msg.pool_buf = None
        if msg.done is not None:
            msg.done.set()

    def on_peer_lost(self, peer: int, reason: str) -> None:
        with self._lock:
            if peer in self._lost:
                return
            cause = self._lost_after.get(peer)
        if cause is None:
            # queued before the loss is visible: a caller that raises on it and closes flushes them
            self._tell_loss(peer, reason)
        with self._lock:
            if peer in self._lost:
                return
            if cause is not None:
                reason += f" (it left after rank {cause} was lost)"
            self._lost[peer] = reason
        log.error("rank %d: peer rank %d lost: %s", self.rank, peer, reason)
        self.notify()

    def _tell_loss(self, peer: int, reason: str) -> None:
        """Tell every live peer that ``peer`` was lost, so that when this rank fails in reaction they
        name ``peer`` and not this rank."""
        with self._lock:
            if peer in self._told or self._stop:    # stopped: the channel is closing, nobody to tell
                return
            self._told.add(peer)
            live = [r for r in range(self.world) if r not in (self.rank, peer) and r not in self._lost]
        for r in live:
            try:
                self._send(r, _CAUSE_EDGE, [peer, reason], block=False, timeout=0.0, closing=True, force=True)
            except Exception:  # noqa: BLE001 - best effort: the loss itself is reported regardless
                log.debug("rank %d: could not tell rank %d of the loss", self.rank, r, exc_info=True)
        with self._lock:    # now, not after the flush delay: this rank may fail and exit any moment
            for r in live:
                if (r, _CAUSE_EDGE) in self._out_partial:
                    self._emit_partial(self._out[(r, _CAUSE_EDGE)])
        self.channel.wakeup()

    def _on_cause(self, src: int, obj: Any) -> None:
        """Rank ``src`` lost rank ``obj[0]``: remember it (before ``src`` itself may go)."""
        try:
            lost, reason = int(obj[0]), str(obj[1])
        except (TypeError, ValueError, IndexError):
            log.warning("rank %d: bad loss notice from rank %d: %r", self.rank, src, obj)
            return
        if lost == self.rank:
            return
        with self._lock:
            self._lost_after.setdefault(src, lost)
            if lost in self._lost:
                return
        # pass it on too (before the loss is visible here): a rank that fails because of it must be
        # known to have left after it
        self._tell_loss(lost, reason)
        with self._lock:
            if lost in self._lost:
                return
            self._lost[lost] = f"{reason} (seen by rank {src})"
        log.error("rank %d: peer rank %d lost (reported by rank %d): %s", self.rank, lost, src, reason)
        self.notify()
