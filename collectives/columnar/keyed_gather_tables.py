"""KeyedGather's table path: rows routed by key, sorted by key at their destination (in batch mode kept
as they arrive by :mod:`.gathered_tables`: sorted Arrow runs spilled past the memory bound)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable, Iterator, Sequence

from twisternet.arrowcodec import require_pyarrow
from twisternet.errors import TwisternetError

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

    def _table_piece(self, node: Node, tag: Any, piece: Any) -> None:
        """Batch: keep a table piece reaching destination ``node`` (under the lock) in its sorted runs."""
        from .gathered_tables import GatheredTables
        gathered = self.__dict__.setdefault("_gathered", {})
        g = gathered.get(node.tid)
        if g is None:
            share = max(1024, self.ctx.config.memory_limit // max(1, len(self.local_destinations)))
            g = gathered[node.tid] = GatheredTables(share, self.ctx.config.spill_dir,
                                                    f"{self.describe()}(edge={self.edge}) task {node.tid}")
        g.add((int(tag[0]), int(tag[1])), piece)

    def _gathered_tables(self, task: int) -> Any:
        """Batch: destination ``task``'s GatheredTables (None if no table reached it)."""
        return self.__dict__.get("_gathered", {}).get(task)

    def _gathered_result(self, task: int, timeout: float | None) -> tuple[Any, Any]:
        """Batch: once destination ``task`` is complete, its GatheredTables and the result's schema
        (None, None without tables); raises on records among the tables or schemas that differ."""
        if self.callback is not None:
            raise TwisternetError(f"{self.describe()} on edge {self.edge} delivers its results to the callback")
        sink = self._sinks[task]
        self._wait(lambda: sink.complete, "batch results not complete", task, timeout)
        store = self._nodes[task].state
        if store is not None and len(store):
            (_key, src), value = next(iter(store))
            self._checked_piece(None, None, src, value)        # raises: a record, not a table
        g = self._gathered_tables(task)
        if g is None:
            return None, None
        return g, g.check_schemas(self._checked_piece)

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
        larger than memory. The rows are kept as they arrive within this destination's share of
        ``config.memory_limit``, past it as sorted runs spilled as Arrow IPC files to
        ``config.spill_dir``; the rows still held are spilled too when more than ``memory_limit``
        bytes (``compression``, e.g. ``"lz4"`` or ``"zstd"``, applies to the runs written from here
        on); the runs are merged back by key in blocks. Afterwards ``spilled_runs`` says how many runs
        were written."""
        task = self._check_table_results(task)
        require_pyarrow()
        if self.mode != "batch":          # streaming: pieces as they arrive (unsorted), key metadata dropped
            for batch in TableOps.result_batches(self, task, timeout=timeout):
                meta = dict(batch.schema.metadata or {})
                meta.pop(b"twisternet.keys", None)
                yield batch.replace_schema_metadata(meta or None)
            return
        g, schema = self._gathered_result(task, timeout)
        if g is not None:
            if compression is not None:
                g.runs.set_compression(compression)
            self.spilled_runs = g.runs.runs
            yield from g.batches(schema, memory_limit, batch_rows)
            self.spilled_runs = g.runs.runs
        self._consumed(task)

    def result_table(self, task: int | None = None, *, timeout: float | None = None) -> Any:
        """Batch: this destination's rows sorted by the key columns (nulls first; equal keys by
        source task, then send order)."""
        pa = require_pyarrow()
        task = self._check_table_results(task)
        if self.mode != "batch":
            table = self._collect(task, timeout, self._table_pairs(task, timeout))
            meta = dict(table.schema.metadata or {})
            keys = json.loads(meta.pop(b"twisternet.keys", b"[]"))
            return sort_by_keys(table.replace_schema_metadata(meta or None), keys)
        g, schema = self._gathered_result(task, timeout)
        if g is None:
            self._consumed(task)
            return pa.table({})
        table = pa.Table.from_batches(list(g.batches(schema, None, 1 << 62)), schema=schema)
        self.spilled_runs = g.runs.runs
        self._consumed(task)
        return table
