"""The sort suite's input and its checks, shared by the twisternet worker and the PySpark and Dask peers.

Terasort-like records of 100 bytes: a 10-byte random key and a 90-byte value (the record's global index
in 20 digits, then 70 filler bytes), generated deterministically per share: share ``rank`` of
``world`` holds records ``[start, start + count)`` with keys from ``numpy.random.default_rng([seed,
rank])``. Every implementation ends each output partition with :func:`summarize` (count, an
order-independent checksum, whether the partition is sorted, its first and last key), and
:func:`verify` checks the partitions together against the input: nothing lost or duplicated (count and
checksum), each partition sorted, partitions in key order (a total order across destinations).

The checksum of a record is ``crc32(key + value)``; their sum over a set of records does not depend on
order. The columnar worker gets the same records as an Arrow table (:func:`generate_table`: ``key``
binary(10), ``value`` binary(90)) and summarizes its sorted batches with :class:`BatchSummary` (numpy
over each batch; only the crc32 of each record is a Python call, as in :func:`summarize`). Dask needs
text keys: :func:`to_text` maps a record to ``latin-1`` strings, which sort exactly like the bytes
(latin-1 maps byte b to code point b) and give the same checksum back.
"""

from __future__ import annotations

import zlib
from typing import Any
from collections.abc import Iterable, Sequence

import numpy as np

KEY_BYTES = 10
VALUE_BYTES = 90
RECORD_BYTES = KEY_BYTES + VALUE_BYTES
_FILL = b"." * (VALUE_BYTES - 20)


def share(rank: int, world: int, total: int) -> tuple[int, int]:
    """``(start, count)`` of share ``rank``: ``total`` records split as evenly as possible."""
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def keys_of(rank: int, world: int, total: int, seed: int = 42) -> bytes:
    """The keys of share ``rank``, concatenated (``KEY_BYTES`` each)."""
    _, count = share(rank, world, total)
    rng = np.random.default_rng([seed, rank])
    return rng.integers(0, 256, size=(count, KEY_BYTES), dtype=np.uint8).tobytes()


def generate(rank: int, world: int, total: int, seed: int = 42) -> list[tuple[bytes, bytes]]:
    """Share ``rank`` of the input as ``(key, value)`` records."""
    start, count = share(rank, world, total)
    kb = keys_of(rank, world, total, seed)
    return [(kb[i * KEY_BYTES:(i + 1) * KEY_BYTES], b"%020d" % (start + i) + _FILL) for i in range(count)]


def to_text(rec: tuple[bytes, bytes]) -> tuple[str, str]:
    """A record as ``latin-1`` strings (for Dask: same order, same checksum via :func:`from_text`)."""
    return rec[0].decode("latin-1"), rec[1].decode("latin-1")


def checksum(records: Iterable[tuple[bytes, bytes]]) -> int:
    """The order-independent checksum of ``records``."""
    crc = zlib.crc32
    return sum(crc(k + v) for k, v in records)


def summarize(records: Iterable[tuple[Any, Any]], text: bool = False) -> dict[str, Any]:
    """One output partition's summary: ``n``, ``crc``, ``sorted``, ``first`` and ``last`` key (hex;
    None when empty). ``text``: the records are :func:`to_text` strings."""
    crc = zlib.crc32
    n = total = 0
    ordered = True
    first = last = None
    for k, v in records:
        if text:
            k, v = k.encode("latin-1"), v.encode("latin-1")
        if last is not None and k < last:
            ordered = False
        if first is None:
            first = k
        last = k
        total += crc(k + v)
        n += 1
    return {"n": n, "crc": total, "sorted": ordered, "first": None if first is None else first.hex(),
            "last": None if last is None else last.hex()}


def expected(world: int, total: int, seed: int = 42) -> dict[str, int]:
    """Count and checksum of the whole input (``world`` shares of ``total`` records)."""
    return {"n": total, "crc": sum(checksum(generate(r, world, total, seed)) for r in range(world))}


def verify(parts: Sequence[dict[str, Any]], want: dict[str, int]) -> None:
    """Raise ValueError unless the partition summaries, in destination order, are the sorted input."""
    n = sum(p["n"] for p in parts)
    if n != want["n"]:
        raise ValueError(f"output has {n} records, the input {want['n']}")
    if sum(p["crc"] for p in parts) != want["crc"]:
        raise ValueError("output checksum differs from the input's: records changed, lost or duplicated")
    bad = [i for i, p in enumerate(parts) if not p["sorted"]]
    if bad:
        raise ValueError(f"output partitions {bad} are not sorted")
    filled = [p for p in parts if p["n"]]
    for a, b in zip(filled, filled[1:]):
        if bytes.fromhex(a["last"]) > bytes.fromhex(b["first"]):
            raise ValueError(f"partition ranges overlap: one ends at {a['last']}, the next starts at {b['first']}")


def generate_table(rank: int, world: int, total: int, seed: int = 42) -> Any:
    """Share ``rank`` of the input (the records of :func:`generate`) as a ``pyarrow.Table`` with columns
    ``key`` (binary(10)) and ``value`` (binary(90)), built with numpy."""
    import pyarrow as pa
    start, count = share(rank, world, total)
    keys = np.frombuffer(keys_of(rank, world, total, seed), dtype=np.uint8)
    values = np.empty((count, VALUE_BYTES), dtype=np.uint8)
    number = np.arange(start, start + count, dtype=np.uint64)
    for d in range(19, -1, -1):          # b"%020d" % index, one digit column at a time
        values[:, d] = (number % 10).astype(np.uint8) + ord("0")
        number //= 10
    values[:, 20:] = np.frombuffer(_FILL, dtype=np.uint8)
    return pa.table({
        "key": pa.FixedSizeBinaryArray.from_buffers(pa.binary(KEY_BYTES), count, [None, pa.py_buffer(keys)]),
        "value": pa.FixedSizeBinaryArray.from_buffers(pa.binary(VALUE_BYTES), count,
                                                      [None, pa.py_buffer(values)]),
    })


def _fixed_bytes(arr: Any) -> np.ndarray:
    """A fixed-size binary Arrow array (no nulls) as a ``(rows, width)`` uint8 array (zero-copy)."""
    width = arr.type.byte_width
    raw = np.frombuffer(arr.buffers()[1], dtype=np.uint8)[arr.offset * width:(arr.offset + len(arr)) * width]
    return raw.reshape(len(arr), width)


class BatchSummary:
    """:func:`summarize` of an output partition read as record batches (``key``, ``value`` columns),
    in order: order and first/last key with numpy, the checksum with one crc32 call per record."""

    def __init__(self) -> None:
        self.n = 0
        self.crc = 0
        self.sorted = True
        self.first: bytes | None = None
        self.last: bytes | None = None

    def add(self, batch: Any) -> None:
        """Summarize the next batch of the partition."""
        rows = batch.num_rows
        if not rows:
            return
        if batch.column(0).null_count or batch.column(1).null_count:
            raise ValueError("the sorted output has null keys or values: the input has none")
        keys = _fixed_bytes(batch.column(0))
        values = _fixed_bytes(batch.column(1))
        hi = np.ascontiguousarray(keys[:, :8]).view(">u8").ravel()      # the key as (8, 2) big-endian bytes
        lo = np.ascontiguousarray(keys[:, 8:]).view(">u2").ravel()
        if rows > 1:
            ok = (hi[1:] > hi[:-1]) | ((hi[1:] == hi[:-1]) & (lo[1:] >= lo[:-1]))
            self.sorted &= bool(ok.all())
        first, last = keys[0].tobytes(), keys[-1].tobytes()
        if self.last is not None and first < self.last:
            self.sorted = False
        if self.first is None:
            self.first = first
        self.last = last
        records = np.hstack([keys, values])          # one 100-byte void item per record: crc32(key + value)
        self.crc += sum(map(zlib.crc32, records.view(f"V{RECORD_BYTES}").ravel().tolist()))
        self.n += rows

    def result(self) -> dict[str, Any]:
        """The partition's summary, as :func:`summarize` gives it."""
        return {"n": self.n, "crc": self.crc, "sorted": self.sorted,
                "first": None if self.first is None else self.first.hex(),
                "last": None if self.last is None else self.last.hex()}


def range_destination(key: bytes, destinations: Sequence[int]) -> int:
    """The range partitioner: keys are uniform, so the first two bytes split them evenly and the
    destinations, in order, hold consecutive key ranges (a total order across destinations)."""
    return destinations[((key[0] << 8) | key[1]) * len(destinations) >> 16]
