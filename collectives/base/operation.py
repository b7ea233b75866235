"""The :class:`Operation` base class: construction, the public calls every collective has (finish, close,
abort, when_settled), sends from user threads, waits, and the contract of algorithm helpers. Its locking
rules are in the :mod:`collectives.base` package docstring.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar, overload
from collections.abc import Callable, Iterable, Mapping

from twisternet.errors import BackPressureTimeout, ClosedError, ConfigError, OperationTimeout

from ..edges import ABORT, channel_edges, check_user_edge, claim_edge
from .arguments import MODES, Callback, Mode, task_list
from .failures import FailureSpread
from .plumbing import EdgePlumbing
from .results import ResultDelivery, Sink

if TYPE_CHECKING:
    from twisternet.context import Context

log = logging.getLogger(__name__)

_Op = TypeVar("_Op", bound="Operation")


class Operation(ResultDelivery, FailureSpread, EdgePlumbing):
    """Base of all collectives: ``Op(ctx, sources, destinations, edge, ..., mode, callback)``.

    ``sources``/``destinations`` are task ids of ``ctx.plan`` (None: every task); ``edge`` is this
    operation's user edge (see :mod:`collectives.edges`); ``limit`` caps the records the operation holds
    per queue in this process before it applies back pressure (default ``config.receive_pending_limit``);
    ``timeout`` bounds every blocking call (default ``config.timeout``); ``fanout`` is the arity of trees.
    """

    operation: ClassVar[str] = "Operation"

    def __init__(self, ctx: Context, sources: int | Iterable[int] | None, destinations: int | Iterable[int] | None,
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
        self.sources = task_list(self.plan, sources, "sources", self.plan.tasks)
        self.destinations = task_list(self.plan, destinations, "destinations", self.plan.tasks)
        self.callback = callback
        self.limit: int = limit if limit is not None else ctx.config.receive_pending_limit
        #: Bytes of streaming results held per local destination before back pressure (see config).
        self.byte_limit: int = ctx.config.receive_pending_bytes
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
        self._sinks = {t: Sink() for t in self.local_destinations}
        self._finished_local: set[int] = set()
        self._error: BaseException | None = None
        self._closed = False
        self._registered: list[int] = []
        self._changed = False
        self._active = False        # send/finish called or records handled: close() waits for duties
        self._spread: list[BaseException] = []   # local failures still to tell the other ranks about
        self._deferral: Callable[[int, BaseException], bool] | None = None   # see _defer_failures_to
        self._listeners: list[Callable[[BaseException | None], None]] = []   # when_settled callbacks
        #: Ranks that take part in this operation (sources' and destinations'): a failure reaches them all.
        self.member_ranks = sorted(set(self.source_ranks) | set(self.destination_ranks))
        # the Context's (live) table of lost peers: every blocking call looks at it first, cheaply
        self._ctx_lost: Mapping[int, str] = ctx.lost_view()
        #: Incarnation of the edge (the how-many-th operation on it in this process, alike on every rank).
        self.epoch = claim_edge(ctx, self.edge, f"{self.operation}(edge={self.edge})")
        # records of this incarnation carry its epoch and what it is (see the twisternet.context doc)
        ctx.tag_edges(channel_edges(self.edge), self.epoch, self.fingerprint(), self._on_edge_error)
        # Coflow hook (twisternet.coflow.live): with coflow_policy set, this operation instance is a
        # coflow (or joins the one of an enclosing ``ctx.coflow(...)`` block) until _teardown.
        coflows = ctx.coflows
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

    def __enter__(self: _Op) -> _Op:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __repr__(self) -> str:
        return (f"<{self.operation} edge={self.edge} mode={self.mode} rank={self.rank} "
                f"sources={self.sources} destinations={self.destinations}>")

    def _check_source(self, task: int) -> None:
        if self._closed:
            raise ClosedError(f"{self.describe()} on edge {self.edge} is closed")
        if task not in self.local_sources:
            raise ValueError(f"task {task!r} is not a source of {self.describe()} (edge {self.edge}) "
                             f"running on rank {self.rank}; local sources: {self.local_sources}")
        if task in self._finished_local:
            raise ValueError(f"source task {task} of {self.describe()} (edge {self.edge}) already finished")

    @overload
    def _dest(self, task: int | None, *, none_here: Literal[False] = False) -> int: ...
    @overload
    def _dest(self, task: int | None, *, none_here: bool) -> int | None: ...

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

    # ------------------------------------------------------------------ algorithm helpers' contract
    # What an operation's algorithm helper (e.g. collectives.allreduce.RankAllReduce) or driver (the
    # functional calls) may use, and all it may use, of the operation's state: its lock (the one record
    # handlers run under), whether it is over (failed, closed), a handler on an edge offset, a failure
    # spread to every rank, a say in whether another rank's failure waits, and a wake-up of waiters.

    def _state_lock(self) -> threading.RLock:
        """The lock record handlers run under: hold it to touch state shared with a handler."""
        return self._lock

    def _over(self) -> bool:
        """Failed or closed: a waiter must stop (then :meth:`_raise_if_failed` / ClosedError)."""
        return self._error is not None or self._closed

    def _failure(self) -> BaseException | None:
        """The error the operation failed with, or None."""
        return self._error

    def _is_closed(self) -> bool:
        """Whether :meth:`close` or :meth:`abort` ran (a failed operation is not closed until then)."""
        return self._closed

    def _defer_failures_to(self, fn: Callable[[int, BaseException], bool]) -> None:
        """``fn(call, err)`` decides whether a failure another rank had in its call ``call`` of a
        rank-level collective waits (True: ``fn`` keeps it) instead of failing the operation now."""
        self._deferral = fn

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
