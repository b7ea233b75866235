"""What the gathering operations share: forwarding records up k-ary trees to roots that keep them
(batch: in a :class:`~collectives.spill.SpillStore` bounded by ``config.memory_limit``)."""

from __future__ import annotations

import functools
from typing import Any

from ..spill import SpillStore
from ..uptree import Node, UpTreeOperation


class TreeGatherBase(UpTreeOperation):
    """Forwarding up a tree; subclasses say what a record is and how the root keeps it."""

    def _new_store(self, sort: bool = True, chunked: bool = False) -> SpillStore:
        share = max(1024, self.ctx.config.memory_limit // max(1, len(self.local_destinations)))
        return SpillStore(share, self.ctx.config.spill_dir, sort=sort, chunked=chunked,
                          name=f"{self.operation}(edge={self.edge})")

    #: Whether the batch destination keeps chunks ``(source, [values])`` (Gather) or records.
    _chunked_store = False

    def _new_state(self, node: Node) -> Any:
        if not hasattr(self, "_outbuf"):
            self._outbuf: dict[int, Any] = {}   # per tree: what each operation buffers for its parent
        if node.is_root and self.mode == "batch":
            return self._new_store(chunked=self._chunked_store)
        return None

    def _input_room(self, node: Node) -> bool:
        if node.parent is None:
            return self.mode == "batch" or self._root_room(node)
        return self._out_room(node)

    #: Batch mode: local records are sent up in lists of this many (fewer messages, same order).
    batch_records = 256

    @property
    def spilled_bytes(self) -> int:
        """Bytes this process's batch destinations have written to spill files (past
        ``config.memory_limit``) so far."""
        stores = [n.state for n in getattr(self, "_nodes", {}).values()]
        stores.append(getattr(self, "_store", None))       # batch AllGather's
        return sum(s.spilled_bytes for s in stores if isinstance(s, SpillStore))

    @functools.cached_property
    def _sources_set(self) -> frozenset:
        """The source tasks, as a set (received records must name one of them)."""
        return frozenset(self.sources)

    def _release_storage(self) -> None:
        for node in getattr(self, "_nodes", {}).values():
            if isinstance(node.state, SpillStore):
                node.state.close()
        super()._release_storage()
