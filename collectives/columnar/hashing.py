"""The stable 64-bit row hash of key columns that routes keyed rows (defined in the package docstring)."""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import numpy as np

from twisternet.arrowcodec import require_pyarrow
from twisternet.errors import TableSchemaError

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CANON_NAN = np.uint64(0x7FF8000000000000)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)


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
        data = fixed_width_bytes(arr)
        return _hash_words(data, np.arange(n, dtype=np.int64) * width, np.full(n, width, dtype=np.int64))
    raise TableSchemaError(f"key columns of type {t} are not supported (use integer, floating, boolean, "
                           f"temporal, string, binary, fixed-size binary, decimal or dictionary columns)")


def fixed_width_bytes(arr: Any) -> np.ndarray:
    """The values of a fixed-width Arrow array (fixed-size binary, decimal) as one flat uint8 array,
    ``len(arr) * byte_width`` bytes, zero-copy (zeros where the array has no value buffer)."""
    width, n = arr.type.byte_width, len(arr)
    buf = arr.buffers()[1]
    if buf is None:
        return np.zeros(n * width, np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)[arr.offset * width:(arr.offset + n) * width]


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
