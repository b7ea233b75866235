"""AllGather: every source's records at every destination task (batch: a direct exchange between
ranks; streaming: up a tree to a root that broadcasts each record)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Iterable

from ..base import Callback, Mode
from ..downtree import DownTreeMixin
from ..edges import DIRECT
from ..spill import SpillStore
from ..uptree import Node
from .chunks import append_chunk, chunk_columns, is_chunk_columns
from .gather import Gather

if TYPE_CHECKING:
    from twisternet.context import Context


class AllGather(DownTreeMixin, Gather):
    """Every source's records at every destination task.

    Batch: every destination gets the same records as :class:`Gather` would, in the same order (by
    source task, then send order), spilling past ``config.memory_limit``. They travel straight from each
    source rank to each destination rank (a direct exchange: every record is encoded once per
    destination rank and decoded once there, and nobody relays it). Streaming: records flow up a tree to
    a root (the rank of the first destination), which broadcasts each as it arrives, so all destinations
    see the same order.
    """

    operation = "AllGather"

    def __init__(self, ctx: Context, sources: int | Iterable[int] | None = None,
                 destinations: int | Iterable[int] | None = None, edge: int | None = None, *,
                 mode: Mode = "batch", callback: Callback | None = None, limit: int | None = None,
                 timeout: float | None = None, fanout: int = 2) -> None:
        if destinations is None:
            destinations = sources
        super().__init__(ctx, sources, destinations, edge, mode=mode, callback=callback, limit=limit,
                         timeout=timeout, fanout=fanout)

    def _root_task(self) -> int:
        return self.destinations[0]

    def _setup(self) -> None:
        if self.mode == "batch":
            self._setup_direct()
            return
        super()._setup()
        self._build_down(self.plan.rank_of(self._root_task()))

    # ------------------------------------------------------------------ batch: direct exchange
    # On the DIRECT edge: ("d", [task, ...], [[value, ...], ...]) chunks of the named source tasks, and
    # ("f", task) after the last chunk of source ``task`` (the edge is ordered per sending rank).

    def _setup_direct(self) -> None:
        self._nodes = {}
        self._outbuf = {}
        self._dbuf: list = []                 # small sends, held until batch_records of them
        self._peers = [r for r in self.destination_ranks if r != self.rank]
        self._done_sources: set[int] = set()
        self._completed = False
        self._store: SpillStore | None = (self._new_store(chunked=True) if self.local_destinations else None)
        self._register(DIRECT, self._on_direct)

    def _sends_away(self) -> bool:
        return True if self.mode == "batch" else super()._sends_away()

    def _keeps_local(self) -> bool:
        return self._store is not None if self.mode == "batch" else super()._keeps_local()

    def _local_room(self) -> bool:
        if self.mode != "batch":
            return super()._local_room()
        return all(self._can_send(r, DIRECT) for r in self._peers)

    def _push_local(self, task: int, vals: list, direct: bool) -> None:
        if self.mode != "batch":
            super()._push_local(task, vals, direct)
            return
        if self._store is not None:
            self._store.add_chunk(task, list(vals) if self._peers else vals)
        if not self._peers:
            return
        if direct:
            self._flush_direct()
            self._emit_direct(("d", [task], [vals]))
        elif append_chunk(self._dbuf, task, vals) >= self.batch_records:
            self._flush_direct()

    def _send_piece_direct(self, task: int, piece: Any, timeout: float | None) -> bool:
        """Batch: a table piece goes straight to every other destination rank, sent from this thread (see
        GatherTables); False on one rank (the record path keeps it). Streaming: up the tree."""
        if self.mode != "batch":
            return super()._send_piece_direct(task, piece, timeout)
        peers = list(self._peers)
        if not peers:
            return False
        chunk = [piece]

        def keep() -> None:
            self._flush_direct()
            if self._store is not None:
                self._store.add_chunk(task, list(chunk))
        for i, r in enumerate(peers):
            self._send_direct(task, r, DIRECT, ("d", [task], [chunk]), timeout, before=keep if i == 0 else None)
        return True

    def _flush_direct(self) -> None:
        if self._dbuf:
            msg = ("d", *chunk_columns(self._dbuf))
            self._dbuf = []
            self._emit_direct(msg)

    def _emit_direct(self, msg: tuple) -> None:
        for r in self._peers:
            self._emit(r, DIRECT, msg)

    def _on_direct(self, src: int, msg: Any) -> bool:
        kind = msg[0] if isinstance(msg, (tuple, list)) and msg else None
        if kind == "d" and len(msg) == 3 and self._store is not None:
            _, tasks, chunks = msg
            if (not is_chunk_columns([tasks, chunks])
                    or not all(t in self._sources_set and t not in self._done_sources for t in tasks)):
                raise self._protocol(src, msg)
            for t, c in zip(tasks, chunks):
                self._store.add_chunk(t, self._own_values(c))
            return True
        if kind == "f" and len(msg) == 2 and msg[1] in self._sources_set:
            self._done_sources.add(msg[1])
            self._changed = True
            self._check_direct()
            return True
        raise self._protocol(src, msg)

    def _check_direct(self) -> None:
        if self._completed or len(self._done_sources) < len(self.sources):
            return
        self._completed = True
        store = self._store
        if store is not None:
            for t in self.local_destinations:
                self._complete(t, lambda: iter(store), store.values)

    # ------------------------------------------------------------------ hooks, by mode
    def _on_local_finish(self, task: int) -> None:
        if self.mode != "batch":
            super()._on_local_finish(task)
            return
        self._flush_direct()
        self._emit_direct(("f", task))
        self._done_sources.add(task)
        self._check_direct()

    def _held(self) -> int:
        if self.mode == "batch":
            return sum(len(c) for _, c in self._dbuf)
        return super()._held()

    def _root_room(self, node: Node) -> bool:
        return self._down_room()

    def _root_chunks(self, node: Node, chunks: list) -> None:
        # streaming only: batch AllGather has no tree
        self._down_emit([(src, v) for src, vals in chunks for v in vals], columns=True)

    def _root_finished(self, tasks: list[int]) -> None:
        self._down_info(tasks)

    def _known_finished(self, task: int | None) -> set[int]:
        if self.mode == "batch":
            return self._done_sources | self._finished_local
        return super()._known_finished(self._root_task()) | self._down_finished

    def _root_complete(self, node: Node) -> None:
        self._down_end()

    def _duties_done(self) -> bool:
        if self.mode == "batch":
            return not self._dbuf
        return super()._duties_done()

    def _release_storage(self) -> None:
        if self.mode == "batch":
            store = getattr(self, "_store", None)   # None, or not made yet (a failed _setup)
            if store is not None:
                store.close()
            return
        super()._release_storage()
