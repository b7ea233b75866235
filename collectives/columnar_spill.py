"""Sorting tables larger than memory: sorted runs spilled as Arrow IPC files, merged back by key in
vectorized blocks.

:class:`SortedRuns` takes tables (:meth:`~SortedRuns.add`) while their bytes stay under a budget; past
it the held rows are sorted by key (stable) and written as a *run*: an Arrow IPC file of record batches
(optionally compressed). :meth:`~SortedRuns.batches` then yields every row in key order, stable (equal
keys by a ``tiebreak`` column if given, then in the order added), as record batches: from memory when
nothing was spilled, else by a block-wise k-way merge: each round takes, from every run's current batch,
the rows whose key is below the smallest last key of the runs that have more batches (found by binary
search), sorts that block with one Arrow sort, and yields it. Runs are written in batches of 1/16 of the
budget, so merging holds about two such batches per run: within twice the budget (as adding does at
its peak) for up to :data:`MERGE_FAN_IN` runs. With more, groups of consecutive runs are first merged
into one each (as in external sorts: just enough that :data:`MERGE_FAN_IN` are left; 17 runs cost one
merge of 2), so memory stays within twice the budget plus a constant however large the data; the runs
so merged are read and written once more. Freed Arrow memory is handed back to the system after a
run or merge block once the process has grown by twice the budget since the runs started (not every
time: memory handed back is faulted in again by the next block). A single fixed-size binary key (the
TeraSort key) is searched with numpy on its bytes as 64-bit words; other keys by a Python binary
search over Arrow scalars.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import uuid
from typing import Any
from collections.abc import Iterator, Sequence

from twisternet.arrowcodec import require_pyarrow

from .columnar.sorting import (
    binary_key_words,
    bytes_words,
    count_below_words,
    sort_indices,
    sorted_source,
    take_rows,
)

log = logging.getLogger(__name__)

#: Most runs merged at once. Each holds about two batches of 1/16 of the budget while merging, so a
#: merge of 16 holds about twice the budget: what adding holds at its peak too (the rows held and
#: their sorted copy while a run is written). More runs are merged in groups first.
MERGE_FAN_IN = 16


def _order_key(v: Any) -> tuple:
    """A Python sort key ordered like Arrow's key sort with nulls first (NaN above every number)."""
    if v is None:
        return (0,)
    if isinstance(v, float) and math.isnan(v):
        return (2,)
    return (1, v)


def _release() -> None:
    """Hand memory Arrow's allocator freed back to the system (mimalloc and jemalloc keep it
    otherwise, and a long merge would hold far more than it uses)."""
    try:
        require_pyarrow().default_memory_pool().release_unused()
    except AttributeError:      # pyarrow < 12
        pass


def _rss_bytes() -> int | None:
    """This process's resident set size (Linux), or None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class _Run:
    """A spilled run read back one record batch at a time."""

    def __init__(self, path: str, keys: Sequence[str]) -> None:
        pa = require_pyarrow()
        self.path = path
        self.keys = list(keys)
        self._file = pa.OSFile(path, "rb")
        self._reader = pa.ipc.open_file(self._file)
        self._next = 0
        self.buf = pa.Table.from_batches([], schema=self._reader.schema)
        #: ``buf``'s key as words (a single fixed-size binary key without nulls; False: another key), so
        #: that :meth:`count_below` is a numpy binary search instead of a Python one over Arrow scalars.
        self._words: list[Any] | None | bool = None
        key = self._reader.schema.field(self.keys[0]).type if len(self.keys) == 1 else None
        self._width = key.byte_width if key is not None and pa.types.is_fixed_size_binary(key) else 0

    def more(self) -> bool:
        """Whether the file has batches not yet loaded."""
        return self._next < self._reader.num_record_batches

    def load(self) -> None:
        """Append the next batch of the file to ``buf``."""
        pa = require_pyarrow()
        batch = self._reader.get_batch(self._next)
        self._next += 1
        self.buf = pa.concat_tables([self.buf, pa.Table.from_batches([batch])]) if self.buf.num_rows else \
            pa.Table.from_batches([batch])
        if self._words is not False:
            self._words = None

    def drop(self, rows: int) -> None:
        """Drop the first ``rows`` rows of ``buf`` (merged)."""
        self.buf = self.buf.slice(rows)
        if isinstance(self._words, list):
            self._words = [w[rows:] for w in self._words]

    def key_at(self, i: int) -> tuple:
        return tuple(_order_key(self.buf.column(k)[i].as_py()) for k in self.keys)

    def count_below(self, bound: tuple) -> int:
        """Rows of ``buf`` (sorted) whose key is below ``bound``."""
        if self._width and self._words is not False and len(bound) == 1 and len(bound[0]) == 2 \
                and isinstance(bound[0][1], bytes):
            if self._words is None:
                self._words = binary_key_words(self.buf, self.keys) or False
            if isinstance(self._words, list):
                return count_below_words(self._words, bytes_words(bound[0][1], self._width))
        lo, hi = 0, self.buf.num_rows
        while lo < hi:
            mid = (lo + hi) // 2
            if self.key_at(mid) < bound:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def close(self) -> None:
        try:
            self._file.close()
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class SortedRuns:
    """Rows of tables with one schema, returned sorted by ``keys`` (stable) within ``memory_limit``
    bytes while adding, spilling sorted Arrow IPC runs to ``spill_dir`` past it."""

    def __init__(self, keys: Sequence[str], memory_limit: int, spill_dir: str | None = None, *,
                 compression: str | None = None, batch_rows: int = 65536, name: str = "sorted runs",
                 tiebreak: str | None = None) -> None:
        pa = require_pyarrow()
        if compression is not None and not pa.Codec.is_available(compression):
            raise ValueError(f"Arrow IPC compression {compression!r} is not available in this pyarrow")
        self.keys = list(keys)
        #: A column ordering rows of equal keys (before the order they were added in), or None.
        self.tiebreak = tiebreak
        self.memory_limit = max(1, int(memory_limit))
        self.spill_dir = spill_dir or tempfile.gettempdir()
        self.compression = compression
        self.batch_rows = batch_rows
        self.name = name
        self._mem: list[Any] = []
        self._mem_bytes = 0
        self._paths: list[str] = []
        self._runs: list[_Run] = []
        self._run_rows = batch_rows
        self._schema: Any = None          # the runs' (the first run's; every run has one schema)
        self.spilled_bytes = 0
        self._rss_start = _rss_bytes() or 0
        #: How many runs were spilled so far.
        self.runs = 0

    def add(self, table: Any) -> None:
        """Hold ``table``'s rows (spilling a sorted run when past the memory limit)."""
        if table.num_rows == 0:
            return
        self._mem.append(table)
        self._mem_bytes += table.nbytes
        if self._mem_bytes >= self.memory_limit:
            self._spill()

    def _sorted_mem(self, batch_rows: int) -> Iterator[Any]:
        """The rows held, sorted (stable), as tables of at most ``batch_rows`` rows; they are no longer
        held. Each table is taken from the held rows in turn, so no sorted copy of all of them is made."""
        pa = require_pyarrow()
        if not self._mem:
            return
        table = pa.concat_tables(self._mem)
        self._mem, self._mem_bytes = [], 0
        if table.num_rows < 2:
            yield table
            return
        yield from self._in_key_order(table, batch_rows)

    def _in_key_order(self, table: Any, rows: int) -> Iterator[Any]:
        """``table``'s rows sorted (stable) by the keys, as tables of at most ``rows`` rows, each taken
        from ``table`` in turn (no sorted copy of it all is made)."""
        order = sort_indices(table, self.keys, self.tiebreak)
        table = sorted_source(table)
        for start in range(0, table.num_rows, rows):
            yield take_rows(table, order[start:start + rows])

    def set_compression(self, compression: str | None) -> None:
        """Compress the runs written from now on with ``compression`` (e.g. ``"lz4"``; None: not)."""
        pa = require_pyarrow()
        if compression is not None and not pa.Codec.is_available(compression):
            raise ValueError(f"Arrow IPC compression {compression!r} is not available in this pyarrow")
        self.compression = compression

    @property
    def held_bytes(self) -> int:
        """Bytes of the rows held in memory (not yet spilled)."""
        return self._mem_bytes

    def spill(self) -> None:
        """Write the rows held in memory as one more sorted run (none if there are none)."""
        self._spill()

    def _spill(self) -> None:
        if not self._mem:
            return
        # run batches of 1/16 of the budget: merging 16 runs holds about the budget again
        per_row = max(1, self._mem_bytes // max(1, sum(t.num_rows for t in self._mem)))
        self._run_rows = rows = max(64, self.memory_limit // 16 // per_row)
        self._schema = self._mem[0].schema
        path = self._write_run(self._schema, self._sorted_mem(rows))
        self.runs += 1
        log.debug("%s: spilled run %d (%d bytes)", self.name, len(self._paths), os.path.getsize(path))

    def _write_run(self, schema: Any, parts: Iterator[Any]) -> str:
        """Write ``parts`` (sorted tables) as one more run file at the end of ``_paths``; its path."""
        pa = require_pyarrow()
        os.makedirs(self.spill_dir, exist_ok=True)
        path = os.path.join(self.spill_dir, f"twisternet-run-{os.getpid()}-{uuid.uuid4().hex}.arrow")
        options = pa.ipc.IpcWriteOptions(compression=self.compression)
        self._paths.append(path)     # removed by close() even if writing fails
        with pa.OSFile(path, "wb") as f, pa.ipc.new_file(f, schema, options=options) as w:
            for part in parts:
                w.write_table(part)
        self._trim()
        self.spilled_bytes += os.path.getsize(path)
        return path

    def _trim(self) -> None:
        """Hand freed Arrow memory back to the system once this process's RSS has grown past twice the
        budget since these runs started (or always, where RSS cannot be read). Not after every run
        and merge block: memory handed back is faulted in again by the next block, which on a 1 GB
        sort cost ~10 % of the time."""
        rss = _rss_bytes()
        if rss is None or rss > self._rss_start + 2 * self.memory_limit:
            _release()

    def batches(self) -> Iterator[Any]:
        """Every row added, sorted by key (stable), as record batches of at most ``batch_rows`` rows."""
        if not self._paths:
            for part in self._sorted_mem(self.batch_rows):
                yield from part.to_batches()
            return
        self._spill()
        at = 0
        while len(self._paths) > MERGE_FAN_IN:
            # Merge just enough consecutive runs (into one, in their place: equal keys keep the order
            # the rows were added in) that MERGE_FAN_IN are left, moving on past each merged run so
            # that no run is rewritten before every run has been once.
            k = min(MERGE_FAN_IN, len(self._paths) - MERGE_FAN_IN + 1)
            if at + k > len(self._paths):
                at = 0
            # _write_run adds the merged run at the end (close() removes every file listed if it fails)
            self._write_run(self._schema, self._merge(self._paths[at:at + k], self._run_rows))
            self._paths = self._paths[:at] + self._paths[-1:] + self._paths[at + k:-1]
            at += 1
            log.debug("%s: merged %d runs into one, %d left", self.name, k, len(self._paths))
        paths, self._paths = self._paths, []
        for part in self._merge(paths, self.batch_rows):
            yield from part.to_batches()
        self.close()

    def _merge(self, paths: list[str], rows: int) -> Iterator[Any]:
        """The rows of the run files ``paths`` in key order (stable: earlier runs first among equal
        keys), as tables of at most ``rows`` rows; the files are removed once read."""
        pa = require_pyarrow()
        runs = [_Run(p, self.keys) for p in paths]
        self._runs = runs
        try:
            for r in runs:
                if r.more():
                    r.load()
            while True:
                pending = [r for r in runs if r.more()]
                if not pending:
                    block = [r.buf for r in runs if r.buf.num_rows]
                    for r in runs:
                        r.drop(r.buf.num_rows)
                else:
                    bound = min(r.key_at(r.buf.num_rows - 1) if r.buf.num_rows else ((-1,),) for r in pending)
                    if bound == ((-1,),):            # a pending run with an empty buffer: load it first
                        for r in pending:
                            if not r.buf.num_rows:
                                r.load()
                        continue
                    block = []
                    for r in runs:
                        if r.buf.num_rows:
                            cut = r.count_below(bound)
                            if cut:
                                block.append(r.buf.slice(0, cut))
                                r.drop(cut)
                    if not block:       # every remaining row of the bounding runs equals the bound: read on
                        for r in pending:
                            if r.key_at(r.buf.num_rows - 1) == bound:
                                r.load()
                        continue
                    for r in pending:
                        if not r.buf.num_rows:
                            r.load()
                if block:
                    merged = pa.concat_tables(block)
                    del block
                    yield from self._in_key_order(merged, rows)
                    del merged
                    self._trim()
                if not pending:
                    break
        finally:
            for r in runs:
                r.close()
            self._runs = []

    def close(self) -> None:
        """Remove the run files (idempotent)."""
        for r in self._runs:
            r.close()
        for p in self._paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self._runs, self._paths, self._mem = [], [], []
