"""The Context class users see: a process's handle on a job (see the package doc for the model).

Its parts live beside it, one concept each: ``outbound`` (sending), ``push`` (large sends completed by
their own thread), ``engine`` (progress thread and hand-offs), ``coflow_pump`` (scheduled sending),
``inbound`` (delivery to handlers), ``losses`` (peer loss), ``lifecycle`` (close).
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, cast
from collections.abc import Callable

from .. import leftovers, malloc
from ..channel import CONTROL_EDGE_BASE, MAX_EDGE, Channel
from ..codec import Codec
from ..config import Config, busy_poll_seconds
from ..errors import ClosedError, OperationTimeout, TwisternetError
from ..framing import BufferPool
from ..task_plan import TaskPlan
from ..topology import from_channel, ranks_on_this_kernel
from .coflow_pump import CoflowPump
from .engine import ProgressEngine
from .inbound import Inbound
from .lifecycle import Lifecycle
from .losses import PeerLoss
from .outbound import Outbound
from .push import OwnSend, SendHandle
from .streams import _LEAVE_EDGE, _MISMATCH_EDGE, _NO_TAG, Handler, _InStream, _OutStream


class Context(Outbound, OwnSend, ProgressEngine, Inbound, PeerLoss, Lifecycle):
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
        if config.malloc_tuning:
            malloc.tune()                    # freed memory kept for the next burst (twisternet.malloc)
        self.codec = Codec(allow_pickle=config.allow_pickle,
                           oob_threshold=min(config.zero_copy_threshold, config.buffer_size))
        self.pool = BufferPool(config.buffer_size, config.pool_buffers)
        self._credit = config.buffer_size * config.buffer_count
        self._zc = config.zero_copy_threshold
        #: Seconds a waiting thread busy-polls the channel before sleeping (config ``busy_poll_us``).
        self._busy_poll = busy_poll_seconds(config, _ranks_on_this_host(channel))
        self._on_close = on_close

        # The state of every part is made here, in one place; each part's docstring names what it owns.
        # Shared by all: the Context lock and condition (waiters wake on a change of _gen).
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # A change is a new _gen (from a counter: no two changes give the same value, whatever the
        # threads' interleaving); the condition is notified only while a thread waits on it.
        self._gen = 0
        self._gens = itertools.count(1)
        self._cond_waiters = 0
        # engine (engine.py)
        self._chan_lock = threading.Lock()
        self._progress_thread_id: int | None = None
        self._in_progress = threading.local()
        self._sleep_until = float("inf")   # when a sleeping engine will wake by itself
        self._driven_at = 0.0              # when a caller last drove the engine itself (see _run)
        self._seen = False                 # a send completed in this progress round (notify waiters)
        self._inline = False               # on_message may run handlers at once (see Inbound.on_message)
        self._stop = False
        # outbound (outbound.py)
        self._out: dict[tuple[int, int], _OutStream] = {}
        self._out_ready: set[tuple[int, int]] = set()     # streams with queued messages
        self._out_partial: dict[tuple[int, int], float] = {}  # stream -> when to send its partial buffer
        self._flush_delay = config.flush_delay
        # key -> (due, fn): work an operation handed over to be done within flush_delay (see defer)
        self._deferred: dict[Any, tuple[float, Callable[[], bool]]] = {}
        self._local_bytes: dict[int, int] = {}
        # inbound (inbound.py)
        self._in: dict[tuple[int, int], _InStream] = {}
        self._in_dirty: set[tuple[int, int]] = set()      # streams with deliverable records
        self._handlers: dict[int, tuple[Handler, str, tuple[int, str], Callable[[BaseException], None] | None]] = {}
        self._tags: dict[int, tuple[int, str]] = {}      # channel edge -> (epoch, fingerprint) of its user
        self._mismatched: set[tuple[Any, ...]] = set()              # (stream, handler tag) already reported
        self._tag_errors: dict[int, Callable[[BaseException], None]] = {}   # see tag_edges
        self._refused: dict[tuple[int, int], float] = {}  # stream -> time of refusal
        # losses (losses.py)
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
        # lifecycle (lifecycle.py)
        self._closed = False

        #: Coflow scheduler of this process (None unless ``coflow_policy`` is set; twisternet.coflow.live).
        self.coflows: Any = None
        #: Hands queued messages to the channel in the coflows' order (None: first come first served).
        self._coflow_pump: CoflowPump | None = None
        if config.coflow_policy != "none":
            from ..coflow.live import CoflowRuntime
            self.coflows = CoflowRuntime(self.world, self.rank, config.coflow_policy,
                                         rank_capacity=config.coflow_rank_capacity,
                                         interval=config.coflow_interval)
            self._coflow_pump = CoflowPump(channel, self.coflows, config, self._out, self._out_ready)
        # with scheduling on, records up to this size are sliced into pool buffers so others can overtake
        self._slice_limit = (min(config.coflow_slice_limit, config.buffer_size * config.pool_buffers // 2)
                             if self.coflows is not None else -1)
        #: Whether a small record to an idle stream is written at once by its sender (``_send_small``):
        #: a channel that can, and no coflow scheduler (which decides the order of all sends).
        self._small_ok = self.channel.can_send_small and self.coflows is None
        self.channel.start(self)
        self._left_peers: set[int] = set()
        self.register_control_handler(_LEAVE_EDGE, self._on_leave)
        self.register_control_handler(_MISMATCH_EDGE, self._on_mismatch_notice)
        from ..services import ServiceLink
        #: Link to the job's coordinator services (barrier manager, coflow coordinator).
        self.services = ServiceLink(self)
        if self.coflows is not None and config.coflow_coordinator and self.world > 1:
            from ..coflow.coordinator import SERVICE_NAME
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

    @property
    def busy_poll(self) -> float:
        """Seconds a waiting thread busy-polls before it sleeps (config ``busy_poll_us``; 0: never, e.g.
        when the ranks on this machine outnumber its cores)."""
        return self._busy_poll

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

    def register_control_handler(self, edge: int, handler: Handler) -> None:
        """For the core's own services (``twisternet.services``, leave and mismatch notices), not for
        operations: deliver records arriving on the reserved control edge ``edge`` (in
        [CONTROL_EDGE_BASE, MAX_EDGE)) to ``handler(src_rank, obj) -> accepted``. Unlike
        :meth:`register`, a control edge is never tagged (its records reach the handler whatever
        incarnation), a new handler replaces the old one, and it may be called on a closed Context.
        Records that arrived before the call are delivered to it. The handler runs on the engine, as
        every handler does, and must not block."""
        if not CONTROL_EDGE_BASE <= edge < MAX_EDGE:
            raise TwisternetError(f"control edges are in [{CONTROL_EDGE_BASE}, {MAX_EDGE}), got {edge}")
        with self._lock:
            self._handlers[edge] = (handler, "control", _NO_TAG, None)
            for key, ins in self._in.items():
                if key[1] == edge and ins.pending:
                    self._in_dirty.add(key)
        self.channel.wakeup()

    def tag_edges(self, edges: range | list[int], epoch: int, fingerprint: str,
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

    def untag_edges(self, edges: range | list[int]) -> None:
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

    def send_while_leaving(self, dst_rank: int, edge: int, obj: Any, *, timeout: float | None = None) -> None:
        """Like :meth:`send`, and also while :meth:`close` lingers for the peers to leave: for the
        coordinator services this rank hosts, whose timer threads answer peers that still wait on them
        (:meth:`send` refuses a closed context on any thread but the engine's)."""
        self._send(dst_rank, edge, obj, block=True, timeout=timeout, closing=True)

    def isend(self, dst_rank: int, edge: int, obj: Any, *, timeout: float | None = None) -> SendHandle:
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
        return cast(bool, self._send(dst_rank, edge, obj, block=False, timeout=0.0))  # wait_sent: a bool

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

    def defer(self, key: Any, fn: Callable[[], bool]) -> None:
        """Have ``fn()`` called within ``flush_delay`` by whichever thread runs the engine next (or by
        :meth:`flush`, which every waiter calls): how an operation sends records it holds back to batch
        them (``KeyedReduce.send``). ``fn`` must not block and returns whether it is done (False: call
        it again after another delay). A key already waiting keeps its time."""
        due = time.monotonic() + self._flush_delay
        with self._lock:
            if key in self._deferred:
                return
            self._deferred[key] = (due, fn)
            wake = self._sleep_until > due
        if wake:
            self._kick()

    def flush(self) -> None:
        """Send partly filled buffers (and records operations hold back, see :meth:`defer`) now instead
        of waiting for the channel to go idle."""
        if not (self._deferred or self._out_partial or self._out_ready):
            return      # (unlocked peeks: what this thread sent is in them; others flush their own)
        if self._deferred:
            self._run_deferred(everything=True)
        with self._lock:
            for key in list(self._out_partial):
                self._emit_partial(self._out[key])
            idle = not self._out_ready
        if not idle:    # nothing queued: nothing to hand over (a round would find nothing to do)
            self._kick()

    def progress(self, timeout: float = 0.0) -> bool:
        """Run the engine once (manual mode); in thread mode, wait up to ``timeout`` for activity."""
        if self._thread is not None:
            if timeout > 0:
                with self._cond:
                    self._cond_waiters += 1
                    try:
                        self._cond.wait(timeout)
                    finally:
                        self._cond_waiters -= 1
            self._raise_failures()
            return False
        return self._progress_once(timeout)

    def wait_until(self, predicate: Callable[[], bool], *, timeout: float | None = None,
                   on_timeout: Callable[[], BaseException] | None = None) -> None:
        """Block until ``predicate()``; raise PeerLostError on a lost peer, ``on_timeout()`` on timeout."""
        limit = self.config.timeout if timeout is None else timeout
        start = time.monotonic()
        deadline = start + limit
        spin_until = start + self._busy_poll
        flushed = False
        while True:
            gen = self._gen     # (read before the predicate: a change after it ends the wait below)
            if predicate():
                return
            if not flushed:
                # whoever waits for an answer wants its own pending records on their way now
                flushed = True
                if self._out_partial or self._deferred:
                    self.flush()
            if self._failure is not None or self._lost:     # (unlocked peek: see _raise_failures)
                self._raise_failures()
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise (on_timeout() if on_timeout else OperationTimeout("wait_until timed out", timeout=limit))
            if now < spin_until:
                spun = self._spin(predicate, min(spin_until, deadline))
                if spun:
                    return
                if spun is not None:
                    continue
            self._wait_change(gen, min(remaining, 0.5))

    def notify(self) -> None:
        """Wake every waiter so it re-checks its predicate.

        A waiter counts itself in ``_cond_waiters`` (under the lock) before it looks at ``_gen`` and
        sleeps; a notifier sets ``_gen`` before it looks at the count. So either the waiter sees the
        new ``_gen`` and does not sleep, or the notifier sees the waiter and wakes it. Most changes
        happen with no thread asleep (the waiting thread drives the engine itself): then a change
        costs no lock and no notification."""
        self._gen = next(self._gens)
        if self._cond_waiters:
            with self._cond:
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

    def __enter__(self) -> Context:
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

    def check_lost(self) -> None:
        """Raise PeerLostError (naming the first rank lost) if any peer was lost."""
        if self._lost:
            raise self._lost_error(next(iter(self._lost)))


def _ranks_on_this_host(channel: Channel) -> int:
    """How many of the job's ranks share this rank's cores, where the channel knows (the TCP bootstrap
    table: the ranks on this machine, whatever namespace or container each is in); else the whole job
    (the safe guess: more ranks than cores means no busy polling)."""
    hosts = from_channel(channel)
    if hosts is None or channel.rank not in hosts:
        return channel.world
    return ranks_on_this_kernel(hosts, channel.rank)
