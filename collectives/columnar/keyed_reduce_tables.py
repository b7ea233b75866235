"""KeyedReduce's table path: per-key Arrow aggregations, partial at the sources, merged at the
destination; streaming readers fold each piece into running states."""

from __future__ import annotations

import json
import functools
from typing import TYPE_CHECKING, Any
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from twisternet.arrowcodec import is_arrow_data, require_pyarrow
from twisternet.errors import TableSchemaError

from .aggregates import (_META_AGG, _check_aggregate, _final_aggregates, merge_aggregates, merge_states,
                         partial_aggregate)
from .routing import destination_index, split_rows
from ..uptree import Node, UpTreeState
from .table_ops import TableOps


class KeyedReduceTables(TableOps, UpTreeState):
    """``send_table`` / ``result_table`` of KeyedReduce: Arrow aggregations, one row per key. Streaming:
    each source's ``send_table`` call travels as its partial aggregates, and ``result_batches`` yields,
    per received piece, the updated aggregates of the keys that piece touched."""

    if TYPE_CHECKING:   # KeyedReduce's (collectives.keyed_reduce)
        def _room(self, node: Node) -> bool: ...
        def _take(self, node: Node, pairs: Iterable[Any], copy: Any) -> None: ...

    def send_table(self, task: int, table: Any, key: str | Sequence[str], *,
                   aggregate: Mapping[str, str | Sequence[str]], timeout: float | None = None) -> None:
        """Aggregate ``table`` by its ``key`` columns (``aggregate={"v": "sum", "w": ["max", "mean"]}``)
        at this source, then send each key's partial row to the destination the key hashes to."""
        keys = self._key_columns(key)
        spec = _check_aggregate(aggregate)
        table = self._table_in(task, table, keys)
        missing = [c for c, _ in spec if c not in table.column_names]
        if missing:
            raise TableSchemaError(f"{self.describe()} (edge {self.edge}) send_table from task {task} on rank "
                                   f"{self.rank}: aggregated column(s) {missing} not in the table; its columns "
                                   f"are {table.column_names}")
        partial = partial_aggregate(table, keys, spec)
        dests = self.destinations
        parts = split_rows(partial, destination_index(partial, keys, len(dests)), len(dests))
        every = self._new_schema(task, partial.schema)
        for d, part in zip(dests, parts):
            if part.num_rows or every:
                for piece in self._pieces(part):
                    node = self._nodes[d]
                    tag = (task, self._table_seq(task))
                    self._input(task, functools.partial(self._room, node),
                                functools.partial(self._take, node, [(tag, piece)], _same),
                                timeout=timeout)

    def _table_pairs(self, task: int, timeout: float | None) -> Iterable[tuple[int, Any]]:
        """The partial-aggregate pieces that reached this destination."""
        return ((tag[0], t) for tag, t in self.results(task, timeout=timeout))

    def _streamed_table_pieces(self, node: Any, pairs: list) -> bool:
        """Streaming root of ``node``: deliver received ``(tag, table piece)`` pairs as they are (the
        reader merges them, see :meth:`result_batches`) instead of keeping them as running values;
        False when ``pairs`` are records."""
        if not pairs or not is_arrow_data(pairs[0][1]):
            return False
        from ..reduction import own
        self._deliver_many(node.tid, [(tag, own(piece)) for tag, piece in pairs])
        return True

    def result_batches(self, task: int | None = None, *, timeout: float | None = None) -> Iterator[Any]:
        """Batch: :meth:`result_table` as record batches (the merged aggregates are formed in memory:
        one row per key). Streaming: per received piece (one source's ``send_table`` call, its keys
        for this destination), a batch of the updated aggregates of the keys it holds, sorted by key;
        the running states (one row per key seen) are kept by this reader."""
        if self.mode == "batch":
            yield from self.result_table(task, timeout=timeout).to_batches()
            return
        for updated in self._running_aggregates(task, timeout, updates=True):
            yield from updated.to_batches()

    def _running_aggregates(self, task: int | None, timeout: float | None, *, updates: bool) -> Iterator[Any]:
        """Streaming: fold each received piece into the running states; yields the updated keys'
        aggregates per piece (``updates``) or, at the end, every key's."""
        pa = require_pyarrow()
        import pyarrow.compute as pc
        task = self._check_table_results(task)
        first = state = None
        keys: list[str] = []
        spec: list[tuple[str, str]] = []
        mark = "\x1ftouched"
        for piece, is_first in self._checked_pieces(self._table_pairs(task, timeout)):
            if is_first:
                first = piece.schema
                info = json.loads((first.metadata or {}).get(_META_AGG, b"{}"))
                keys, spec = info.get("keys", []), [tuple(x) for x in info.get("spec", [])]
            if piece.num_rows == 0:
                continue
            piece = piece.append_column(mark, pa.array(np.ones(piece.num_rows, dtype=np.int8)))
            both = piece if state is None else pa.concat_tables([state, piece.cast(state.schema)])
            state = merge_states(both, keys, spec, extra=[mark])
            if updates:
                touched = state.filter(pc.equal(state.column(mark), 1)).drop_columns([mark])
                yield _final_aggregates(touched, keys, spec)
            state = state.set_column(state.schema.get_field_index(mark), mark,
                                     pa.array(np.zeros(state.num_rows, dtype=np.int8)))
        if not updates:
            if state is not None:
                yield _final_aggregates(state.drop_columns([mark]), keys, spec)
            elif first is not None:
                yield _final_aggregates(merge_states(pa.Table.from_batches([], schema=first), keys, spec),
                                        keys, spec)
            else:
                yield pa.table({})

    def result_table(self, task: int | None = None, *, timeout: float | None = None) -> Any:
        """One row per key of this destination: key columns, then ``{column}_{fn}`` per aggregation,
        sorted by key (nulls first). Streaming: once every source finished."""
        if self.mode != "batch":
            return next(iter(self._running_aggregates(task, timeout, updates=False)))
        task = self._check_table_results(task)
        partials = self._collect(task, timeout, self._table_pairs(task, timeout))
        if partials.num_columns == 0:
            return partials
        info = json.loads((partials.schema.metadata or {}).get(_META_AGG, b"{}"))
        keys, spec = info.get("keys", []), [tuple(x) for x in info.get("spec", [])]
        return merge_aggregates(partials, keys, spec)


def _same(value: Any) -> Any:  # identity "copy" for pieces kept as they are
    return value
