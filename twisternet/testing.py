"""Run a job's ranks as threads of one process (the ``local`` channel) — for tests and notebooks."""

from __future__ import annotations

import threading
from typing import Any, TypeVar
from collections.abc import Callable

from .config import load_config
from .context import Context
from .errors import PeerLostError
from .task_plan import TaskPlan

T = TypeVar("T")


def run_local(world: int, fn: Callable[..., T], *args: Any, plan: TaskPlan | dict[int, int] | None = None,
              timeout: float = 60.0, **config: Any) -> list[T]:
    """Run ``fn(ctx, *args)`` on ``world`` ranks (threads), each with its own Context; results by rank.

    If a rank raises, the others see it as a lost peer; the first original exception is re-raised.
    A rank still running after ``timeout`` seconds raises TimeoutError naming the ranks.
    """
    from channels.local import LocalChannel, LocalHub

    cfg = load_config(env={}, channel="local", **config)
    if isinstance(plan, dict):
        plan = TaskPlan(world, plan)
    hub = LocalHub(world)
    chans = [LocalChannel(hub, r, cfg) for r in range(world)]
    results: list[Any] = [None] * world
    errors: list[BaseException | None] = [None] * world

    def body(rank: int) -> None:
        try:
            ctx = Context(chans[rank], cfg, plan)
        except BaseException as e:  # noqa: BLE001
            errors[rank] = e
            hub.fail(rank, f"rank {rank} failed to start: {e!r}")
            return
        try:
            with ctx:
                results[rank] = fn(ctx, *args)
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors[rank] = e
            hub.fail(rank, f"rank {rank} raised {type(e).__name__}: {e}")

    threads = [threading.Thread(target=body, args=(r,), name=f"twisternet-local-{r}", daemon=True)
               for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if stuck:
        for r in stuck:
            hub.fail(r, "timed out")
        raise TimeoutError(f"ranks {stuck} still running after {timeout}s")
    first = next((e for e in errors if e is not None and not isinstance(e, PeerLostError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
