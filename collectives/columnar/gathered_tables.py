"""KeyedGather's batch destination for tables: the pieces received kept as sorted Arrow runs.

Table pieces reaching a batch KeyedGather destination do not go through the record store (which would
pickle them to disk past the memory bound, only for :meth:`result_batches` to read them back, sort them
and write them again as Arrow runs): :class:`GatheredTables` adds each piece, as it arrives, to a
:class:`~collectives.columnar_spill.SortedRuns` whose budget is a quarter of the destination's share
of ``config.memory_limit`` (:data:`RUNS_SHARE`), so past the bound the rows reach disk once, as sorted
Arrow IPC runs, the destination stays within its share plus a constant, and the result is their k-way
merge. Pieces arrive in any order across sources: each row carries a hidden
tie-break column, ``source task << 32 | send sequence``, so equal keys still come out by source task,
then send order. Schemas are checked when the result is read, in (source task, sequence) order as if
the pieces had been read one by one: the first mismatch raises, naming both sources.
"""

from __future__ import annotations

import json
from typing import Any
from collections.abc import Callable, Iterator

import numpy as np

from twisternet.arrowcodec import require_pyarrow

from .schemas import _own_meta

#: The runs get 1/RUNS_SHARE of the destination's memory bound as their budget: at its peak a
#: SortedRuns holds ~3.7x its budget (the rows held, the pieces arriving meanwhile, the batches taken for
#: a run, what Arrow's allocator keeps), so a quarter keeps the destination within its bound plus a
#: constant (peak RSS growth at 32 / 64 MB bounds: 50 / 79 MB, against 138 / 182 MB with the whole
#: bound as the budget).
RUNS_SHARE = 4
#: The hidden tie-break column (dropped from what the destination reads).
ORDER = "__twisternet_order"
_KEYS_META = b"twisternet.keys"


def is_table_piece(value: Any) -> bool:
    """Whether ``value`` is a piece a ``send_table`` of KeyedGather sent (its schema names the keys)."""
    t = type(value)
    if t.__module__ != "pyarrow.lib" or t.__name__ not in ("Table", "RecordBatch"):
        return False
    meta = value.schema.metadata
    return bool(meta) and _KEYS_META in meta


class GatheredTables:
    """The table pieces one KeyedGather destination received, sorted by key within ``memory_limit``."""

    def __init__(self, memory_limit: int, spill_dir: str | None, name: str) -> None:
        self.memory_limit = memory_limit
        self.spill_dir = spill_dir
        self.name = name
        self.runs: Any = None               # SortedRuns, made with the first piece (it names the keys)
        self._schema: Any = None             # the runs' schema: the first piece's, without metadata
        self._meta: Any = None               # its twisternet metadata (key names)
        self._variants: list[list[Any]] = []  # [smallest (task, seq), schema] per distinct schema seen

    def add(self, tag: tuple[int, int], piece: Any) -> None:
        """Keep ``piece`` (a Table or RecordBatch) sent by task ``tag[0]`` as its ``tag[1]``-th piece."""
        from ..columnar_spill import SortedRuns
        pa = require_pyarrow()
        if isinstance(piece, pa.RecordBatch):
            piece = pa.Table.from_batches([piece])
        self._note_schema(tag, piece.schema)
        if self.runs is None:
            keys = json.loads(piece.schema.metadata[_KEYS_META])
            self._schema, self._meta = piece.schema.remove_metadata(), _own_meta(piece.schema)
            self.runs = SortedRuns(keys, max(1, self.memory_limit // RUNS_SHARE), self.spill_dir, name=self.name,
                                   tiebreak=ORDER)
        elif not (piece.schema.equals(self._schema, check_metadata=False) and _own_meta(piece.schema) == self._meta):
            return          # reading the result raises (check_schemas); its rows cannot join the runs
        rows = piece.num_rows
        if not rows:
            return
        task, seq = tag
        order = pa.array(np.full(rows, (task << 32) | seq, dtype=np.uint64))
        self.runs.add(pa.Table.from_arrays([*piece.columns, order], names=[*self._schema.names, ORDER]))

    def _note_schema(self, tag: tuple[int, int], schema: Any) -> None:
        for v in self._variants:
            if schema.equals(v[1], check_metadata=False) and _own_meta(schema) == _own_meta(v[1]):
                if tag < v[0]:
                    v[0], v[1] = tag, schema
                return
        self._variants.append([tag, schema])

    def check_schemas(self, checked_piece: Callable[[Any, Any, int, Any], Any]) -> Any:
        """The result's schema (the schema of the first piece in (source task, sequence) order, key
        metadata dropped), after ``checked_piece(first_schema, first_source, source, table)`` (the
        operation's check, which raises on a mismatch) of the first piece of another schema."""
        variants = sorted(self._variants, key=lambda v: v[0])
        if not variants:
            return None
        (first_tag, first), *others = variants
        if others:
            tag, schema = others[0]
            checked_piece(first, first_tag[0], tag[0], schema.empty_table())
        meta = dict(first.metadata or {})
        meta.pop(_KEYS_META, None)
        return first.with_metadata(meta or None)

    def batches(self, schema: Any, memory_limit: int | None, batch_rows: int) -> Iterator[Any]:
        """The rows sorted by key as record batches of ``schema`` (tie-break column dropped): merged
        from the spilled runs, rows still held spilled first when they exceed ``memory_limit``."""
        pa = require_pyarrow()
        runs = self.runs
        if runs is None:
            return
        runs.batch_rows = batch_rows
        if memory_limit is not None and runs.held_bytes > memory_limit:
            runs.spill()
        width = len(schema)
        for batch in runs.batches():
            yield pa.RecordBatch.from_arrays(batch.columns[:width], schema=schema)

    @property
    def spilled_bytes(self) -> int:
        """Bytes written to run files so far."""
        return self.runs.spilled_bytes if self.runs is not None else 0

    def close(self) -> None:
        """Remove the run files (idempotent)."""
        if self.runs is not None:
            self.runs.close()
