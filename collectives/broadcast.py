"""Broadcast: one source's records flow down a k-ary tree to every destination task."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Iterable

from twisternet.errors import ConfigError

from .base import Callback, Mode, pick_alias
from .columnar import BroadcastTables
from .downtree import DownTreeMixin
from .reduce import _need_edge
from .reduction import snapshot

if TYPE_CHECKING:
    from twisternet.context import Context


class Broadcast(BroadcastTables, DownTreeMixin):
    """Copy every value of one source task to every destination task.

    Streaming: each destination gets every value, in send order, as it arrives. Batch: after the source
    finished, each destination gets the list of all values in send order (spilling past
    ``config.memory_limit``).
    """

    operation = "Broadcast"

    def __init__(self, ctx: Context, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 mode: Mode = "batch", callback: Callback | None = None, limit: int | None = None,
                 timeout: float | None = None, fanout: int = 2, source: int | None = None,
                 root: int | None = None, src: int | None = None) -> None:
        # source=/root=/src= name the one source task (as MPI's root and torch's src do)
        sources = pick_alias("Broadcast", "sources", {"sources": sources, "source": source, "root": root,
                                                      "src": src})
        if sources is None:
            sources = [ctx.plan.tasks[0]]
        super().__init__(ctx, sources, destinations, _need_edge(edge, type(self).__name__), mode=mode,
                         callback=callback, limit=limit, timeout=timeout, fanout=fanout)

    def _setup(self) -> None:
        if len(self.sources) != 1:
            raise ConfigError("sources", f"Broadcast has exactly one source task, got {self.sources}")
        self._build_down(self.plan.rank_of(self.sources[0]))

    def send(self, task: int, value: Any, *, timeout: float | None = None, copy: bool = True) -> None:
        """Broadcast ``value`` from the source ``task``; blocks under back pressure.

        ``copy=False``: a destination in this process gets ``value`` itself, not a copy (as mpi4py's
        ``bcast`` returns the root its own object); the caller must not change it until the results are
        consumed.
        """
        self._input(task, self._down_room, lambda: self._down_emit([snapshot(value) if copy else value]),
                    timeout=timeout)

    def offer(self, task: int, value: Any, *, copy: bool = True) -> bool:
        """Like :meth:`send` but returns False instead of blocking when a child or local queue is full."""
        return self._input(task, self._down_room, lambda: self._down_emit([snapshot(value) if copy else value]),
                           block=False)

    def _on_local_finish(self, task: int) -> None:
        self._down_end()

    def _known_finished(self, task: int | None) -> set[int]:
        return set(self.sources) if self._down_ended else set()
