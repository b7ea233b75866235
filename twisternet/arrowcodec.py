"""Arrow tables and record batches in the codec: the schema in band, the column buffers out of band.

pyarrow is optional (the ``arrow`` extra): this module imports it only when a table is encoded or
decoded, and :func:`require_pyarrow` turns its absence into an error with the install hint.

Layout of the codec's Arrow extension body (msgpack)::

    [kind, schema, mode, [batch, ...]]

``kind`` is 0 for a ``pyarrow.Table``, 1 for a ``pyarrow.RecordBatch``; ``schema`` is the Arrow IPC
schema message (field names, types, metadata). With ``mode`` ``"flat"`` (every column of a primitive,
boolean, temporal, decimal, null, string/binary of any offset width, fixed-size binary or dictionary of
those types) a batch is ``[num_rows, [column, ...]]`` and a column is
``[length, null_count, offset, [buffer, ...], dictionary-or-None]``. Each buffer is None (absent
validity), an int (the index of an out-of-band part: the sender's Arrow buffer itself, not copied) or
bytes (small buffers, in band). Sliced arrays are trimmed to the bytes their rows use: bitmaps to whole
bytes (the remainder becomes the array offset), fixed-width data to the rows' bytes, var-width data to
the rows' bytes with the offsets rebased (a copy of the offsets alone, only when the slice does not start
at byte 0). Nested or extension types use mode ``"ipc"``: the batches are one buffer holding an Arrow IPC
stream (one copy on send; the receiver still reads it without copying).

On decode every out-of-band buffer is wrapped with ``pyarrow.py_buffer`` over the received memory: the
table is a view of the record (see :func:`own_arrow` for keeping it past the record's life).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import numpy as np

from .errors import ArrowUnavailableError, CodecError

INSTALL_HINT = "pip install 'twisternet[arrow]'"

KIND_TABLE = 0
KIND_BATCH = 1

_pa: Any = None


def require_pyarrow() -> Any:
    """The ``pyarrow`` module, or :class:`ArrowUnavailableError` saying how to install it."""
    global _pa
    if _pa is None:
        try:
            import pyarrow
        except ImportError as e:
            raise ArrowUnavailableError(f"this needs pyarrow, which is not installed: {INSTALL_HINT}") from e
        _pa = pyarrow
    return _pa


def is_arrow_data(obj: Any) -> bool:
    """Whether ``obj`` is a ``pyarrow.Table`` or ``pyarrow.RecordBatch`` (without importing pyarrow)."""
    t = type(obj)
    return t.__module__ == "pyarrow.lib" and t.__name__ in ("Table", "RecordBatch")


def _flat_type(pa: Any, t: Any) -> bool:
    if isinstance(t, pa.BaseExtensionType):
        return False
    if pa.types.is_dictionary(t):
        return _flat_type(pa, t.value_type) and not pa.types.is_dictionary(t.value_type)
    if (pa.types.is_string(t) or pa.types.is_binary(t) or pa.types.is_large_string(t)
            or pa.types.is_large_binary(t) or pa.types.is_null(t) or pa.types.is_fixed_size_binary(t)):
        return True
    if pa.types.is_nested(t):
        return False
    try:
        flat: bool = t.bit_width > 0 and t.num_buffers == 2
        return flat
    except ValueError:
        return False


def _var_offsets_dtype(pa: Any, t: Any) -> Any:
    if pa.types.is_string(t) or pa.types.is_binary(t):
        return np.int32
    if pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        return np.int64
    return None


def _bitmap(buf: Any, offset: int, length: int) -> Any:
    if buf is None:
        return None
    lo = offset // 8
    hi = (offset + length + 7) // 8
    return buf.slice(lo, hi - lo)


def _encode_array(pa: Any, arr: Any, put: Callable[[Any], Any]) -> list[Any]:
    t = arr.type
    n, off = len(arr), arr.offset
    if pa.types.is_null(t):
        return [n, n, 0, [None], None]
    if pa.types.is_dictionary(t):
        indices = arr.indices
        desc = _encode_array(pa, indices, put)
        desc[4] = _encode_array(pa, arr.dictionary, put)
        return desc
    bufs = arr.buffers()
    r = off % 8
    start = off - r
    nulls = arr.null_count
    validity = _bitmap(bufs[0], off, n) if nulls else None
    odt = _var_offsets_dtype(pa, t)
    if odt is not None:
        obuf, dbuf = bufs[1], bufs[2]
        if obuf is None or n + r == 0:
            offsets = np.zeros(1, dtype=odt)
            out = [put(validity), put(pa.py_buffer(offsets)), put(pa.py_buffer(b""))]
            return [n, nulls, r, out, None]
        offs = np.frombuffer(obuf, dtype=odt)[start:off + n + 1]
        first, last = int(offs[0]), int(offs[-1])
        if first:
            offsets_buf = pa.py_buffer(offs - odt(first))
        else:
            offsets_buf = obuf.slice(start * offs.itemsize, offs.nbytes)
        data = dbuf.slice(first, last - first) if dbuf is not None else pa.py_buffer(b"")
        return [n, nulls, r, [put(validity), put(offsets_buf), put(data)], None]
    if pa.types.is_fixed_size_binary(t):
        width = t.byte_width
    else:
        width = t.bit_width
        if width % 8 and width != 1:
            raise CodecError(f"cannot encode Arrow type {t} (bit width {width})")
        width = 0 if width == 1 else width // 8
    dbuf = bufs[1]
    if dbuf is None:
        data = None
    elif width == 0:            # booleans: a bitmap
        data = _bitmap(dbuf, off, n)
    else:
        data = dbuf.slice(start * width, (r + n) * width)
    return [n, nulls, r, [put(validity), put(data)], None]


def encode(obj: Any, put: Callable[[Any], Any]) -> list[Any]:
    """The extension body of a Table or RecordBatch; ``put(pyarrow.Buffer | None)`` returns the
    buffer's reference (None, an out-of-band index, or the bytes in band)."""
    pa = require_pyarrow()
    kind = KIND_TABLE if isinstance(obj, pa.Table) else KIND_BATCH
    schema = obj.schema
    batches = obj.to_batches() if kind == KIND_TABLE else [obj]
    if all(_flat_type(pa, f.type) for f in schema):
        descs = [[b.num_rows, [_encode_array(pa, c, put) for c in b.columns]] for b in batches]
        mode = "flat"
    else:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as w:
            for b in batches:
                w.write_batch(b)
        descs = put(sink.getvalue())
        mode = "ipc"
    return [kind, schema.serialize().to_pybytes(), mode, descs]


def _decode_array(pa: Any, t: Any, desc: list[Any], get: Callable[[Any], Any]) -> Any:
    n, nulls, off, refs, dict_desc = desc
    bufs = [get(x) for x in refs]
    if pa.types.is_dictionary(t):
        indices = pa.Array.from_buffers(t.index_type, n, bufs, null_count=nulls, offset=off)
        dictionary = _decode_array(pa, t.value_type, dict_desc, get)
        return pa.DictionaryArray.from_arrays(indices, dictionary, ordered=t.ordered, safe=False)
    return pa.Array.from_buffers(t, n, bufs, null_count=nulls, offset=off)


def decode(body: Any, get: Callable[[Any], Any]) -> Any:
    """The Table or RecordBatch of an extension body; ``get(reference)`` returns a ``pyarrow.Buffer``."""
    pa = require_pyarrow()
    try:
        kind, schema_bytes, mode, descs = body
        schema = pa.ipc.read_schema(pa.py_buffer(schema_bytes))
        if mode == "flat":
            batches = [pa.RecordBatch.from_arrays(
                [_decode_array(pa, f.type, d, get) for f, d in zip(schema, cols)], schema=schema)
                for rows, cols in descs]
        elif mode == "ipc":
            batches = list(pa.ipc.open_stream(get(descs)))
        else:
            raise CodecError(f"unknown Arrow record mode {mode!r}")
    except CodecError:
        raise
    except (ValueError, TypeError, IndexError, pa.ArrowException) as e:
        raise CodecError(f"corrupt Arrow record: {e}") from e
    if kind == KIND_BATCH:
        if len(batches) != 1:
            raise CodecError(f"Arrow record batch record holds {len(batches)} batches")
        return batches[0]
    return pa.Table.from_batches(batches, schema=schema)


def own_arrow(obj: Any) -> Any:
    """A copy of Table/RecordBatch ``obj`` in memory of its own, for values that must outlive the
    receive buffer they were decoded from: written once as an Arrow IPC stream into a buffer of the exact
    size (measured first without copying), then read back without copying."""
    pa = require_pyarrow()

    def write(sink: Any) -> None:
        with pa.ipc.new_stream(sink, obj.schema) as w:
            if isinstance(obj, pa.Table):
                w.write_table(obj)
            else:
                w.write_batch(obj)
    mock = pa.MockOutputStream()
    write(mock)
    buf = pa.allocate_buffer(mock.size())
    write(pa.FixedSizeBufferWriter(buf))
    reader = pa.ipc.open_stream(buf)
    return reader.read_all() if isinstance(obj, pa.Table) else reader.read_next_batch()
