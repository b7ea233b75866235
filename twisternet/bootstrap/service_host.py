"""Services hosted by the bootstrap master (barrier manager, coflow coordinator, ...).

A service handles worker requests ``{"service": name, ...}`` and timer ticks, and may answer ranks
lost; what it returns becomes ``(service, rank, msg)`` replies that the master sends as
``{"type": "service", "service": name, **msg}``. Everything runs on the master's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger(__name__)

ServiceHandle = Callable[[int, dict[str, Any]], "list[tuple[int, dict[str, Any]]]"]
ServiceTick = Callable[[], "list[tuple[int, dict[str, Any]]]"]
ServiceDeadline = Callable[[], "float | None"]
LostHook = Callable[[int], Iterable[tuple[str, int, dict[str, Any]]]]
#: (service name, destination rank, reply body without "type"/"service").
Reply = tuple[str, int, dict[str, Any]]


class _Service:
    __slots__ = ("handle", "name", "next_deadline", "tick")

    def __init__(self, name: str, handle: ServiceHandle, tick: ServiceTick | None,
                 next_deadline: ServiceDeadline | None) -> None:
        self.name = name
        self.handle = handle
        self.tick = tick
        self.next_deadline = next_deadline


class ServiceHost:
    """The master's services and peer-lost hooks; turns what they return into checked replies."""

    def __init__(self) -> None:
        self._services: dict[str, _Service] = {}
        self._lost_hooks: list[LostHook] = []

    def add(self, name: str, handle: ServiceHandle, tick: ServiceTick | None,
            next_deadline: ServiceDeadline | None) -> None:
        if name in self._services:
            log.warning("service %r replaced", name)
        self._services[name] = _Service(name, handle, tick, next_deadline)

    def add_lost_hook(self, hook: LostHook) -> None:
        self._lost_hooks.append(hook)

    def next_deadline(self) -> float | None:
        """The earliest time (``time.monotonic``) a service wants its tick, or None."""
        times = [d for d in (self._deadline(s) for s in list(self._services.values())) if d is not None]
        return min(times) if times else None

    def tick_due(self, now: float) -> list[Reply]:
        """Tick every service whose deadline passed; their replies."""
        out: list[Reply] = []
        for svc in list(self._services.values()):
            d = self._deadline(svc)
            if d is not None and d <= now:
                out += self._call(svc, svc.tick)  # type: ignore[arg-type]
        return out

    def handle(self, name: object, rank: int, msg: dict[str, Any]) -> list[Reply]:
        """A request from ``rank``; the replies (an ``error`` to ``rank`` for an unknown service or a
        handler that raised)."""
        svc = self._services.get(name) if isinstance(name, str) else None
        if svc is None:
            return [(name, rank, {"error": f"no service named {name!r} on the master"})]  # type: ignore[list-item]
        return self._call(svc, lambda: svc.handle(rank, msg), src=rank)

    def on_lost(self, rank: int) -> list[Reply]:
        """What the peer-lost hooks answer to the loss of ``rank``."""
        out: list[Reply] = []
        for hook in list(self._lost_hooks):
            try:
                replies = list(hook(rank) or ())
            except Exception:
                log.exception("bootstrap master: peer-lost hook failed for rank %d", rank)
                continue
            for item in replies:
                try:
                    name, to, msg = item
                except (TypeError, ValueError):
                    log.error("bootstrap master: peer-lost hook returned %r, not (service, rank, dict)", item)
                    continue
                if isinstance(msg, dict):
                    out.append((name, to, msg))
        return out

    def _deadline(self, svc: _Service) -> float | None:
        if svc.next_deadline is None:
            return None
        try:
            return svc.next_deadline()
        except Exception:
            log.exception("bootstrap master: service %r next_deadline() failed", svc.name)
            return None

    def _call(self, svc: _Service, call: Callable[[], Iterable[tuple[int, dict[str, Any]]]],
              src: int | None = None) -> list[Reply]:
        try:
            replies = list(call() or ())
        except Exception as e:
            log.exception("bootstrap master: service %r failed", svc.name)
            return [] if src is None else [(svc.name, src, {"error": f"{type(e).__name__}: {e}"})]
        out: list[Reply] = []
        for item in replies:
            try:
                rank, msg = item
            except (TypeError, ValueError):
                log.error("bootstrap master: service %r returned %r, not a (rank, dict) pair",
                          svc.name, item)
                continue
            if not isinstance(msg, dict) or msg.get("type", "service") != "service":
                log.error("bootstrap master: service %r reply %r is not a dict without a 'type' key; "
                          "dropped", svc.name, msg)
                continue
            out.append((svc.name, rank, msg))
        return out
