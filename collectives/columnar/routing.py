"""Which destination each row goes to (hash or key range) and the rows of each destination."""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import numpy as np

from twisternet.arrowcodec import require_pyarrow

from .hashing import fixed_width_bytes, row_hashes
from .sorting import _sortable, sort_by_keys
from .table_input import check_key_columns, to_table


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
        return fixed_width_bytes(arr).view(f"S{t.byte_width}")   # equal-width bytes: numpy's order is memcmp's
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
