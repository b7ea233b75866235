"""An operation's edges: its handlers registered on the Context, and records sent without blocking
(a mixin of :class:`~collectives.base.operation.Operation`).

State (made in ``Operation.__init__``): ``_registered`` (channel edges with a handler), ``_backlog``
(records parked for ``try_send``), ``_tls`` (whether this thread runs a handler)."""

from __future__ import annotations

import logging
from typing import Any
from collections.abc import Callable

from twisternet.errors import BackPressureTimeout

from ..edges import channel_edge, channel_edges, release_edge
from ..reduction import own, own_values
from .state import OperationState

log = logging.getLogger(__name__)


class EdgePlumbing(OperationState):
    """Operation part: handlers on the edges, non-blocking sends, unregistering at the end."""

    def _teardown(self) -> None:
        for e in self._registered:
            try:
                self.ctx.unregister(e)
            except Exception:  # the context may already be closed
                log.debug("unregister of edge %d failed", e, exc_info=True)
        self._registered = []
        if self.ctx.coflows is not None:
            self.ctx.coflows.detach(self.edge)
        self.ctx.untag_edges(channel_edges(self.edge))
        release_edge(self.ctx, self.edge)
        try:
            self._release_storage()
        except Exception:
            log.exception("%s: freeing storage failed", self.describe())

    def _register(self, offset: int, fn: Callable[[int, Any], bool], *, activates: bool = True) -> None:
        e = channel_edge(self.edge, offset)
        name = f"{self.operation}(edge={self.edge})+{offset}"
        self.ctx.register(e, self._wrap(fn, activates), name=name, on_error=self._on_edge_error)
        self._registered.append(e)

    def _wrap(self, fn: Callable[[int, Any], bool], activates: bool = True) -> Callable[[int, Any], bool]:
        def handle(src: int, obj: Any) -> bool:
            with self._lock:
                if self._closed or self._error is not None:
                    return True  # drop: the operation is over
                self._active = self._active or activates
                self._tls.in_handler = True
                try:
                    if self._backlog:
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
        return own(value) if self.ctx.record_views() else value

    def _own_values(self, values: list) -> list:
        """:meth:`_own` of every item of a freshly decoded list (in place)."""
        return own_values(values) if self.ctx.record_views() else values

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
