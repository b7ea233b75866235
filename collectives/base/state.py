"""The state every part of an operation shares, declared once so that each part (a mixin of
:class:`~collectives.base.operation.Operation`, and the table paths of :mod:`collectives.columnar`) is
type-checked on its own.

``Operation.__init__`` makes all of it (the parts' docstrings say which part uses what); this class only
declares it: annotations, no values, so it adds nothing at run time. The methods one part calls on
another are declared under ``TYPE_CHECKING`` (their bodies live in the part that owns them).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Any, ClassVar, Literal, overload
from collections.abc import Callable, Iterator, Mapping

if TYPE_CHECKING:
    from twisternet.context import Context
    from twisternet.errors import OperationTimeout, ProtocolError
    from twisternet.task_plan import TaskPlan

    from .arguments import Callback, Mode
    from .results import Sink


class OperationState:
    """Declarations of the attributes (and cross-part methods) of an Operation; see the module doc."""

    #: The operation's kind, as errors and logs name it (set by each class).
    operation: ClassVar[str]
    # made from the arguments of Operation.__init__
    ctx: Context
    rank: int
    plan: TaskPlan
    edge: int
    mode: Mode
    sources: list[int]
    destinations: list[int]
    callback: Callback | None
    limit: int
    byte_limit: int
    timeout: float
    fanout: int
    local_sources: list[int]
    local_destinations: list[int]
    source_ranks: list[int]
    destination_ranks: list[int]
    member_ranks: list[int]
    epoch: int
    # shared by all parts: the operation's lock; waiters wake (ctx.notify) after a handler set _changed
    _lock: threading.RLock
    _changed: bool
    _active: bool
    _closed: bool
    _finished_local: set[int]
    _listeners: list[Callable[[BaseException | None], None]]
    # failures (failures.py)
    _error: BaseException | None
    _spread: list[BaseException]
    _deferral: Callable[[int, BaseException], bool] | None
    _ctx_lost: Mapping[int, str]
    # plumbing (plumbing.py)
    _registered: list[int]
    _backlog: deque[tuple[int, int, Any]]
    _tls: threading.local
    # results (results.py)
    _sinks: dict[int, Sink]
    _cbq: deque[tuple[int, Any]]
    _cb_lock: threading.Lock

    if TYPE_CHECKING:
        # operation.py
        def describe(self) -> str: ...
        def _check_source(self, task: int) -> None: ...
        @overload
        def _dest(self, task: int | None, *, none_here: Literal[False] = False) -> int: ...
        @overload
        def _dest(self, task: int | None, *, none_here: bool) -> int | None: ...
        def _dest(self, task: int | None, *, none_here: bool = False) -> int | None: ...
        def _input(self, task: int, capacity: Callable[[], bool], mutate: Callable[[], None], *,
                   block: bool = True, timeout: float | None = None) -> bool: ...
        def _wait(self, pred: Callable[[], bool], what: str, task: int | None, timeout: float | None,
                  exc: type[OperationTimeout] = ...) -> None: ...
        def _after(self) -> None: ...
        def _release_storage(self) -> None: ...
        # failures.py
        def _fail(self, e: BaseException, where: str = "") -> None: ...
        def _on_edge_error(self, e: BaseException) -> None: ...
        def _raise_if_failed(self) -> None: ...
        def _protocol(self, src: int, msg: Any) -> ProtocolError: ...
        # plumbing.py
        def _settle(self, timeout: float | None) -> None: ...
        def _try_drain(self) -> bool: ...
        # results.py
        def results(self, task: int | None = None, *, timeout: float | None = None) -> Iterator[Any]: ...
        def _sink_room(self, task: int) -> bool: ...
        def _deliver_many(self, task: int, items: list[Any]) -> None: ...
        def _complete(self, task: int, batch: Callable[[], Iterator[Any]],
                      values: Callable[[], Iterator[Any]] | None = None) -> None: ...
        def _consumed(self, task: int) -> None: ...
