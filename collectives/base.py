"""The machinery every collective shares: task/edge validation, handler wrapping, non-blocking emission,
back-pressure waits, result sinks (iterator or callback), diagnostics and clean shutdown.

Locking: each operation has one re-entrant lock guarding its state. Handlers (progress thread) take it;
user calls take it only to mutate state, never while blocking. Calls into the Context made under the
lock never block: sends from a handler are queued by the core regardless of credit, and sends from a
user thread use ``try_send`` and park the record in a small backlog that the same call then waits to
hand over (outside the lock) or that the next handler call forwards.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import numpy as np
from typing import Any, ClassVar, Literal
from collections.abc import Callable, Iterable, Iterator, Sequence

from twisternet.errors import (BackPressureTimeout, ClosedError, ConfigError, MismatchError, OperationTimeout,
                               PeerLostError, ProtocolError, RemoteError, TwisternetError)

from .edges import ABORT, channel_edge, channel_edges, check_user_edge, claim_edge, release_edge
from .reduction import own, own_values

log = logging.getLogger(__name__)

Mode = Literal["streaming", "batch"]
#: ``callback(destination_task, item)``; see each operation for what ``item`` is.
Callback = Callable[[int, Any], None]
MODES = ("streaming", "batch")
_BATCH_MARK = object()


def record_nbytes(item: Any) -> int:
    """Bytes of the large parts of a result (arrays, bytes, strings; one level into a tuple or list,
    e.g. a ``(source, array)`` pair): what the streaming byte bound counts. 0 for small records."""
    t = type(item)
    if t is np.ndarray:
        return item.nbytes
    if t is bytes or t is str or t is bytearray:
        return len(item)
    if (t is tuple or t is list) and len(item) <= 4:
        n = 0
        for x in item:
            tx = type(x)
            if tx is np.ndarray:
                n += x.nbytes
            elif tx is bytes or tx is str or tx is bytearray:
                n += len(x)
        return n
    return 0


class _Sink:
    """Results waiting for one local destination task."""

    __slots__ = ("items", "ended", "complete", "batch", "values", "consumed", "nbytes")

    def __init__(self) -> None:
        self.nbytes = 0             # record_nbytes of the items (streaming)
        self.items: deque = deque()
        self.ended = False          # streaming: no more items will come
        self.complete = False       # batch: the result is ready
        self.batch: Callable[[], Iterator[Any]] = lambda: iter(())
        self.values: Callable[[], Iterator[Any]] | None = None   # batch values alone, if cheaper
        self.consumed = False


def _task_list(plan: Any, tasks: int | Iterable[int] | None, what: str, default: Sequence[int]) -> list[int]:
    if tasks is None:
        tasks = default
    if isinstance(tasks, int) and not isinstance(tasks, bool):
        tasks = [tasks]
    try:
        out = sorted(set(tasks))
    except TypeError:
        raise ConfigError(what, f"must be a task id or a collection of task ids, got {tasks!r}") from None
    if not out:
        raise ConfigError(what, "must name at least one task")
    for t in out:
        if not isinstance(t, int) or isinstance(t, bool) or t not in plan:
            raise ConfigError(what, f"task {t!r} is not in the task plan {plan!r}")
    return out


def pick_alias(operation: str, canonical: str, given: dict[str, Any]) -> Any:
    """The one value the keywords in ``given`` (a canonical name and its aliases, e.g. ``destinations``,
    ``destination``, ``root``, ``dst``) name, or None if none is given; TypeError if two disagree."""
    named = {k: v for k, v in given.items() if v is not None}
    if len({repr(v) for v in named.values()}) > 1:
        listing = ", ".join(f"{k}={v!r}" for k, v in named.items())
        raise TypeError(f"{operation}: {listing} name different {canonical}; give one of "
                        f"{', '.join(given)}")
    return next(iter(named.values()), None)


class Operation:
    """Base of all collectives: ``Op(ctx, sources, destinations, edge, ..., mode, callback)``.

    ``sources``/``destinations`` are task ids of ``ctx.plan`` (None: every task); ``edge`` is this
    operation's user edge (see :mod:`collectives.edges`); ``limit`` caps the records the operation holds
    per queue in this process before it applies back pressure (default ``config.receive_pending_limit``);
    ``timeout`` bounds every blocking call (default ``config.timeout``); ``fanout`` is the arity of trees.
    """

    operation: ClassVar[str] = "Operation"

    def __init__(self, ctx: Any, sources: int | Iterable[int] | None, destinations: int | Iterable[int] | None,
                 edge: int, *, mode: Mode = "batch", callback: Callback | None = None,
                 limit: int | None = None, timeout: float | None = None, fanout: int = 2) -> None:
        if mode not in MODES:
            raise ConfigError("mode", f"must be 'streaming' or 'batch', got {mode!r}")
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable, got {callback!r}")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise ConfigError("limit", f"must be an int >= 1, got {limit!r}")
        if timeout is not None and not timeout > 0:
            raise ConfigError("timeout", f"must be > 0 seconds, got {timeout!r}")
        if not isinstance(fanout, int) or isinstance(fanout, bool) or fanout < 1:
            raise ConfigError("fanout", f"must be an int >= 1, got {fanout!r}")
        self.ctx = ctx
        self.rank: int = ctx.rank
        self.plan = ctx.plan
        self.edge = check_user_edge(edge)
        self.mode: Mode = mode
        self.sources = _task_list(self.plan, sources, "sources", self.plan.tasks)
        self.destinations = _task_list(self.plan, destinations, "destinations", self.plan.tasks)
        self.callback = callback
        self.limit: int = limit if limit is not None else ctx.config.receive_pending_limit
        #: Bytes of streaming results held per local destination before back pressure (see config).
        self.byte_limit: int = getattr(ctx.config, "receive_pending_bytes", 64 << 20)
        self.timeout: float = timeout if timeout is not None else ctx.config.timeout
        self.fanout = fanout
        self.local_sources = [t for t in self.sources if self.plan.rank_of(t) == self.rank]
        self.local_destinations = [t for t in self.destinations if self.plan.rank_of(t) == self.rank]
        self.source_ranks = self.plan.ranks_of(self.sources)
        self.destination_ranks = self.plan.ranks_of(self.destinations)

        self._lock = threading.RLock()
        self._tls = threading.local()
        self._backlog: deque[tuple[int, int, Any]] = deque()
        self._cbq: deque[tuple[int, Any]] = deque()
        self._cb_lock = threading.Lock()
        self._sinks = {t: _Sink() for t in self.local_destinations}
        self._finished_local: set[int] = set()
        self._error: BaseException | None = None
        self._closed = False
        self._registered: list[int] = []
        self._changed = False
        self._active = False        # send/finish called or records handled: close() waits for duties
        self._spread: list[BaseException] = []   # local failures still to tell the other ranks about
        self._listeners: list[Callable[[BaseException | None], None]] = []   # when_settled callbacks
        #: Ranks that take part in this operation (sources' and destinations'): a failure reaches them all.
        self.member_ranks = sorted(set(self.source_ranks) | set(self.destination_ranks))
        # the Context's (live) table of lost peers: every blocking call looks at it first, cheaply
        lost = getattr(ctx, "_lost", None)
        self._ctx_lost: dict = lost if isinstance(lost, dict) else {}
        #: Incarnation of the edge (the how-many-th operation on it in this process, alike on every rank).
        self.epoch = claim_edge(ctx, self.edge, f"{self.operation}(edge={self.edge})")
        tag = getattr(ctx, "tag_edges", None)
        if tag is not None:   # records of this incarnation carry its epoch and what it is (context doc)
            tag(channel_edges(self.edge), self.epoch, self.fingerprint(), self._on_edge_error)
        # Coflow hook (twisternet.coflow.live): with coflow_policy set, this operation instance is a
        # coflow (or joins the one of an enclosing ``ctx.coflow(...)`` block) until _teardown.
        coflows = getattr(ctx, "coflows", None)
        try:
            if coflows is not None:
                coflows.attach(self.edge, self.operation, self.source_ranks, self.destination_ranks)
            with self._lock:  # records buffered before registration may arrive at once: hold them off
                self._register(ABORT, self._on_abort, activates=False)
                self._setup()
        except BaseException:
            self._teardown()
            raise

    # ------------------------------------------------------------------ to override
    def _setup(self) -> None:
        """Build routing state and register handlers (called once from ``__init__``)."""

    def _on_local_finish(self, task: int) -> None:
        """Local source ``task`` finished (under the lock): pass that on."""
        raise NotImplementedError

    def _known_finished(self, task: int | None) -> set[int]:
        """Sources this process knows have finished (for OperationTimeout diagnostics)."""
        return set(self._finished_local)

    def _release_storage(self) -> None:
        """Free spill files and large buffers (called once results are consumed, and on close)."""

    # ------------------------------------------------------------------ public API
    def describe(self) -> str:
        """Short human description used in errors and logs."""
        return f"{self.mode} {self.operation}"

    def fingerprint(self) -> str:
        """What every rank's operation on this edge must agree on (kind, reduction, tasks, fanout): the
        first record of each stream carries it, and a receiver running something else raises."""
        def tasks(ts: list[int]) -> str:
            if len(ts) <= 8:
                return str(ts)
            import zlib
            return f"{len(ts)} tasks #{zlib.crc32(repr(ts).encode()):08x}"
        import re
        # a callable's repr may hold its address (functools.partial, instances): alike in no two processes
        what = re.sub(r" at 0x[0-9a-fA-F]+", "", self.describe())
        return (f"{what} (edge {self.edge}, sources {tasks(self.sources)}, destinations "
                f"{tasks(self.destinations)}, fanout {self.fanout})")

    def finish(self, task: int) -> None:
        """End the stream of source ``task`` (batch: required; streaming: ends it)."""
        self._check_source(task)
        if self._ctx_lost:
            self._check_peers()
        with self._lock:
            self._raise_if_failed()
            self._active = True
            self._finished_local.add(task)
            failed = self._guarded(lambda: self._on_local_finish(task), f"in finish() of task {task}")
        if failed is not None:
            self._after()
            raise failed
        self._settle(None)
        self._after()

    def results(self, task: int | None = None, *, timeout: float | None = None) -> Iterator[Any]:
        """Results for local destination ``task`` (default: the only one in this process; on a rank
        that runs no destination task, nothing: every rank may iterate, as SPMD code does).

        Batch: waits until every source finished, then yields every result. Streaming: yields results
        as they form and stops once every source finished. ``timeout`` bounds each wait and raises
        OperationTimeout naming the sources that never finished.
        """
        task = self._dest(task, none_here=True)
        if self.callback is not None:
            raise TwisternetError(f"{self.describe()} on edge {self.edge} delivers its results to the callback")
        if task is None:
            return iter(())     # this rank runs no destination task: it has no results
        return self._iter_results(task, timeout)

    def drain(self, task: int | None = None) -> list[Any]:
        """Streaming: the results available now, without waiting (empty list if none)."""
        task = self._dest(task, none_here=True)
        if self.mode != "streaming":
            raise TwisternetError("drain() is for streaming operations; use results() in batch mode")
        self._raise_if_failed()
        if task is None:
            return []
        with self._lock:
            sink = self._sinks[task]
            items = list(sink.items)
            sink.items.clear()
            sink.nbytes = 0
        if items:
            self._resume_all()
        return items

    def done(self, task: int | None = None) -> bool:
        """Whether destination ``task`` has its whole result (batch) or saw the end of the stream."""
        task = self._dest(task)
        with self._lock:
            sink = self._sinks[task]
            return sink.complete if self.mode == "batch" else (sink.ended and not sink.items)

    def pending(self) -> int:
        """Records this operation holds in this process right now (result queues, per-input queues,
        records waiting to be handed to the Context); batch stores are bounded by bytes, not counted."""
        with self._lock:
            return len(self._backlog) + sum(len(s.items) for s in self._sinks.values()) + self._held()

    def _held(self) -> int:
        return 0

    def close(self, *, timeout: float | None = None) -> None:
        """Finish this process's part, then stop handling the edges, free the edge id, remove spill files.

        This process may be an inner node of a tree that still has to pass records on for other ranks, so
        ``close`` first waits (up to ``timeout``) until everything this process owes others is sent; use
        :meth:`abort` to stop at once.
        """
        if self._closed:
            return
        if self._error is None and self._active and not self.ctx.closed:
            def owed() -> bool:
                with self._lock:
                    return not self._backlog and self._duties_done()
            if not owed():
                self._try_drain()
                self._wait(lambda: self._try_drain() and owed(), "close() waited for this process's share of "
                           "the operation (records still owed to other ranks)", None, timeout)
        self.abort()

    def abort(self) -> None:
        """Stop at once: unregister the edges, free the edge id, remove spill files."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._teardown()
        self._check_settled()
        self.ctx.notify()

    def _duties_done(self) -> bool:
        """Whether this process passed on everything it owes other ranks (inner tree nodes)."""
        return True

    def when_settled(self, fn: Callable[[BaseException | None], None]) -> None:
        """Batch mode: call ``fn(None)`` once this process's part is over (every local destination has its
        result, every local source finished and nothing is owed to other ranks), or ``fn(error)`` once
        the operation failed or was closed; from whichever thread got it there (often the progress
        thread), outside the lock. What non-blocking calls (:mod:`collectives.handles`) complete on."""
        with self._lock:
            self._listeners.append(fn)
        self._check_settled()

    def _check_settled(self) -> None:
        if not self._listeners:
            return
        with self._lock:
            if self._error is not None:
                err: BaseException | None = self._error
            elif self._closed:
                err = ClosedError(f"{self.describe()} on edge {self.edge} was closed")
            elif (self.mode == "batch" and all(s.complete for s in self._sinks.values())
                  and self._finished_local.issuperset(self.local_sources) and not self._backlog
                  and self._duties_done()):
                err = None
            else:
                return
            fns, self._listeners = self._listeners, []
        for fn in fns:
            fn(err)

    def __enter__(self) -> Operation:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __repr__(self) -> str:
        return (f"<{self.operation} edge={self.edge} mode={self.mode} rank={self.rank} "
                f"sources={self.sources} destinations={self.destinations}>")

    # ------------------------------------------------------------------ plumbing for subclasses
    def _teardown(self) -> None:
        for e in self._registered:
            try:
                self.ctx.unregister(e)
            except Exception:  # noqa: BLE001 - the context may already be closed
                log.debug("unregister of edge %d failed", e, exc_info=True)
        self._registered = []
        coflows = getattr(self.ctx, "coflows", None)
        if coflows is not None:
            coflows.detach(self.edge)
        untag = getattr(self.ctx, "untag_edges", None)
        if untag is not None:
            untag(channel_edges(self.edge))
        release_edge(self.ctx, self.edge)
        try:
            self._release_storage()
        except Exception:  # noqa: BLE001
            log.exception("%s: freeing storage failed", self.describe())

    def _register(self, offset: int, fn: Callable[[int, Any], bool], *, activates: bool = True) -> None:
        e = channel_edge(self.edge, offset)
        name = f"{self.operation}(edge={self.edge})+{offset}"
        if getattr(self.ctx, "tag_edges", None) is not None:
            self.ctx.register(e, self._wrap(fn, activates), name=name, on_error=self._on_edge_error)
        else:
            self.ctx.register(e, self._wrap(fn, activates), name=name)
        self._registered.append(e)

    def _wrap(self, fn: Callable[[int, Any], bool], activates: bool = True) -> Callable[[int, Any], bool]:
        def handle(src: int, obj: Any) -> bool:
            with self._lock:
                if self._closed or self._error is not None:
                    return True  # drop: the operation is over
                self._active = self._active or activates
                self._tls.in_handler = True
                try:
                    self._forward_backlog()
                    ok = fn(src, obj)
                except Exception as e:  # noqa: BLE001 - reported to every waiter of this operation
                    self._fail(e, f"while handling a record from rank {src}")
                    ok = True
                finally:
                    self._tls.in_handler = False
            self._after()
            return ok
        return handle

    def _in_handler(self) -> bool:
        return getattr(self._tls, "in_handler", False)

    def _own(self, value: Any) -> Any:
        """A received ``value`` made safe to keep past the handler call (see ``reduction.own``): only
        records that may hold views of the receive buffer are walked."""
        views = getattr(self.ctx, "record_views", None)
        return own(value) if views is None or views() else value

    def _own_values(self, values: list) -> list:
        """:meth:`_own` of every item of a freshly decoded list (in place)."""
        views = getattr(self.ctx, "record_views", None)
        return own_values(values) if views is None or views() else values

    def _emit(self, dst: int, offset: int, obj: Any) -> None:
        """Send ``obj`` to ``dst`` on channel edge ``offset`` without blocking (call under the lock)."""
        e = channel_edge(self.edge, offset)
        if self._in_handler():
            self.ctx.send(dst, e, obj)  # queued by the core even without credit; never blocks here
        elif not self._backlog and self.ctx.try_send(dst, e, obj):
            pass
        else:
            self._backlog.append((dst, e, obj))

    def _forward_backlog(self) -> None:
        while self._backlog:
            dst, e, obj = self._backlog.popleft()
            self.ctx.send(dst, e, obj)

    def _try_drain(self) -> bool:
        if not self._backlog:
            return True
        with self._lock:
            while self._backlog:
                dst, e, obj = self._backlog[0]
                if not self.ctx.try_send(dst, e, obj):
                    return False
                self._backlog.popleft()
            return True

    def _settle(self, timeout: float | None) -> None:
        """Wait (outside the lock) until records parked by this thread are handed to the Context."""
        if not self._try_drain():
            self._wait(self._try_drain, "send blocked by back pressure", None, timeout, BackPressureTimeout)

    def _can_send(self, dst: int, offset: int) -> bool:
        return dst == self.rank or self.ctx.can_send(dst, channel_edge(self.edge, offset))

    def _check_source(self, task: int) -> None:
        if self._closed:
            raise ClosedError(f"{self.describe()} on edge {self.edge} is closed")
        if task not in self.local_sources:
            raise ValueError(f"task {task!r} is not a source of {self.describe()} (edge {self.edge}) "
                             f"running on rank {self.rank}; local sources: {self.local_sources}")
        if task in self._finished_local:
            raise ValueError(f"source task {task} of {self.describe()} (edge {self.edge}) already finished")

    def _dest(self, task: int | None, *, none_here: bool = False) -> int | None:
        """The local destination ``task`` names (default: the only one here). With ``none_here``, a rank
        that runs no destination gets None (it has no results: iterating them yields nothing)."""
        if task is None:
            if not self.local_destinations and none_here:
                return None
            if not self.local_destinations:
                raise ValueError(
                    f"rank {self.rank} runs none of the destination tasks {self.destinations} of {self.describe()} "
                    f"(edge {self.edge}), so it has no result; call this on the ranks that run them "
                    f"({self.destination_ranks}), e.g. under `if ctx.rank in op.destination_ranks:`, or "
                    "iterate results(), which yields nothing on other ranks")
            if len(self.local_destinations) > 1:
                raise ValueError(
                    f"rank {self.rank} runs several destination tasks {self.local_destinations} of "
                    f"{self.describe()} (edge {self.edge}); say which one: pass task=, e.g. "
                    f"`for t in op.local_destinations: op.results(task=t)`")
            return self.local_destinations[0]
        if task not in self._sinks:
            raise ValueError(f"task {task!r} is not a destination of {self.describe()} (edge {self.edge}) "
                             f"on rank {self.rank}; local destinations: {self.local_destinations}")
        return task

    def _check_peers(self) -> None:
        """PeerLostError (naming the first rank lost) if a rank of this operation is gone: a send that
        only buffers locally (batch) would otherwise notice no earlier than finish()."""
        if self._ctx_lost and any(r in self._ctx_lost for r in self.member_ranks):
            self.ctx.check_lost()

    def _input(self, task: int, capacity: Callable[[], bool], mutate: Callable[[], None], *,
               block: bool = True, timeout: float | None = None) -> bool:
        """Common path of a local source's send: wait for capacity, mutate under the lock, hand over."""
        self._check_source(task)
        self._raise_if_failed()
        if self._ctx_lost:
            self._check_peers()

        # The capacity check is advisory (limits are soft), so it runs without the lock: taking it for
        # every record would contend with the progress thread.
        if not capacity():
            if not block:
                return False
            self._wait(capacity, "send blocked by back pressure", None, timeout, BackPressureTimeout)
        with self._lock:
            self._raise_if_failed()
            self._active = True
            failed = self._guarded(mutate, f"in send() of task {task}")
        if failed is not None:
            self._after()
            raise failed
        if block:
            self._settle(timeout)
        else:
            self._try_drain()
        self._after()
        return True

    def _wait(self, pred: Callable[[], bool], what: str, task: int | None, timeout: float | None,
              exc: type[OperationTimeout] = OperationTimeout) -> None:
        t = self.timeout if timeout is None else timeout

        def ready() -> bool:
            return self._error is not None or self._closed or pred()

        def on_timeout() -> BaseException:
            with self._lock:
                missing = set(self.sources) - self._known_finished(task)
            return exc(f"{self.describe()}: {what}", edge=self.edge, operation=self.operation,
                       missing_sources=missing, timeout=t)
        self.ctx.wait_until(ready, timeout=t, on_timeout=on_timeout)
        self._raise_if_failed()
        if self._closed:
            raise ClosedError(f"{self.describe()} on edge {self.edge} was closed")

    def _fail(self, e: BaseException, where: str = "") -> None:
        """The operation failed with ``e``: every waiter in this process raises it, and (unless it came
        from another rank or is a lost peer, which every rank sees itself) it is sent to the other ranks
        of the operation (by :meth:`_after`, outside the lock), so they raise too instead of waiting."""
        if self._error is None:
            self._error = e
            log.error("rank %d: %s on edge %d failed %s: %r", self.rank, self.describe(), self.edge, where, e)
            if not isinstance(e, (RemoteError, PeerLostError)) and not getattr(e, "remote", False):
                self._spread.append(e)
        self._changed = True

    def _spread_failure(self) -> None:
        """Tell every other rank of the operation why it failed here (one record each on ``ABORT``)."""
        with self._lock:
            if not self._spread:
                return
            e = self._spread.pop()
            self._spread.clear()
        notice = [self.rank, type(e).__name__, str(e), list(getattr(e, "ranks", []) or []), getattr(e, "call", None)]
        edge = channel_edge(self.edge, ABORT)
        for r in self.member_ranks:
            if r == self.rank or r in self.ctx.lost_peers:
                continue
            try:
                self.ctx.send(r, edge, notice, timeout=min(self.timeout, 5.0))
            except TwisternetError as err:   # a peer that is gone or stuck hears of it some other way
                log.debug("rank %d: could not tell rank %d of the failure: %r", self.rank, r, err)

    def _on_edge_error(self, e: BaseException) -> None:
        """The Context found records of another operation on this one's edges (MismatchError): fail."""
        e.remote = True   # type: ignore[attr-defined]  # the Context told the peer itself
        with self._lock:
            self._fail(e, "")
        self._after()

    def _on_abort(self, src: int, notice: Any) -> bool:
        """Another rank's part of the operation failed: fail here with the same error."""
        try:
            origin, kind, message, ranks, call = notice
        except (TypeError, ValueError):
            raise self._protocol(src, notice) from None
        err: BaseException
        if kind == "MismatchError":
            err = MismatchError(str(message), ranks)
        else:
            err = RemoteError(int(origin), f"{kind}: {message}")
        err.remote = True   # type: ignore[attr-defined]  # do not send it back
        if call is not None and self._defer_failure(call, err):
            return True
        self._fail(err, f"on rank {origin}")
        return True

    def _defer_failure(self, call: int, err: BaseException) -> bool:
        """Whether a failure another rank had in its call ``call`` (of a rank-level collective such as
        ``allreduce``) waits until this rank makes that call, because it is still in an earlier one."""
        return False

    def _guarded(self, fn: Callable[[], None], where: str) -> BaseException | None:
        """Run ``fn`` (under the operation's lock): an error of the user's code in it (e.g. the reduction
        raised) fails the operation on every rank and is returned, for the caller to raise once it has
        let go of the lock; the library's own errors propagate as they are."""
        try:
            fn()
        except TwisternetError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the reduction raised: every rank must hear of it
            self._fail(e, where)
            return e
        return None

    # ------------------------------------------------------------------ algorithm helpers' contract
    # What an operation's algorithm helper (e.g. collectives.allreduce.RankAllReduce) may use, and all it
    # may use, of the operation's state: its lock (the one record handlers run under), whether it is
    # over, a handler on an edge offset, a failure spread to every rank, and a wake-up of waiters.

    def _state_lock(self) -> threading.RLock:
        """The lock record handlers run under: hold it to touch state shared with a handler."""
        return self._lock

    def _over(self) -> bool:
        """Failed or closed: a waiter must stop (then :meth:`_raise_if_failed` / ClosedError)."""
        return self._error is not None or self._closed

    def _add_handler(self, offset: int, fn: Callable[[int, Any], bool]) -> None:
        """Records on ``offset`` go to ``fn(src, record)`` under the lock; they do not mark the operation
        active (a rank-level collective's records, not a stream's)."""
        self._register(offset, fn, activates=False)

    def _fail_everywhere(self, e: BaseException, where: str) -> None:
        """Fail the operation with ``e`` here and tell the other ranks (call outside the lock)."""
        with self._lock:
            self._fail(e, where)
        self._after()

    def _mark_changed(self) -> None:
        """State a waiter may look at changed (under the lock): waiters wake after the handler."""
        self._changed = True

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _protocol(self, src: int, msg: Any) -> ProtocolError:
        return ProtocolError(f"{self.describe()} edge {self.edge}: unexpected record from rank {src}: {msg!r:.200}")

    # ------------------------------------------------------------------ results
    def _sink_room(self, task: int) -> bool:
        if self.callback is not None or self.mode == "batch":
            return True
        sink = self._sinks[task]
        return len(sink.items) < self.limit and (sink.nbytes < self.byte_limit or not sink.items)

    def _sinks_room(self) -> bool:
        return all(self._sink_room(t) for t in self._sinks)

    def _deliver(self, task: int, item: Any) -> None:
        """Streaming result ``item`` for local destination ``task`` (under the lock)."""
        if self.callback is not None:
            self._cbq.append((task, item))
        else:
            sink = self._sinks[task]
            sink.items.append(item)
            sink.nbytes += record_nbytes(item)
        self._changed = True

    def _deliver_many(self, task: int, items: list) -> None:
        """:meth:`_deliver` of each of ``items``, in order (under the lock)."""
        if self.callback is not None:
            self._cbq.extend((task, it) for it in items)
        else:
            sink = self._sinks[task]
            sink.items.extend(items)
            n = 0
            for it in items:
                n += record_nbytes(it)
            sink.nbytes += n
        self._changed = True

    def _end(self, task: int) -> None:
        """Streaming: destination ``task`` will get nothing more."""
        self._sinks[task].ended = True
        self._changed = True

    def _complete(self, task: int, batch: Callable[[], Iterator[Any]],
                  values: Callable[[], Iterator[Any]] | None = None) -> None:
        """Batch: destination ``task``'s results are ready; ``batch()`` iterates them. Operations whose
        results are ``(source_task, value)`` pairs may pass ``values()``, iterating the values alone."""
        sink = self._sinks[task]
        sink.batch = batch
        sink.values = values
        sink.complete = True
        self._changed = True
        if self.callback is not None:
            self._cbq.append((task, _BATCH_MARK))

    def _consumed(self, task: int) -> None:
        with self._lock:
            self._sinks[task].consumed = True
            every = all(s.consumed for s in self._sinks.values())
        if every:
            self._release_storage()

    def _iter_values(self, task: int | None, timeout: float | None) -> Iterator[Any]:
        """Batch results that are ``(source_task, value)`` pairs, without the source tasks."""
        task = self._dest(task, none_here=True)
        if self.callback is not None:
            raise TwisternetError(f"{self.describe()} on edge {self.edge} delivers its results to the callback")
        if self.mode != "batch":
            raise TwisternetError("values() is for batch operations; use results() in streaming mode")
        if task is None:
            return iter(())     # this rank runs no destination task: it has no results
        return self._values_gen(task, timeout)

    def _values_gen(self, task: int, timeout: float | None) -> Iterator[Any]:
        sink = self._sinks[task]
        self._wait(lambda: sink.complete, "batch results not complete", task, timeout)
        if sink.values is not None:
            yield from sink.values()
        else:
            for item in sink.batch():
                yield item[1]
        self._consumed(task)

    def _iter_results(self, task: int, timeout: float | None) -> Iterator[Any]:
        sink = self._sinks[task]
        if self.mode == "batch":
            self._wait(lambda: sink.complete, "batch results not complete", task, timeout)
            yield from sink.batch()
            self._consumed(task)
            return
        # The items taken out stay counted against the byte bound until the caller has moved past them
        # (a slow consumer holds them meanwhile), so held + queued bytes stay within the bound.
        in_hand = 0
        try:
            while True:
                if in_hand:
                    with self._lock:
                        sink.nbytes = max(0, sink.nbytes - in_hand)
                    in_hand = 0
                    self._resume_all()
                self._wait(lambda: bool(sink.items) or sink.ended, "no streaming result arrived", task, timeout)
                with self._lock:
                    items = list(sink.items)
                    sink.items.clear()
                    in_hand = sink.nbytes
                    ended = sink.ended
                if items and self._sink_room(task):
                    self._resume_all()
                yield from items
                if ended:
                    return
        finally:
            if in_hand:
                with self._lock:
                    sink.nbytes = max(0, sink.nbytes - in_hand)

    def _resume_all(self) -> None:
        for e in self._registered:
            self.ctx.resume(e)

    def _after(self) -> None:
        """Outside the lock: run queued callbacks, tell other ranks of a failure, wake waiters."""
        if self._cbq:
            self._run_callbacks()
        if self._spread:
            self._spread_failure()
        if self._changed:
            self._changed = False
            self.ctx.notify()
        if self._listeners:
            self._check_settled()

    def _run_callbacks(self) -> None:
        cb = self.callback
        while self._cbq:
            if not self._cb_lock.acquire(blocking=False):
                return
            try:
                while self._cbq:
                    task, item = self._cbq.popleft()
                    try:
                        if item is _BATCH_MARK:
                            for it in self._sinks[task].batch():
                                cb(task, it)
                            self._consumed(task)
                        else:
                            cb(task, item)
                    except Exception as e:  # noqa: BLE001 - surfaces to every waiter
                        with self._lock:
                            self._fail(e, "in the user callback")
            finally:
                self._cb_lock.release()
