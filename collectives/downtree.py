"""Engine of records flowing *down* a k-ary broadcast tree from one root rank to the destination ranks.

Records on the down edge (``DOWN``) are ``("v", [values])`` (or ``("c", [tasks, values])``: AllGather's
``(task, value)`` records as columns), ``("f", [tasks])`` (finish information for
diagnostics) and ``("e", None)`` (end of the data). A node forwards to its children and delivers to its
local destination tasks; it refuses input while a child lacks credit or a local result queue is full,
so back pressure runs from the slowest destination up to the root.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Iterator

from .base import Operation
from .columns import from_columns, to_columns
from .edges import DOWN
from .routing import tree_for
from .spill import SpillStore


class DownTreeMixin(Operation):
    """Broadcast-tree plumbing shared by Broadcast, AllReduce and AllGather."""

    def _build_down(self, root: int) -> None:
        tree = tree_for(self.ctx, root, set(self.destination_ranks) | {root}, self.fanout)   # host-aware
        self._down_root = root
        self._down_parent = tree.parent(self.rank) if self.rank in tree else None
        self._down_children = tree.children(self.rank) if self.rank in tree else []
        self._down_finished: set[int] = set()
        self._down_ended = False
        self._down_store = SpillStore(self._memory_share(), self.ctx.config.spill_dir, sort=False,
                                      name=f"{self.operation}(edge={self.edge}) results")
        self._register(DOWN, self._on_down)

    def _memory_share(self) -> int:
        return max(1024, self.ctx.config.memory_limit // max(1, len(self.local_destinations)))

    def _duties_done(self) -> bool:
        in_tree = self.rank == self._down_root or self._down_parent is not None
        return (not in_tree or self._down_ended) and super()._duties_done()

    # ------------------------------------------------------------------ sending side
    def _down_room(self) -> bool:
        return all(self._can_send(c, DOWN) for c in self._down_children) and self._sinks_room()

    def _down_emit(self, values: list, *, columns: bool = False) -> None:
        """Send ``values`` on down the tree and deliver them here; ``columns``: they are (task, value)
        pairs, which travel as two columns."""
        if self._down_children:
            msg = ("c", to_columns(values, 2)) if columns else ("v", values)
            for c in self._down_children:
                self._emit(c, DOWN, msg)
        self._down_local(values)

    def _down_info(self, tasks: list[int]) -> None:
        self._down_finished.update(tasks)
        for c in self._down_children:
            self._emit(c, DOWN, ("f", tasks))

    def _down_end(self) -> None:
        if self._down_ended:
            return
        self._down_ended = True
        for c in self._down_children:
            self._emit(c, DOWN, ("e", None))
        self._down_local_end()

    # ------------------------------------------------------------------ local delivery
    def _down_local(self, values: list) -> None:
        if not self.local_destinations:
            return
        if self.mode == "streaming":
            for t in self.local_destinations:
                for v in values:
                    self._deliver(t, v)
        else:
            for v in values:
                self._down_store.add(0, v)

    def _down_local_end(self) -> None:
        for t in self.local_destinations:
            if self.mode == "streaming":
                self._end(t)
            else:
                self._complete(t, self._down_values)

    def _down_values(self) -> Iterator[Any]:
        for _, v in self._down_store:
            yield v

    def _release_storage(self) -> None:
        self._down_store.close()
        super()._release_storage()

    # ------------------------------------------------------------------ receiving side
    def _on_down(self, src: int, msg: Any) -> bool:
        try:
            kind, payload = msg
        except (TypeError, ValueError):
            raise self._protocol(src, msg) from None
        if src != self._down_parent:
            raise self._protocol(src, msg)
        if kind == "v" or kind == "c":
            if not self._down_room():
                return False
            if kind == "c":          # (task, value) records as two columns (see collectives.columns)
                try:
                    payload[1] = self._own_values(payload[1])
                    values = from_columns(payload, 2)
                except (ValueError, TypeError, IndexError):
                    raise self._protocol(src, msg) from None
                self._down_emit(values, columns=True)
            else:
                self._down_emit(self._own(payload))
            return True
        if kind == "f":
            self._down_info(payload)
            self._changed = True
            return True
        if kind == "e":
            self._down_end()
            return True
        raise self._protocol(src, msg)
