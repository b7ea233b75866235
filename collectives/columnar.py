"""Columnar dataflow: whole Arrow tables through the operations (``send_table`` / ``result_table``).

Sources call ``op.send_table(task, table, key=...)`` with a ``pyarrow.Table`` or ``RecordBatch`` (a
pandas DataFrame or a numpy structured array is converted on the way in); batch destinations read
``op.result_table(task)``, a ``pyarrow.Table``. Rows are routed with vectorized kernels over the whole
table, never per row, and each destination's rows travel as a few large slices whose Arrow buffers are
the codec's out-of-band parts (:mod:`twisternet.arrowcodec`).

Routing of keyed operations: :func:`row_hashes` is a stable 64-bit hash of the key columns, identical
in every process, platform and pyarrow version (it is defined here, on the key values, not taken from
pyarrow). Per key column, each value becomes a 64-bit hash:

* integers, booleans, dates, times, timestamps, durations: the value as a 64-bit integer (signed values
  sign-extended), hashed with ``mix``;
* floats: the value as a float64 (``-0.0`` taken as ``0.0``, every NaN as ``0x7ff8000000000000``),
  its bits hashed with ``mix``;
* strings, binary, large and fixed-size binary, decimals: the bytes (UTF-8 for strings; a decimal's
  little-endian two's-complement bytes) as ``h = mix(len + G)`` then, for each 8-byte little-endian
  word ``w`` of the bytes (the last one zero-padded), ``h = mix(h ^ w)``;
* dictionary columns: the hash of their decoded values.

``mix`` is the splitmix64 finalizer (``x ^= x >> 30; x *= 0xbf58476d1ce4e5b9; x ^= x >> 27;
x *= 0x94d049bb133111eb; x ^= x >> 31``, modulo 2**64) and ``G = 0x9e3779b97f4a7c15``. The row hash
folds the columns in order: ``H = 0; H = mix(H ^ h_c)`` for each key column ``c``. A row goes to
``destinations[H % len(destinations)]``; a row with a null in any key column goes to
``destinations[0]`` (and sorts first in KeyedGather / KeyedReduce results).

What a destination's ``result_table`` holds:

=================  =================================================================================
KeyedPartition     its rows as sent: ordered by source task, then send order
KeyedGather        its rows sorted by the key columns (nulls first); stable: equal keys keep source
                   task order, then send order
KeyedReduce        one row per key of this destination: the key columns, then ``{column}_{fn}`` for
                   each aggregation (``sum``, ``min``, ``max``, ``count`` of non-null values,
                   ``mean``), sorted by key (nulls first); partial aggregates are computed at the
                   sources (a combiner) and merged at the destination
Partition          the rows sent to it (by ``key`` hash, ``destination`` or round-robin), by source
                   task then send order
Gather, AllGather  every source's rows, by source task then send order
Broadcast          the source's rows, in send order
=================  =================================================================================

Every table sent to one operation must have the same schema: a destination that sees two raises
:class:`~twisternet.errors.TableSchemaError` naming the columns that differ and the ranks and tasks that
sent each variant (each source sends every new schema it uses to every destination, so each
destination sees every variant). A key column missing at the sender raises it at ``send_table``. An
operation carries either records (``send``) or tables (``send_table``), not both.

Streaming operations take tables too: ``result_batches`` then yields each piece as it arrives (send
order per source, none between sources; KeyedGather's unsorted; KeyedReduce's as the updated aggregates
of the keys the piece touched), and ``result_table`` gathers them once every source finished
(KeyedGather's sorted, KeyedReduce's final aggregates). Batch destinations re-chunk small received pieces
into batches of about ``config.table_batch_bytes`` (:func:`rechunk`).
"""

from __future__ import annotations

import json
import logging
from typing import Any
from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np

from twisternet.arrowcodec import INSTALL_HINT, is_arrow_data, require_pyarrow
from twisternet.errors import TableSchemaError, TwisternetError

log = logging.getLogger(__name__)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CANON_NAN = np.uint64(0x7FF8000000000000)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)

#: Aggregations KeyedReduce.send_table accepts.
AGGREGATIONS = ("sum", "min", "max", "count", "mean")
_META_AGG = b"twisternet.aggregate"


# ------------------------------------------------------------------------------------------- tables in
def to_table(data: Any) -> Any:
    """``data`` as a ``pyarrow.Table``: a Table as it is, a RecordBatch wrapped (no copy), a pandas
    DataFrame (index dropped) or a numpy structured array converted column by column."""
    pa = require_pyarrow()
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if isinstance(data, np.ndarray) and data.dtype.names is not None:
        if data.ndim != 1:
            raise TableSchemaError(f"a structured array table must be 1-d, got shape {data.shape}")
        return pa.table({name: np.ascontiguousarray(data[name]) for name in data.dtype.names})
    mod = type(data).__module__ or ""
    if mod.startswith("pandas") and type(data).__name__ == "DataFrame":
        table = pa.Table.from_pandas(data, preserve_index=False)
        meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != b"pandas"}
        return table.replace_schema_metadata(meta or None)
    raise TypeError(f"send_table takes a pyarrow Table or RecordBatch, a pandas DataFrame or a numpy "
                    f"structured array, got {type(data).__module__}.{type(data).__qualname__}")


def key_names(key: str | Sequence[str] | None) -> list[str]:
    """The key column names of ``key`` (one name or several)."""
    if key is None:
        return []
    if isinstance(key, str):
        return [key]
    names = list(key)
    if not names or not all(isinstance(k, str) for k in names):
        raise TypeError(f"key must be a column name or a list of column names, got {key!r}")
    return names


def check_key_columns(table: Any, keys: Sequence[str], where: str) -> None:
    """TableSchemaError unless every key column is in ``table``."""
    missing = [k for k in keys if k not in table.column_names]
    if missing:
        raise TableSchemaError(f"{where}: key column(s) {missing} not in the table; its columns are "
                               f"{table.column_names}")


# ------------------------------------------------------------------------------------------- hashing
def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 values (wrapping arithmetic)."""
    x = x ^ (x >> _S30)
    x = x * _M1
    x = x ^ (x >> _S27)
    x = x * _M2
    return x ^ (x >> _S31)


def _hash_words(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The bytes hash of rows ``data[starts[i]:starts[i] + lengths[i]]`` (see the module docstring):
    one gather of 8-byte words per word of the longest key, from an unaligned uint64 view of the data."""
    n = len(starts)
    h = _mix(lengths.astype(np.uint64) + GOLDEN)
    if n == 0:
        return h
    maxlen = int(lengths.max())
    if maxlen == 0:
        return h
    padded = np.zeros(len(data) + 8, dtype=np.uint8)
    padded[:len(data)] = data
    # the little-endian uint64 starting at every byte offset (overlapping, unaligned windows)
    words = np.ndarray(shape=(len(data) + 1,), dtype="<u8", buffer=padded, strides=(1,))
    starts = starts.astype(np.int64)
    lengths = lengths.astype(np.int64)
    for w in range(0, maxlen, 8):
        rem = lengths - w
        live = rem > 0
        every = bool(live.all())
        word = words[starts + w if every else np.where(live, starts + w, 0)]
        short = rem < 8
        if short.any():
            nbits = (np.clip(rem, 0, 8) * 8).astype(np.uint64)
            mask = np.where(nbits >= 64, _ALL, (np.uint64(1) << np.minimum(nbits, 63)) - np.uint64(1))
            word = word & mask
        mixed = _mix(h ^ word)
        h = mixed if every else np.where(live, mixed, h)
    return h


def _column_hashes(pa: Any, pc: Any, arr: Any) -> np.ndarray:
    """The per-value 64-bit hash of one key array (nulls hash as some value; callers route them)."""
    t = arr.type
    n = len(arr)
    if pa.types.is_dictionary(t):
        return _column_hashes(pa, pc, arr.dictionary_decode())
    if pa.types.is_null(t):
        return np.zeros(n, dtype=np.uint64)
    if pa.types.is_floating(t):
        v = np.asarray(pc.fill_null(arr, 0).to_numpy(zero_copy_only=False), dtype=np.float64)
        v = np.where(v == 0.0, 0.0, v)
        bits = v.view(np.uint64).copy()
        bits[np.isnan(v)] = _CANON_NAN
        return _mix(bits)
    if pa.types.is_boolean(t):
        v = np.asarray(pc.fill_null(arr, False).to_numpy(zero_copy_only=False), dtype=np.uint64)
        return _mix(v)
    if pa.types.is_integer(t) or (pa.types.is_temporal(t) and not pa.types.is_interval(t)):
        if not pa.types.is_integer(t):
            arr = arr.view(getattr(pa, f"int{t.bit_width}")())
        v = pc.fill_null(arr, 0).to_numpy(zero_copy_only=False)
        if pa.types.is_unsigned_integer(arr.type):
            return _mix(v.astype(np.uint64))
        return _mix(v.astype(np.int64).view(np.uint64))
    if pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        large = pa.types.is_large_string(t) or pa.types.is_large_binary(t)
        bufs = arr.buffers()
        if bufs[1] is None or n == 0:
            return _hash_words(np.zeros(0, np.uint8), np.zeros(n, np.int64), np.zeros(n, np.int64))
        offs = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[arr.offset:arr.offset + n + 1]
        data = np.frombuffer(bufs[2], dtype=np.uint8) if bufs[2] is not None else np.zeros(0, np.uint8)
        lengths = np.diff(offs).astype(np.int64)
        lengths[~_valid(arr)] = 0
        return _hash_words(data, offs[:-1].astype(np.int64), lengths)
    if pa.types.is_fixed_size_binary(t) or pa.types.is_decimal(t):
        width = t.byte_width
        bufs = arr.buffers()
        data = np.frombuffer(bufs[1], dtype=np.uint8)[arr.offset * width:(arr.offset + n) * width] \
            if bufs[1] is not None else np.zeros(n * width, np.uint8)
        return _hash_words(data, np.arange(n, dtype=np.int64) * width, np.full(n, width, dtype=np.int64))
    raise TableSchemaError(f"key columns of type {t} are not supported (use integer, floating, boolean, "
                           f"temporal, string, binary, fixed-size binary, decimal or dictionary columns)")


def _valid(arr: Any) -> np.ndarray:
    """Boolean mask of the non-null values of ``arr``."""
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), dtype=bool)


def row_hashes(table: Any, keys: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(hashes, null_rows)``: the stable 64-bit hash of each row's key columns (module docstring) and
    which rows have a null in some key column."""
    pa = require_pyarrow()
    import pyarrow.compute as pc
    n = table.num_rows
    h = np.zeros(n, dtype=np.uint64)
    nulls = np.zeros(n, dtype=bool)
    for k in keys:
        col = table.column(k)
        parts = [_column_hashes(pa, pc, c) for c in col.chunks]
        hc = np.concatenate(parts) if parts else np.zeros(0, np.uint64)
        if col.null_count:
            nulls |= ~np.concatenate([_valid(c) for c in col.chunks])
        h = _mix(h ^ hc)
    return h, nulls


def destination_index(table: Any, keys: Sequence[str], n: int) -> np.ndarray:
    """For each row, the index (``0 .. n-1``) of the destination its key selects; null keys go to 0."""
    h, nulls = row_hashes(table, keys)
    idx = (h % np.uint64(n)).astype(np.int64)
    idx[nulls] = 0
    return idx


def splitters_from_sample(sample: Any, keys: Sequence[str], n: int) -> Any:
    """``n - 1`` splitter rows (the key columns) at the quantiles of ``sample``: for range partitioning
    over ``n`` destinations. Null keys are left out (they always go to the first destination). Every
    process computing it from the same sample (e.g. an AllGather of per-source samples) gets the same."""
    import pyarrow.compute as pc
    sample = to_table(sample).select(list(keys))
    for k in keys:
        sample = sample.filter(pc.is_valid(sample.column(k)))
    ordered = sort_by_keys(sample, keys)
    m = ordered.num_rows
    if n <= 1 or m == 0:
        return ordered.slice(0, 0)
    picks = [min(m - 1, (i * m) // n) for i in range(1, n)]
    return ordered.take(picks)


def _searchable(pa: Any, arr: Any) -> np.ndarray | None:
    """A numpy array ordered like ``arr``'s values (numeric, temporal or fixed-size binary), or None."""
    t = arr.type
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return arr.to_numpy(zero_copy_only=False)
    if pa.types.is_temporal(t) and not pa.types.is_interval(t):
        return arr.view(getattr(pa, f"int{t.bit_width}")()).to_numpy(zero_copy_only=False)
    if pa.types.is_fixed_size_binary(t):
        w = t.byte_width
        bufs = arr.buffers()
        raw = np.frombuffer(bufs[1], dtype=np.uint8)[arr.offset * w:(arr.offset + len(arr)) * w]
        return raw.view(f"S{w}")     # equal-width bytes: numpy's order is memcmp's
    return None


def range_index(table: Any, keys: Sequence[str], splitters: Any) -> np.ndarray:
    """For each row, the destination index its key falls in by ``splitters`` (sorted key rows, as
    from :func:`splitters_from_sample`): index ``i`` holds keys in ``(s[i-1], s[i]]``; null keys go to
    0. A single numeric, temporal or fixed-size binary key uses a binary search; other keys one stable
    sort of the rows with the splitters."""
    pa = require_pyarrow()
    import pyarrow.compute as pc
    splitters = to_table(splitters)
    check_key_columns(splitters, keys, "range splitters")
    splitters = splitters.select(list(keys))
    n = table.num_rows
    nulls = np.zeros(n, dtype=bool)
    for k in keys:
        col = table.column(k)
        if col.null_count:
            nulls |= ~np.asarray(pc.is_valid(col).to_numpy(zero_copy_only=False), dtype=bool)
    if len(keys) == 1:
        col = table.column(keys[0]).combine_chunks()
        spl = splitters.column(keys[0]).combine_chunks()
        if col.type.equals(spl.type):
            a, s = _searchable(pa, col), _searchable(pa, spl)
            if a is not None and s is not None:
                idx = np.searchsorted(s, a, side="left").astype(np.int64)
                idx[nulls] = 0
                return idx
    # general: sort rows and splitters together (splitters after equal rows), count splitters before
    rows = _sortable(table, keys)
    both = pa.concat_tables([rows, _sortable(splitters, keys).cast(rows.schema)])
    order = np.asarray(pc.sort_indices(both, sort_keys=[(k, "ascending") for k in keys]).to_numpy())
    is_spl = order >= n
    before = np.cumsum(is_spl) - is_spl
    idx = np.empty(n, dtype=np.int64)
    idx[order[~is_spl]] = before[~is_spl]
    idx[nulls] = 0
    return idx


def split_rows(table: Any, index: np.ndarray, n: int) -> list[Any]:
    """The rows of ``table`` for each of ``n`` destinations (``index[i]`` of row ``i``), keeping their
    order: one ``take`` of the whole table, then zero-copy slices."""
    if n == 1:
        return [table]
    counts = np.bincount(index, minlength=n)
    order = np.argsort(index, kind="stable")
    grouped = table.take(order)
    out, pos = [], 0
    for c in counts.tolist():
        out.append(grouped.slice(pos, c))
        pos += c
    return out


def sort_by_keys(table: Any, keys: Sequence[str]) -> Any:
    """``table`` stably sorted by ``keys`` ascending, nulls first."""
    import pyarrow.compute as pc
    if table.num_rows < 2 or not keys:
        return table
    if any(c.num_chunks > 1 for c in table.columns):
        # Arrow sorts and takes contiguous columns several times faster (one dictionary per column first)
        table = table.unify_dictionaries().combine_chunks()
    fast = _binary_key_order(table, keys)
    if fast is not None:
        return table.take(fast)
    by = _sortable(table, keys)
    try:       # pyarrow >= 25: null placement per sort key
        idx = pc.sort_indices(by, sort_keys=[(k, "ascending", "at_start") for k in keys])
    except (TypeError, ValueError):
        idx = pc.sort_indices(by, sort_keys=[(k, "ascending") for k in keys], null_placement="at_start")
    return table.take(idx)


def _word_columns(raw: np.ndarray, n: int, width: int) -> list[np.ndarray]:
    """The fixed-size keys of ``raw`` (``n`` keys of ``width`` bytes) as native uint64 words, most
    significant first, each holding 8 of the key's bytes big-endian (the last zero-padded): comparing
    the word tuples compares the keys as bytes (memcmp)."""
    words = []
    for w in range(0, width, 8):
        take = min(8, width - w)
        if take == 8:
            view = np.ndarray(shape=(n,), dtype=">u8", buffer=raw, offset=w, strides=(width,))
            words.append(view.astype(np.uint64))
        else:
            part = np.zeros((n, 8), dtype=np.uint8)
            part[:, :take] = raw.reshape(n, width)[:, w:w + take]
            words.append(part.view(">u8").ravel().astype(np.uint64))
    return words


def _binary_key_order(table: Any, keys: Sequence[str]) -> np.ndarray | None:
    """Stable sort indices (nulls first) of ``table`` by a single fixed-size binary key, computed with
    numpy on the key's bytes as big-endian 64-bit words; None for other keys. Arrow compares
    fixed-size binary values one by one, several times slower: this is the TeraSort key. When the
    first word already orders the rows with no ties (random keys), one unstable argsort of it is the
    stable order; else a stable lexsort of every word."""
    pa = require_pyarrow()
    if len(keys) != 1:
        return None
    col = table.column(keys[0])
    if not pa.types.is_fixed_size_binary(col.type) or col.num_chunks != 1:
        return None
    arr = col.chunk(0)
    n, width = len(arr), col.type.byte_width
    if width == 0 or arr.buffers()[1] is None:
        return None
    raw = np.frombuffer(arr.buffers()[1], dtype=np.uint8)[arr.offset * width:(arr.offset + n) * width]
    valid = _valid(arr)
    rows = None if arr.null_count == 0 else np.flatnonzero(valid)
    if rows is not None:
        raw = raw.reshape(n, width)[rows].ravel()
    m = n if rows is None else len(rows)
    if m == 0:
        return np.flatnonzero(~valid)
    words = _word_columns(raw, m, width)
    order = None
    if len(words) > 1 and m > 1:
        order = np.argsort(words[0])
        first = words[0][order]
        if bool(np.any(first[1:] == first[:-1])):
            order = None
    if order is None:
        order = np.lexsort(words[::-1]) if len(words) > 1 else np.argsort(words[0], kind="stable")
    if rows is None:
        return order
    return np.concatenate([np.flatnonzero(~valid), rows[order]])


def _sortable(table: Any, keys: Sequence[str]) -> Any:
    """The key columns of ``table``, dictionary columns decoded (Arrow does not sort tables by them)."""
    import pyarrow.compute as pc
    pa = require_pyarrow()
    by = table.select(list(keys))
    for i, field in enumerate(by.schema):
        if pa.types.is_dictionary(field.type):
            by = by.set_column(i, field.name, pc.cast(by.column(i), field.type.value_type))
    return by


def _label(name: str) -> str:
    """A column name for messages (KeyedReduce's partial states named after their column)."""
    if "\x1f" in name:
        col, state = name.split("\x1f", 1)
        return f"{col!r} (its {state} partial)"
    return repr(name)


def _own_meta(schema: Any) -> dict:
    """The schema metadata this module sets (key columns, aggregations), which must agree."""
    meta = schema.metadata or {}
    return {k.decode(): v.decode() for k, v in meta.items() if k.startswith(b"twisternet.")}


def _schema_diff(a: Any, b: Any) -> str:
    fa = {f.name: f for f in a}
    fb = {f.name: f for f in b}
    parts = []
    only_a = [n for n in fa if n not in fb]
    only_b = [n for n in fb if n not in fa]
    if only_a:
        parts.append(f"columns {', '.join(map(_label, only_a))} only in the first")
    if only_b:
        parts.append(f"columns {', '.join(map(_label, only_b))} only in the second")
    for name in fa:
        if name in fb and not fa[name].type.equals(fb[name].type):
            parts.append(f"column {_label(name)}: {fa[name].type} vs {fb[name].type}")
        elif name in fb and fa[name].nullable != fb[name].nullable:
            parts.append(f"column {_label(name)}: nullable {fa[name].nullable} vs {fb[name].nullable}")
    if not parts and a.names != b.names:
        parts.append(f"column order {a.names} vs {b.names}")
    if not parts:
        parts.append("field metadata differs")
    return "; ".join(parts)


def rechunk(batches: Iterable[Any], target_bytes: int) -> Iterator[Any]:
    """``batches`` (one schema) in the same row order, consecutive ones smaller than ``target_bytes``
    concatenated into batches of about ``target_bytes`` (a batch at least that large passes as it is,
    without a copy): many small pieces reach the reader as few large batches."""
    pa = require_pyarrow()
    held: list[Any] = []
    size = 0

    def joined() -> Any:
        if len(held) == 1:
            return held[0]
        if hasattr(pa, "concat_batches"):
            return pa.concat_batches(held)
        return pa.Table.from_batches(held).combine_chunks().to_batches()[0]

    for batch in batches:
        nbytes = batch.nbytes
        if nbytes >= target_bytes:
            if held:
                yield joined()
                held, size = [], 0
            yield batch
            continue
        if batch.num_rows == 0:
            continue
        held.append(batch)
        size += nbytes
        if size >= target_bytes:
            yield joined()
            held, size = [], 0
    if held:
        yield joined()


# ------------------------------------------------------------------------------------------- the mixins
class _TableOps:
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
        from .edges import channel_edge
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
        tables, first, first_src = [], None, None
        for src, t in pairs:
            t = self._checked_piece(first, first_src, src, t)
            if first is None:
                first, first_src = t.schema, src
            tables.append(t)
        if first is None:
            return pa.table({})
        return pa.concat_tables(tables)

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
        first = first_src = None

        def pieces() -> Iterator[Any]:
            nonlocal first, first_src
            for src, t in self._table_pairs(task, timeout):
                t = self._checked_piece(first, first_src, src, t)
                if first is None:
                    first, first_src = t.schema, src
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


class PartitionTables(_TableOps):
    """``send_table`` / ``result_table`` of Partition and KeyedPartition (rows as sent)."""

    def send_table(self, task: int, table: Any, key: str | Sequence[str] | None = None, *,
                   destination: int | None = None, splitters: Any = None, timeout: float | None = None) -> None:
        """Send the rows of ``table`` from local source ``task``: by the stable hash of the ``key``
        columns (required for KeyedPartition) or, with ``splitters``, by key range (see
        :func:`range_index`), else to ``destination``, else (Partition) round-robin one whole table
        per call."""
        keys = key_names(key)
        if not keys and getattr(self, "key_type", None) is not None:
            raise TypeError(f"{self.describe()}.send_table needs key= (the key column name or names)")
        table = self._table_in(task, table, keys)
        dests = self.destinations
        every = self._new_schema(task, table.schema)
        if not keys:
            dest = self._pick(task, table, destination)
            for d in dests:
                if d == dest or every:
                    for piece in self._pieces(table if d == dest else table.slice(0, 0)):
                        self._send_piece(task, d, piece, timeout)
            return
        for parts in self._routed_slices(table, keys, splitters):
            for d, part in zip(dests, parts):
                if part.num_rows or every:
                    self._send_piece(task, d, part, timeout)
            every = False

    def _send_piece(self, task: int, dest: int, piece: Any, timeout: float | None) -> None:
        from .edges import DIRECT
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


class BroadcastTables(_TableOps):
    """``send_table`` / ``result_table`` of Broadcast."""

    def send_table(self, task: int, table: Any, *, timeout: float | None = None) -> None:
        """Send ``table`` from the source ``task`` to every destination."""
        table = self._table_in(task, table, [])
        for piece in self._pieces(table):
            self._send_piece_down(task, piece, timeout)

    def _send_piece_down(self, task: int, piece: Any, timeout: float | None) -> None:
        """Deliver ``piece`` to this rank's destinations, then send it to each child rank of the tree
        with a blocking Context send from this thread: its buffers go out as they are, not copied."""
        from .edges import DOWN
        if self.local_destinations or not self._down_children:
            self._input(task, self._down_room, lambda: self._down_local([piece]), timeout=timeout)
        for c in list(self._down_children):
            self._send_direct(task, c, DOWN, ("v", [piece]), timeout)

    def _table_pairs(self, task: int, timeout: float | None) -> Iterable[tuple[int, Any]]:
        """The source's rows, in send order."""
        src = self.sources[0]
        return ((src, t) for t in self.results(task, timeout=timeout))


class GatherTables(_TableOps):
    """``send_table`` / ``result_table`` of Gather and AllGather."""

    def send_table(self, task: int, table: Any, *, timeout: float | None = None) -> None:
        """Send ``table``'s rows from local source ``task`` to the destination(s): pieces bound for other
        ranks go out as their Arrow buffers, without a copy at the sender."""
        table = self._table_in(task, table, [])
        for piece in self._pieces(table):
            if not self._send_piece_direct(task, piece, timeout):
                self.send(task, piece, timeout=timeout, copy=False)

    def _send_piece_direct(self, task: int, piece: Any, timeout: float | None) -> bool:
        """Send ``piece`` on with blocking Context sends from this thread (so the Context sends its
        buffers as they are, see :meth:`_send_direct`); False where the record path keeps it on this
        rank instead (this rank holds the tree's root, or batch AllGather on one rank)."""
        from .edges import DIRECT, UP_BASE
        if self.mode == "batch" and hasattr(self, "_emit_direct"):       # batch AllGather: direct exchange
            peers = list(self._peers)
            if not peers:
                return False
            chunk = [piece]

            def keep() -> None:
                self._flush_direct()
                if self._store is not None:
                    self._store.add_chunk(task, list(chunk))
            for i, r in enumerate(peers):
                self._send_direct(task, r, DIRECT, ("d", [task], [chunk]), timeout,
                                  before=keep if i == 0 else None)
            return True
        node = next(iter(self._nodes.values()))
        if node.parent is None:
            return False
        self._send_direct(task, node.parent, UP_BASE + node.level - 1, ("d", node.tid, [[task], [[piece]]]),
                          timeout, before=lambda: self._flush_node(node))
        return True

    def _table_pairs(self, task: int, timeout: float | None) -> Iterable[tuple[int, Any]]:
        """Every source's rows, by source task then send order."""
        return self.results(task, timeout=timeout)


class KeyedGatherTables(_TableOps):
    """``send_table`` / ``result_table`` of KeyedGather: rows sorted by key at their destination."""

    def send_table(self, task: int, table: Any, key: str | Sequence[str], *, splitters: Any = None,
                   timeout: float | None = None) -> None:
        """Send the rows of ``table`` from local source ``task`` to the destinations their ``key``
        columns hash to or, with ``splitters`` (``len(destinations) - 1`` sorted key rows, e.g. from
        :func:`splitters_from_sample`), to the destination of their key range: then the destinations'
        results, in destination order, are one globally sorted table."""
        keys = key_names(key)
        if not keys:
            raise TypeError(f"{self.describe()}.send_table needs key= (the key column name or names)")
        table = self._table_in(task, table, keys)
        meta = dict(table.schema.metadata or {})
        meta[b"twisternet.keys"] = json.dumps(keys).encode()
        table = table.replace_schema_metadata(meta)
        dests = self.destinations
        every = self._new_schema(task, table.schema)
        for parts in self._routed_slices(table, keys, splitters):
            for d, part in zip(dests, parts):
                if part.num_rows or every:
                    self._send_keyed_piece(task, d, part, timeout)
            every = False

    def _send_keyed_piece(self, task: int, dest: int, piece: Any, timeout: float | None) -> None:
        from .edges import UP_BASE
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
        ``spilled_runs`` says how many runs were written."""
        from .columnar_spill import SortedRuns
        task = self._check_table_results(task)
        require_pyarrow()
        if self.mode != "batch":          # streaming: pieces as they arrive (unsorted), key metadata dropped
            for batch in _TableOps.result_batches(self, task, timeout=timeout):
                meta = dict(batch.schema.metadata or {})
                meta.pop(b"twisternet.keys", None)
                yield batch.replace_schema_metadata(meta or None)
            return
        cfg = self.ctx.config
        limit = memory_limit or max(1 << 20, cfg.memory_limit // max(1, len(self.local_destinations)))
        first = first_src = runs = None
        try:
            for src, t in self._table_pairs(task, timeout):
                t = self._checked_piece(first, first_src, src, t)
                if first is None:
                    first, first_src = t.schema, src
                    meta = dict(first.metadata or {})
                    keys = json.loads(meta.pop(b"twisternet.keys", b"[]"))
                    plain = first.with_metadata(meta or None)
                    runs = SortedRuns(keys, limit, cfg.spill_dir, compression=compression, batch_rows=batch_rows,
                                      name=f"{self.describe()}(edge={self.edge}) task {task}")
                runs.add(t.replace_schema_metadata(plain.metadata))
            if runs is None:
                return
            self.spilled_runs = runs.runs
            for batch in runs.batches():
                yield batch
            self.spilled_runs = runs.runs
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


def _check_aggregate(aggregate: Mapping[str, str | Sequence[str]]) -> list[tuple[str, str]]:
    if not isinstance(aggregate, Mapping) or not aggregate:
        raise TypeError(f"aggregate must be a non-empty dict column -> aggregation, got {aggregate!r}")
    out = []
    for col, fns in aggregate.items():
        for fn in ([fns] if isinstance(fns, str) else list(fns)):
            if fn not in AGGREGATIONS:
                raise ValueError(f"aggregation {fn!r} of column {col!r} is not one of {', '.join(AGGREGATIONS)}")
            out.append((col, fn))
    return out


def _states(spec: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The partial-aggregate states ``(column, sum|min|max|count)`` that ``spec`` needs."""
    states: list[tuple[str, str]] = []
    for col, fn in spec:
        for s in (("sum", "count") if fn == "mean" else (fn,)):
            if (col, s) not in states:
                states.append((col, s))
    return states


def _state_name(col: str, op: str) -> str:
    return f"{col}\x1f{op}"


def partial_aggregate(table: Any, keys: list[str], spec: list[tuple[str, str]]) -> Any:
    """One row per key of ``table`` with the partial states of ``spec`` (the combiner)."""
    states = _states(spec)
    agg = table.group_by(keys, use_threads=False).aggregate([(c, s) for c, s in states])
    cols = {k: agg.column(k) for k in keys}
    for c, s in states:
        cols[_state_name(c, s)] = agg.column(f"{c}_{s}")
    pa = require_pyarrow()
    out = pa.table(cols)
    meta = {_META_AGG: json.dumps({"keys": keys, "spec": spec}).encode()}
    return out.replace_schema_metadata(meta)


def merge_aggregates(partials: Any, keys: list[str], spec: list[tuple[str, str]]) -> Any:
    """The final one-row-per-key table from concatenated partial states, sorted by key."""
    return _final_aggregates(merge_states(partials, keys, spec), keys, spec)


def merge_states(partials: Any, keys: list[str], spec: list[tuple[str, str]], extra: Sequence[str] = ()) -> Any:
    """One row per key of ``partials`` (partial-state rows, e.g. several sources' for one key) with
    the merged states, named as in the partials (sums of sums and counts, min of mins, ...); the
    ``extra`` columns are merged with ``max``."""
    pa = require_pyarrow()
    states = _states(spec)
    partials = partials.unify_dictionaries()     # pieces from several sources: one dictionary per column
    merged = partials.group_by(keys, use_threads=False).aggregate(
        [(_state_name(c, s), "sum" if s in ("sum", "count") else s) for c, s in states]
        + [(e, "max") for e in extra])
    cols = {k: merged.column(k) for k in keys}
    for c, s in states:
        cols[_state_name(c, s)] = merged.column(f"{_state_name(c, s)}_{'sum' if s in ('sum', 'count') else s}")
    for e in extra:
        cols[e] = merged.column(f"{e}_max")
    return pa.table(cols).replace_schema_metadata(partials.schema.metadata)


def _final_aggregates(merged: Any, keys: list[str], spec: list[tuple[str, str]]) -> Any:
    """The ``{column}_{fn}`` columns of merged states, sorted by key."""
    pa = require_pyarrow()
    import pyarrow.compute as pc
    got = {(c, s): merged.column(_state_name(c, s)) for c, s in _states(spec)}
    cols = {k: merged.column(k) for k in keys}
    for c, fn in spec:
        if fn == "mean":
            total = pc.cast(got[(c, "sum")], pa.float64())
            count = got[(c, "count")]
            cols[f"{c}_mean"] = pc.if_else(pc.greater(count, 0), pc.divide(total, pc.cast(count, pa.float64())),
                                           pa.scalar(None, pa.float64()))
        elif fn == "count":
            cols[f"{c}_count"] = pc.fill_null(got[(c, "count")], 0)
        else:
            cols[f"{c}_{fn}"] = got[(c, fn)]
    return sort_by_keys(pa.table(cols), keys)


class KeyedReduceTables(_TableOps):
    """``send_table`` / ``result_table`` of KeyedReduce: Arrow aggregations, one row per key. Streaming:
    each source's ``send_table`` call travels as its partial aggregates, and ``result_batches`` yields,
    per received piece, the updated aggregates of the keys that piece touched."""

    def send_table(self, task: int, table: Any, key: str | Sequence[str], *,
                   aggregate: Mapping[str, str | Sequence[str]], timeout: float | None = None) -> None:
        """Aggregate ``table`` by its ``key`` columns (``aggregate={"v": "sum", "w": ["max", "mean"]}``)
        at this source, then send each key's partial row to the destination the key hashes to."""
        keys = key_names(key)
        if not keys:
            raise TypeError(f"{self.describe()}.send_table needs key= (the key column name or names)")
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
                    self._input(task, lambda node=node: self._room(node),
                                lambda node=node, tag=tag, piece=piece: self._take(node, [(tag, piece)], _same),
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
        from .reduction import own
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
        first = first_src = state = None
        keys: list[str] = []
        spec: list[tuple[str, str]] = []
        mark = "\x1ftouched"
        for src, piece in self._table_pairs(task, timeout):
            piece = self._checked_piece(first, first_src, src, piece)
            if first is None:
                first, first_src = piece.schema, src
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


def _same(value: Any) -> Any:  # noqa: D103 - identity "copy" for pieces kept as they are
    return value


__all__ = ["to_table", "rechunk", "row_hashes", "destination_index", "split_rows", "range_index",
           "splitters_from_sample",
           "sort_by_keys", "key_names",
           "partial_aggregate", "merge_aggregates", "merge_states", "AGGREGATIONS", "INSTALL_HINT",
           "PartitionTables", "BroadcastTables", "GatherTables", "KeyedGatherTables", "KeyedReduceTables"]
