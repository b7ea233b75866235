"""Stable sorting of tables by key columns, nulls first (numpy for a single fixed-size binary key), with an
optional tie-break column ordering rows of equal keys."""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import numpy as np

from twisternet.arrowcodec import require_pyarrow

from .hashing import _valid, fixed_width_bytes


def sort_by_keys(table: Any, keys: Sequence[str], tiebreak: str | None = None) -> Any:
    """``table`` stably sorted by ``keys`` ascending, nulls first; rows of equal keys ordered by the
    ``tiebreak`` column (an unsigned integer column without nulls), if given, before their row order."""
    if table.num_rows < 2 or not keys:
        return table
    return sorted_source(table).take(sort_indices(table, keys, tiebreak))


def sorted_source(table: Any) -> Any:
    """``table`` ready for taking rows in a sort order (dictionary columns unified across chunks; the
    other columns stay as they are: taking from chunks needs no combined copy of the table)."""
    pa = require_pyarrow()
    if any(c.num_chunks > 1 and pa.types.is_dictionary(c.type) for c in table.columns):
        table = table.unify_dictionaries()
    return table


def take_rows(table: Any, indices: Any) -> Any:
    """``table.take(indices)`` (one chunk per column in the result), fast for tables of many chunks.

    Arrow's take from a column of many chunks resolves the chunk of every index on its own: on the
    rows a sort holds (~60 received batches of 100-byte rows) it ran 5x slower than combining the
    chunks first and taking from one. Combining would copy every held row at once, though, doubling
    the memory a spill or merge needs. So a column of fixed-width values (fixed-size binary, numbers,
    no nulls) is gathered here with numpy straight from its chunks into the result (the indices
    grouped by chunk); any other column goes to Arrow's take."""
    pa = require_pyarrow()
    idx = indices.to_numpy(zero_copy_only=False) if hasattr(indices, "to_numpy") else np.asarray(indices)
    idx = idx.astype(np.int64, copy=False)
    if table.num_rows == 0 or len(idx) == 0 or all(c.num_chunks <= 1 for c in table.columns):
        return table.take(idx)
    columns = []
    plan: list[tuple[np.ndarray, np.ndarray]] | None = None
    for col in table.columns:
        width = _gather_width(col.type)
        if width is None or col.null_count or col.num_chunks <= 1:
            columns.append(col.take(idx))
            continue
        if plan is None:
            plan = _by_chunk(col, idx)
        columns.append(_gather(col, width, idx, plan))
    return pa.Table.from_arrays(columns, schema=table.schema)


def _gather_width(t: Any) -> int | None:
    """Bytes per value of a column type :func:`take_rows` gathers itself, or None."""
    pa = require_pyarrow()
    if pa.types.is_fixed_size_binary(t) or ((pa.types.is_integer(t) or pa.types.is_floating(t))
                                            and not pa.types.is_float16(t)):
        width: int = t.byte_width
        return width
    return None


def _by_chunk(col: Any, idx: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per chunk of ``col``: the positions in ``idx`` of the rows it holds, and their rows within it."""
    lengths = np.fromiter((len(c) for c in col.chunks), np.int64, col.num_chunks)
    starts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    if idx.min() < 0 or idx.max() >= starts[-1]:
        raise IndexError(f"row index out of range for a table of {starts[-1]} rows")
    which = np.searchsorted(starts, idx, side="right") - 1
    plan = []
    for k in range(len(lengths)):
        pos = np.flatnonzero(which == k)
        plan.append((pos, idx[pos] - starts[k]))
    return plan


def _gather(col: Any, width: int, idx: np.ndarray, plan: list[tuple[np.ndarray, np.ndarray]]) -> Any:
    """The values of ``col`` (fixed width, no nulls, several chunks) at rows ``idx``, as one array."""
    pa = require_pyarrow()
    row = np.dtype(f"V{width}")          # one item per value: numpy copies each with one move
    out = np.empty(len(idx), row)
    for chunk, (pos, local) in zip(col.chunks, plan):
        if len(pos):
            out[pos] = fixed_width_bytes(chunk).view(row)[local]
    return pa.Array.from_buffers(col.type, len(idx), [None, pa.py_buffer(out.view(np.uint8))])


def sort_indices(table: Any, keys: Sequence[str], tiebreak: str | None = None) -> Any:
    """The stable order (row indices, numpy or Arrow) of :func:`sort_by_keys`, computed from the key
    (and tie-break) columns alone, combined into one chunk each first (Arrow sorts contiguous columns
    several times faster)."""
    import pyarrow.compute as pc
    names = [*keys, *([tiebreak] if tiebreak else [])]
    by = table.select(names)
    if any(c.num_chunks > 1 for c in by.columns):
        by = by.unify_dictionaries().combine_chunks()
    fast = _binary_key_order(by, keys, tiebreak)
    if fast is not None:
        return fast
    by = _sortable(by, names)
    try:       # pyarrow >= 25: null placement per sort key
        return pc.sort_indices(by, sort_keys=[(k, "ascending", "at_start") for k in names])
    except (TypeError, ValueError):
        return pc.sort_indices(by, sort_keys=[(k, "ascending") for k in names], null_placement="at_start")


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


def binary_key_words(table: Any, keys: Sequence[str]) -> list[np.ndarray] | None:
    """The single fixed-size binary key of ``table`` as :func:`_word_columns` (comparing word tuples
    compares keys), or None for other keys, or when the key has nulls."""
    pa = require_pyarrow()
    if len(keys) != 1:
        return None
    col = table.column(keys[0])
    if not pa.types.is_fixed_size_binary(col.type) or col.type.byte_width == 0 or col.null_count:
        return None
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    n, width = len(arr), col.type.byte_width
    if n == 0:
        return [np.zeros(0, np.uint64) for _ in range(0, width, 8)]
    return _word_columns(fixed_width_bytes(arr), n, width)


def count_below_words(words: list[np.ndarray], bound: list[int]) -> int:
    """How many of the sorted keys ``words`` (:func:`binary_key_words`) are below the key ``bound``
    (its words): a binary search per word, within the rows equal on the words before it."""
    lo, hi = 0, len(words[0])
    for w, b in zip(words, bound):
        seg = w[lo:hi]
        below = int(np.searchsorted(seg, np.uint64(b), "left"))
        equal_end = int(np.searchsorted(seg, np.uint64(b), "right"))
        lo, hi = lo + below, lo + equal_end
        if lo == hi:
            break
    return lo


def bytes_words(key: bytes, width: int) -> list[int]:
    """The words of one fixed-size key (as :func:`_word_columns` cuts them)."""
    padded = key + bytes(-len(key) % 8)
    return [int.from_bytes(padded[w:w + 8], "big") for w in range(0, width, 8)]


def _binary_key_order(table: Any, keys: Sequence[str], tiebreak: str | None = None) -> np.ndarray | None:
    """Stable sort indices (nulls first) of ``table`` by a single fixed-size binary key (then by the
    ``tiebreak`` column), computed with numpy on the key's bytes as big-endian 64-bit words; None for
    other keys. Arrow compares fixed-size binary values one by one, several times slower: this is the
    TeraSort key. When the first word already orders the rows with no ties (random keys), one unstable
    argsort of it is the stable order; else a stable lexsort of every word (and the tie-break)."""
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
    raw = fixed_width_bytes(arr)
    valid = _valid(arr)
    rows = None if arr.null_count == 0 else np.flatnonzero(valid)
    tb = None
    if tiebreak is not None:
        tb = table.column(tiebreak).combine_chunks().to_numpy(zero_copy_only=False)
    if rows is not None:
        raw = raw.reshape(n, width)[rows].ravel()
    null_rows = np.flatnonzero(~valid) if rows is not None else None
    if null_rows is not None and tb is not None:
        null_rows = null_rows[np.argsort(tb[null_rows], kind="stable")]
    m = n if rows is None else len(rows)
    if m == 0:
        return null_rows
    words = _word_columns(raw, m, width)
    order = None
    if len(words) > 1 and m > 1:
        order = np.argsort(words[0])
        first = words[0][order]
        if bool(np.any(first[1:] == first[:-1])):
            order = None
    if order is None:
        if tb is not None:
            words.append(tb if rows is None else tb[rows])       # least significant: lexsort's first
            order = np.lexsort([words[-1], *words[-2::-1]])
        else:
            order = np.lexsort(words[::-1]) if len(words) > 1 else np.argsort(words[0], kind="stable")
    if rows is None:
        return order
    return np.concatenate([null_rows, rows[order]])


def _sortable(table: Any, keys: Sequence[str]) -> Any:
    """The key columns of ``table``, dictionary columns decoded (Arrow does not sort tables by them)."""
    import pyarrow.compute as pc
    pa = require_pyarrow()
    by = table.select(list(keys))
    for i, field in enumerate(by.schema):
        if pa.types.is_dictionary(field.type):
            by = by.set_column(i, field.name, pc.cast(by.column(i), field.type.value_type))
    return by
