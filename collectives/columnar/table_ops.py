"""What every operation's table path shares: a mixin of the operation classes (pieces, direct sends,
routing, schema checks, collecting and re-chunking received pieces)."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from twisternet.arrowcodec import is_arrow_data, require_pyarrow
from twisternet.errors import TableSchemaError, TwisternetError

from ..base.state import OperationState

from .rechunk import rechunk
from .routing import destination_index, range_index, split_rows
from .schemas import _own_meta, _schema_diff
from .table_input import check_key_columns, key_names, to_table


class TableOps(OperationState):
    """What every operation's table path shares (mixed into the operation classes)."""

    #: Largest piece (bytes) a table is cut into for sending (zero-copy slices; spill granularity).
    table_piece_bytes = 8 << 20
    #: Whether the table path works in streaming mode (pieces delivered as they arrive).
    _streams_tables = True

    def _table_in(self, task: int, data: Any, keys: Sequence[str]) -> Any:
        if self.mode != "batch" and not self._streams_tables:
            raise TwisternetError(f"{self.describe()}: send_table is for batch operations")
        self._check_source(task)
        table = to_table(data)
        check_key_columns(table, keys, f"{self.describe()} (edge {self.edge}) send_table from task {task} "
                                       f"on rank {self.rank}")
        return table

    def _pieces(self, table: Any) -> list[Any]:
        """``table`` cut into slices of at most ``table_piece_bytes`` (at least one, maybe empty)."""
        rows = table.num_rows
        if rows == 0:
            return [table]
        per = max(1, int(self.table_piece_bytes * rows // max(1, table.nbytes)))
        return [table.slice(i, per) for i in range(0, rows, per)]

    def _key_columns(self, key: str | Sequence[str] | None, required: bool = True) -> list[str]:
        """The key column names ``key`` gives; TypeError if ``required`` and there are none."""
        keys = key_names(key)
        if required and not keys:
            raise TypeError(f"{self.describe()}.send_table needs key= (the key column name or names)")
        return keys

    def _send_routed(self, task: int, table: Any, keys: Sequence[str], splitters: Any,
                     send_piece: Callable[[int, int, Any, float | None], None], timeout: float | None) -> None:
        """Send ``table``'s rows by key (hash, or key range with ``splitters``) with ``send_piece(task,
        destination, rows, timeout)``, slice by slice; a schema new for ``task`` goes to every destination
        (with no rows where it has none), so each destination sees every schema variant."""
        dests = self.destinations
        every = self._new_schema(task, table.schema)
        for parts in self._routed_slices(table, keys, splitters):
            for d, part in zip(dests, parts):
                if part.num_rows or every:
                    send_piece(task, d, part, timeout)
            every = False

    def _routed_slices(self, table: Any, keys: Sequence[str], splitters: Any) -> Iterator[list[Any]]:
        """Per slice of at most ``table_piece_bytes`` of ``table`` (in order), its rows for each
        destination: routing and the ``take`` that groups rows work one slice at a time, so a table
        larger than memory allows costs one slice of extra memory, not a second copy of the table."""
        n = len(self.destinations)
        for part in self._pieces(table):
            yield split_rows(part, self._route_rows(part, keys, splitters), n)

    def _send_direct(self, task: int, rank: int, offset: int, msg: Any, timeout: float | None,
                     before: Any = None) -> None:
        """Hand ``msg`` (holding a table piece) to the Context with a blocking send from this thread,
        outside the operation's lock: large pieces then go out without a copy (the Context waits for
        the send to complete), unlike records parked for ``try_send``. Records parked earlier by this
        operation (and ``before()``, run under the lock) go first."""
        from ..edges import channel_edge
        self._check_source(task)
        self._raise_if_failed()
        with self._lock:
            self._raise_if_failed()
            self._active = True
            if before is not None:
                before()
        self._settle(timeout)
        self.ctx.send(rank, channel_edge(self.edge, offset), msg,
                      timeout=self.timeout if timeout is None else timeout)
        self._after()

    def _route_rows(self, table: Any, keys: Sequence[str], splitters: Any) -> np.ndarray:
        """Destination index of each row: stable hash, or key range with ``splitters``."""
        n = len(self.destinations)
        if splitters is None:
            return destination_index(table, keys, n)
        splitters = to_table(splitters)
        if splitters.num_rows != n - 1:
            raise ValueError(f"{self.describe()}: {n} destinations need {n - 1} splitter rows, got "
                             f"{splitters.num_rows}")
        return range_index(table, keys, splitters)

    def _new_schema(self, task: int, schema: Any) -> bool:
        """Whether ``task`` sends ``schema`` for the first time (then it goes to every destination)."""
        seen = self.__dict__.setdefault("_table_schemas", {})
        if task in seen and seen[task].equals(schema, check_metadata=False) \
                and _own_meta(seen[task]) == _own_meta(schema):
            return False
        seen[task] = schema
        return True

    def _table_seq(self, task: int) -> int:
        seqs = self.__dict__.setdefault("_table_seqs", {})
        seq = seqs.get(task, 0)
        seqs[task] = seq + 1
        return seq

    def _collect(self, task: int | None, timeout: float | None,
                 pairs: Iterable[tuple[int, Any]]) -> Any:
        """Concatenate ``(source_task, table)`` pieces in order, checking that their schemas agree."""
        pa = require_pyarrow()
        tables = [t for t, _ in self._checked_pieces(pairs)]
        if not tables:
            return pa.table({})
        return pa.concat_tables(tables)

    def _checked_pieces(self, pairs: Iterable[tuple[int, Any]]) -> Iterator[tuple[Any, bool]]:
        """``(table, is_first)`` for each ``(source_task, piece)`` in order, as it is read: each piece a
        Table checked against the first one's schema (:meth:`_checked_piece`)."""
        first = first_src = None
        for src, t in pairs:
            t = self._checked_piece(first, first_src, src, t)
            if first is None:
                first, first_src = t.schema, src
                yield t, True
            else:
                yield t, False

    def _checked_piece(self, first: Any, first_src: Any, src: int, t: Any) -> Any:
        """One received piece as a Table, checked against the first piece's schema."""
        pa = require_pyarrow()
        if not is_arrow_data(t):
            raise TwisternetError(f"{self.describe()} (edge {self.edge}): found a record from task {src} that "
                                  f"is not a table (an operation carries either send() records or send_table() "
                                  f"tables)")
        if isinstance(t, pa.RecordBatch):
            t = pa.Table.from_batches([t])
        if first is None:
            return t
        if not t.schema.equals(first, check_metadata=False):
            diff = _schema_diff(first, t.schema)
        elif _own_meta(t.schema) != _own_meta(first):
            diff = (f"they were sent with different key= or aggregate= ({_own_meta(first)} vs "
                    f"{_own_meta(t.schema)})")
        else:
            return t        # user metadata may differ: the first table's is kept
        raise TableSchemaError(
            f"{self.describe()} (edge {self.edge}) at rank {self.rank}: tables from task {first_src} "
            f"(rank {self.plan.rank_of(first_src)}) and task {src} (rank {self.plan.rank_of(src)}) "
            f"have different schemas: {diff}")

    def _table_pairs(self, task: int, timeout: float | None) -> Iterable[tuple[int, Any]]:
        """``(source_task, table)`` pieces of local destination ``task``, in result order."""
        raise NotImplementedError

    def result_table(self, task: int | None = None, *, timeout: float | None = None) -> Any:
        """Batch: the rows local destination ``task`` received, as one ``pyarrow.Table`` (see the
        module docstring for each operation's order); small pieces are re-chunked into batches of
        about ``config.table_batch_bytes``."""
        pa = require_pyarrow()
        task = self._check_table_results(task)
        seen: list[Any] = []
        batches = list(self._received_batches(task, timeout, seen))
        if not seen:
            return pa.table({})
        return pa.Table.from_batches(batches, schema=seen[0])

    def result_batches(self, task: int | None = None, *, timeout: float | None = None) -> Iterator[Any]:
        """:meth:`result_table`'s rows as ``pyarrow.RecordBatch``es, yielded as the received pieces
        are read (spilled pieces come back from disk one at a time), not gathered in memory. In batch
        mode, consecutive pieces smaller than ``config.table_batch_bytes`` are concatenated into one
        batch of about that size (one copy of the small pieces; large ones pass as they are); in
        streaming mode each piece is yielded as it arrives."""
        task = self._check_table_results(task)
        yield from self._received_batches(task, timeout)

    def _received_batches(self, task: int, timeout: float | None, seen: list | None = None) -> Iterator[Any]:
        """The checked pieces of ``task`` as record batches, re-chunked in batch mode (the first
        piece's schema is appended to ``seen``)."""
        def pieces() -> Iterator[Any]:
            first = None
            for t, _ in self._checked_pieces(self._table_pairs(task, timeout)):
                if first is None:   # the first piece
                    first = t.schema
                    if seen is not None:
                        seen.append(first)
                else:
                    t = t.replace_schema_metadata(first.metadata)   # the first table's metadata is kept
                yield from t.to_batches()

        target = int(getattr(self.ctx.config, "table_batch_bytes", 0) or 0)
        if self.mode != "batch" or target <= 0:
            yield from pieces()
        else:
            yield from rechunk(pieces(), target)

    def _check_table_results(self, task: int | None) -> int:
        if self.mode != "batch" and not self._streams_tables:
            raise TwisternetError(f"{self.describe()}: result_table is for batch operations")
        return self._dest(task)
