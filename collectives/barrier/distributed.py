"""Barriers bound to a job: ``PartialBarrier(ctx, name, max, ...)`` as in the design.

The state machines of this package run in the job's coordinator (the bootstrap master under TCP,
rank 0 under MPI and the local channel, see :mod:`twisternet.services`); these classes send the
enters and wait for the answers. Every wait is bounded (default: the config's ``timeout``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .client import BarrierClient
from .records import BarrierRelease
from .specs import BarrierSpec, SemaphoreSpec

if TYPE_CHECKING:
    from twisternet.context import Context

SERVICE = "barrier"


def barrier_client(ctx: Context) -> BarrierClient:
    """The one BarrierClient of ``ctx``, wired to the coordinator."""
    client = ctx.services.cache.get(SERVICE)
    if client is None:
        client = BarrierClient(lambda msg: ctx.services.send(SERVICE, msg))
        ctx.services.subscribe(SERVICE, client.deliver)
        ctx.services.cache[SERVICE] = client
    return client


def set_enter_callback(ctx: Context, name: str, callback: Any, callback_timeout: float | None = None) -> None:
    """Install the enter-callback ``callback(label, rank, default) -> bool`` of barrier ``name``: it may
    veto (False) or force (True) the fire and is re-invoked every ``callback_timeout`` seconds even when
    nobody arrives. Python callables cannot cross processes, so this works on the rank that hosts the
    coordinator (rank 0 under MPI and the local channel); under TCP the bootstrap master hosts it."""
    svc = ctx.services.local_service(SERVICE)
    if svc is None:
        from twisternet.errors import TwisternetError
        raise TwisternetError(f"the barrier coordinator runs on the {ctx.services.coordinator}, not in rank "
                              f"{ctx.rank}: install enter-callbacks in rank 0 of an MPI or local job")
    svc.set_enter_callback(name, callback, callback_timeout)


class PartialBarrier:
    """A partial barrier of the job (Albrecht et al. 2006) entered by logical tasks (labels).

    Fires when ``max`` unique labels entered; or, counted from the first entry, after ``timeout``;
    or early once ``percent``% of ``max`` entered and ``min_wait`` seconds passed; or (``knee=True``)
    when arrivals stop following their recent pace. A late arrival passes at once (``late="pass"``,
    status ``LATE_FIRE``) or raises ``CatchUp`` (``late="catch_up"``). Every participant must create
    it with the same arguments.
    """

    def __init__(self, ctx: Context, name: str, max: int, timeout: float | None = None,
                 percent: float | None = None, min_wait: float | None = None, late: str = "pass",
                 knee: bool = False) -> None:
        self.ctx = ctx
        self.name = name
        self.spec = BarrierSpec(max=max, timeout=timeout, percent=percent, min_wait=min_wait, late=late,
                                knee=knee)
        self._client = barrier_client(ctx)

    def enter(self, label: Any, *, round: int | None = None, wait: float | None = None) -> BarrierRelease:
        """Enter as ``label`` (in ``round``, default: this label's next one); block until released; the
        release says who passed (label -> rank). A catch-up barrier raises ``CatchUp``, whose
        ``next_round`` is the round to enter next."""
        return self._client.enter(self.name, str(label), self.spec, round=round,
                                  timeout=self.ctx.config.timeout if wait is None else wait)

    def enter_async(self, label: Any, on_done: Any) -> int:
        """Enter without blocking; ``on_done(release_or_exception)`` runs when the barrier answers."""
        return self._client.enter_async(self.name, str(label), on_done, self.spec)


class Barrier(PartialBarrier):
    """A classic barrier: fires when all ``max`` participants entered."""

    def __init__(self, ctx: Context, name: str, max: int) -> None:
        super().__init__(ctx, name, max)


class SemaphoreBarrier:
    """At most ``n`` labels inside at once; ``release`` admits the next; a holder silent past
    ``hold_timeout`` is presumed failed and another is admitted."""

    def __init__(self, ctx: Context, name: str, n: int, hold_timeout: float | None = None,
                 adaptive_window: int | None = None, max_concurrency: int | None = None) -> None:
        self.ctx = ctx
        self.name = name
        self.spec = SemaphoreSpec(n=n, hold_timeout=hold_timeout, adaptive_window=adaptive_window,
                                  max_concurrency=max_concurrency)
        self._client = barrier_client(ctx)

    def acquire(self, label: Any, *, wait: float | None = None) -> Any:
        return self._client.acquire(self.name, str(label), self.spec,
                                    timeout=self.ctx.config.timeout if wait is None else wait)

    def release(self, label: Any) -> None:
        self._client.release(self.name, str(label), timeout=self.ctx.config.timeout)
