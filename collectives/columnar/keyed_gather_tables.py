"""KeyedGather's table path: rows routed by key, sorted by key at their destination (spilled runs past
the memory bound)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable, Iterator, Sequence

from twisternet.arrowcodec import require_pyarrow

from ..uptree import Node, UpTreeState
from .sorting import sort_by_keys
from .table_ops import TableOps


class KeyedGatherTables(TableOps, UpTreeState):
    """``send_table`` / ``result_table`` of KeyedGather: rows sorted by key at their destination."""

    # KeyedGather's (collectives.gather.keyed)
    group: bool

    if TYPE_CHECKING:
        def _input_room(self, node: Node) -> bool: ...
        def _push_cols(self, node: Node, keys: list[Any], tasks: list[Any], vals: list[Any], *, local: bool,
                       direct: bool) -> None: ...

    def send_table(self, task: int, table: Any, key: str | Sequence[str], *, splitters: Any = None,
                   timeout: float | None = None) -> None:
        """Send the rows of ``table`` from local source ``task`` to the destinations their ``key``
        columns hash to or, with ``splitters`` (``len(destinations) - 1`` sorted key rows, e.g. from
        :func:`splitters_from_sample`), to the destination of their key range: then the destinations'
        results, in destination order, are one globally sorted table."""
        keys = self._key_columns(key)
        table = self._table_in(task, table, keys)
        meta = dict(table.schema.metadata or {})
        meta[b"twisternet.keys"] = json.dumps(keys).encode()
        table = table.replace_schema_metadata(meta)
        self._send_routed(task, table, keys, splitters, self._send_keyed_piece, timeout)

    def _send_keyed_piece(self, task: int, dest: int, piece: Any, timeout: float | None) -> None:
        from ..edges import UP_BASE
        node = self._nodes[dest]
        tag = (task, self._table_seq(task))      # unique: the store keeps pieces in (task, seq) order
        if node.parent is None:
            self._input(task, lambda: self._input_room(node),
                        lambda: self._push_cols(node, [tag], [task], [piece], local=True, direct=True),
                        timeout=timeout)
            return
        self._send_direct(task, node.parent, UP_BASE + node.level - 1, ("d", node.tid, [[tag], [task], [piece]]),
                          timeout, before=lambda: self._flush_node(node))

    def _table_pairs(self, task: int, timeout: float | None) -> Iterable[tuple[int, Any]]:
        for tag, value in self.results(task, timeout=timeout):
            if self.group and isinstance(value, list):
                for v in value:
                    yield tag[0], v
            else:
                yield tag[0], value

    def result_batches(self, task: int | None = None, *, timeout: float | None = None,
                       batch_rows: int = 65536, memory_limit: int | None = None,
                       compression: str | None = None) -> Iterator[Any]:
        """Batch: :meth:`result_table`'s rows as ``pyarrow.RecordBatch``es in the same order, for results
        larger than memory: past ``memory_limit`` bytes (default this destination's share of
        ``config.memory_limit``) sorted runs are spilled as Arrow IPC files to ``config.spill_dir``
        (``compression``: e.g. ``"lz4"`` or ``"zstd"``) and merged back by key in blocks; afterwards
        ``spilled_runs`` says how many runs were written and ``spilled_run_bytes`` their size on disk."""
        from ..columnar_spill import SortedRuns
        task = self._check_table_results(task)
        require_pyarrow()
        if self.mode != "batch":          # streaming: pieces as they arrive (unsorted), key metadata dropped
            for batch in TableOps.result_batches(self, task, timeout=timeout):
                meta = dict(batch.schema.metadata or {})
                meta.pop(b"twisternet.keys", None)
                yield batch.replace_schema_metadata(meta or None)
            return
        cfg = self.ctx.config
        limit = memory_limit or max(1 << 20, cfg.memory_limit // max(1, len(self.local_destinations)))
        runs = None
        try:
            for t, _ in self._checked_pieces(self._table_pairs(task, timeout)):
                if runs is None:    # the first piece: its metadata names the key columns
                    first = t.schema
                    meta = dict(first.metadata or {})
                    keys = json.loads(meta.pop(b"twisternet.keys", b"[]"))
                    plain = first.with_metadata(meta or None)
                    runs = SortedRuns(keys, limit, cfg.spill_dir, compression=compression, batch_rows=batch_rows,
                                      name=f"{self.describe()}(edge={self.edge}) task {task}")
                runs.add(t.replace_schema_metadata(plain.metadata))
            if runs is None:
                return
            self.spilled_runs, self.spilled_run_bytes = runs.runs, runs.spilled_bytes
            for batch in runs.batches():
                yield batch
            self.spilled_runs, self.spilled_run_bytes = runs.runs, runs.spilled_bytes
        finally:
            if runs is not None:
                runs.close()

    def result_table(self, task: int | None = None, *, timeout: float | None = None) -> Any:
        """Batch: this destination's rows sorted by the key columns (nulls first; equal keys by
        source task, then send order)."""
        task = self._check_table_results(task)
        table = self._collect(task, timeout, self._table_pairs(task, timeout))
        meta = dict(table.schema.metadata or {})
        keys = json.loads(meta.pop(b"twisternet.keys", b"[]"))
        table = table.replace_schema_metadata(meta or None)
        return sort_by_keys(table, keys)
