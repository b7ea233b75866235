"""The table paths of the operations that deliver rows as sent: Partition / KeyedPartition, Broadcast,
Gather / AllGather."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from collections.abc import Iterable, Sequence

from ..uptree import UpTreeState
from .table_ops import TableOps


class PartitionTables(TableOps):
    """``send_table`` / ``result_table`` of Partition and KeyedPartition (rows as sent)."""

    if TYPE_CHECKING:   # Partition's (collectives.partition)
        def _pick(self, task: int, value: Any, destination: int | None) -> int: ...
        def _accept(self, dest: int, src: int, payload: Any) -> None: ...
        def _flush(self, rank: int) -> None: ...

    def send_table(self, task: int, table: Any, key: str | Sequence[str] | None = None, *,
                   destination: int | None = None, splitters: Any = None, timeout: float | None = None) -> None:
        """Send the rows of ``table`` from local source ``task``: by the stable hash of the ``key``
        columns (required for KeyedPartition) or, with ``splitters``, by key range (see
        :func:`range_index`), else to ``destination``, else (Partition) round-robin one whole table
        per call."""
        keys = self._key_columns(key, required=getattr(self, "key_type", None) is not None)
        table = self._table_in(task, table, keys)
        if keys:
            self._send_routed(task, table, keys, splitters, self._send_piece, timeout)
            return
        every = self._new_schema(task, table.schema)
        dest = self._pick(task, table, destination)
        for d in self.destinations:
            if d == dest or every:
                for piece in self._pieces(table if d == dest else table.slice(0, 0)):
                    self._send_piece(task, d, piece, timeout)

    def _send_piece(self, task: int, dest: int, piece: Any, timeout: float | None) -> None:
        from ..edges import DIRECT
        payload = (task, piece) if getattr(self, "key_type", None) is not None else piece
        r = self.plan.rank_of(dest)
        if r == self.rank:
            self._input(task, lambda: self._sink_room(dest), lambda: self._accept(dest, task, payload),
                        timeout=timeout)
            return

        self._send_direct(task, r, DIRECT, ("D", [(dest, task, payload)]), timeout,
                          before=lambda: self._flush(r))

    def _table_pairs(self, task: int, timeout: float | None) -> Iterable[tuple[int, Any]]:
        """The rows sent to local destination ``task``, by source task then send order."""
        return self.results(task, timeout=timeout)


class BroadcastTables(TableOps):
    """``send_table`` / ``result_table`` of Broadcast."""

    # DownTreeMixin's (collectives.downtree)
    _down_children: list[int]

    if TYPE_CHECKING:
        def _down_room(self) -> bool: ...
        def _down_local(self, values: list[Any]) -> None: ...

    def send_table(self, task: int, table: Any, *, timeout: float | None = None) -> None:
        """Send ``table`` from the source ``task`` to every destination."""
        table = self._table_in(task, table, [])
        for piece in self._pieces(table):
            self._send_piece_down(task, piece, timeout)

    def _send_piece_down(self, task: int, piece: Any, timeout: float | None) -> None:
        """Deliver ``piece`` to this rank's destinations, then send it to each child rank of the tree
        with a blocking Context send from this thread: its buffers go out as they are, not copied."""
        from ..edges import DOWN
        if self.local_destinations or not self._down_children:
            self._input(task, self._down_room, lambda: self._down_local([piece]), timeout=timeout)
        for c in list(self._down_children):
            self._send_direct(task, c, DOWN, ("v", [piece]), timeout)

    def _table_pairs(self, task: int, timeout: float | None) -> Iterable[tuple[int, Any]]:
        """The source's rows, in send order."""
        src = self.sources[0]
        return ((src, t) for t in self.results(task, timeout=timeout))


class GatherTables(TableOps, UpTreeState):
    """``send_table`` / ``result_table`` of Gather and AllGather."""

    if TYPE_CHECKING:   # Gather's (collectives.gather)
        def send(self, task: int, value: Any, *, timeout: float | None = None, copy: bool = True) -> None: ...

    def send_table(self, task: int, table: Any, *, timeout: float | None = None) -> None:
        """Send ``table``'s rows from local source ``task`` to the destination(s): pieces bound for other
        ranks go out as their Arrow buffers, without a copy at the sender."""
        table = self._table_in(task, table, [])
        for piece in self._pieces(table):
            if not self._send_piece_direct(task, piece, timeout):
                self.send(task, piece, timeout=timeout, copy=False)

    def _send_piece_direct(self, task: int, piece: Any, timeout: float | None) -> bool:
        """Send ``piece`` up the tree with a blocking Context send from this thread (so the Context sends
        its buffers as they are, see :meth:`_send_direct`); False where the record path keeps it on
        this rank instead (this rank holds the tree's root). Batch AllGather overrides it."""
        from ..edges import UP_BASE
        node = next(iter(self._nodes.values()))
        if node.parent is None:
            return False
        self._send_direct(task, node.parent, UP_BASE + node.level - 1, ("d", node.tid, [[task], [[piece]]]),
                          timeout, before=lambda: self._flush_node(node))
        return True

    def _table_pairs(self, task: int, timeout: float | None) -> Iterable[tuple[int, Any]]:
        """Every source's rows, by source task then send order."""
        return self.results(task, timeout=timeout)
