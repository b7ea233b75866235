"""The state every part of a Context shares, declared once so that each part (a mixin of
:class:`~twisternet.context.api.Context`) is type-checked on its own.

``Context.__init__`` makes all of it (the parts' docstrings say which part owns what); this class only
declares it: annotations, no values, so it adds nothing at run time. The methods one part calls on
another are declared under ``TYPE_CHECKING`` (their bodies live in the part that owns them).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any
from collections.abc import Callable, Iterator

if TYPE_CHECKING:
    from ..channel import Buffer, Channel
    from ..codec import Codec
    from ..config import Config
    from ..errors import PeerLostError
    from ..framing import BufferPool
    from ..services import ServiceLink
    from ..task_plan import TaskPlan
    from .coflow_pump import CoflowPump
    from .push import SendHandle
    from .streams import Handler, _InStream, _OutMsg, _OutStream, _Sent


class ContextState:
    """Declarations of the attributes (and cross-part methods) of a Context; see the module doc."""

    # made from the arguments of Context.__init__
    channel: Channel
    config: Config
    rank: int
    world: int
    plan: TaskPlan
    codec: Codec
    pool: BufferPool
    services: ServiceLink
    #: Coflow scheduler of this process (None unless ``coflow_policy`` is set; twisternet.coflow.live).
    coflows: Any
    _credit: int
    _zc: int
    _busy_poll: float
    _on_close: Callable[[], None] | None
    _coflow_pump: CoflowPump | None
    _slice_limit: int
    _can_push: bool
    _small_ok: bool
    _left_peers: set[int]
    # shared by all parts: the Context lock and condition (waiters wake on a change of _gen)
    _lock: threading.RLock
    _cond: threading.Condition
    _gen: int
    _gens: Iterator[int]
    _cond_waiters: int
    # engine (engine.py)
    _thread: threading.Thread | None
    _chan_lock: threading.Lock
    _progress_thread_id: int | None
    _in_progress: threading.local
    _sleep_until: float
    _driven_at: float
    _seen: bool
    _inline: bool
    _stop: bool
    # outbound (outbound.py)
    _out: dict[tuple[int, int], _OutStream]
    _out_ready: set[tuple[int, int]]
    _out_partial: dict[tuple[int, int], float]
    _deferred: dict[Any, tuple[float, Callable[[], bool]]]
    _flush_delay: float
    _local_bytes: dict[int, int]
    # inbound (inbound.py)
    _in: dict[tuple[int, int], _InStream]
    _in_dirty: set[tuple[int, int]]
    _handlers: dict[int, tuple[Handler, str, tuple[int, str], Callable[[BaseException], None] | None]]
    _tags: dict[int, tuple[int, str]]
    _mismatched: set[tuple[Any, ...]]
    _tag_errors: dict[int, Callable[[BaseException], None]]
    _refused: dict[tuple[int, int], float]
    # losses (losses.py)
    _lost: dict[int, str]
    _lost_after: dict[int, int]
    _told: set[int]
    _failure: BaseException | None
    _reported_failure: BaseException | None
    _reported_heard: bool
    _reported_pair: tuple[int, int, str, str] | None
    _mismatch_pairs: set[tuple[int, int, str, str]]
    # lifecycle (lifecycle.py)
    _closed: bool

    if TYPE_CHECKING:
        # api.py
        def register_control_handler(self, edge: int, handler: Handler) -> None: ...
        def flush(self) -> None: ...
        def defer(self, key: Any, fn: Callable[[], bool]) -> None: ...
        def notify(self) -> None: ...
        def close(self, timeout: float | None = None) -> None: ...
        def wait_until(self, predicate: Callable[[], bool], *, timeout: float | None = None,
                       on_timeout: Callable[[], BaseException] | None = None) -> None: ...
        # engine.py
        def _on_engine_thread(self) -> bool: ...
        def _kick(self, wait: float = 0.0) -> None: ...
        def _progress_once(self, timeout: float, *, lock_held: bool = False, deliver: bool = True) -> bool: ...
        def _poll_channel(self, timeout: float, deliver: bool) -> bool: ...
        def _after_poll(self, deliver: bool) -> bool: ...
        def _spin(self, predicate: Callable[[], bool], until: float) -> bool | None: ...
        def _take_engine(self) -> bool: ...
        def _wait_change(self, gen: int, timeout: float) -> None: ...
        def _run_deferred(self, everything: bool = False) -> None: ...
        # outbound.py
        def _pump(self) -> bool: ...
        def _emit_partial(self, s: _OutStream) -> None: ...
        def _check_edge(self, edge: int) -> None: ...
        def _stream(self, dst: int, edge: int) -> _OutStream: ...
        @staticmethod
        def _stamp(s: _OutStream, msg: _OutMsg) -> None: ...
        def _queue(self, s: _OutStream, msg: _OutMsg) -> None: ...
        def _blocked(self, gen: int, deadline: float, limit: float, edge: int, what: str) -> None: ...
        def _send(self, dst: int, edge: int, obj: Any, *, block: bool, timeout: float | None,
                  closing: bool = False, wait_sent: bool = True, force: bool = False) -> bool | SendHandle: ...
        # push.py
        def _send_own(self, dst: int, edge: int, parts: list[Buffer], n: int, deadline: float,
                      limit: float) -> bool: ...
        def _wait_sent(self, done: _Sent, dst: int, edge: int, deadline: float, limit: float) -> None: ...
        def _drive_send(self, deadline: float) -> bool: ...
        # inbound.py
        def _deliver(self) -> bool: ...
        # losses.py
        def _raise_failures(self) -> None: ...
        def _lost_error(self, peer: int) -> PeerLostError: ...
        def _tell_loss(self, peer: int, reason: str) -> None: ...
        def _on_cause(self, src: int, obj: Any) -> None: ...
