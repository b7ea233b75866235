"""Bounded-memory record store for batch operations: sorted runs spilled to disk, merged back k-way.

A :class:`SpillStore` holds ``(sort_key, value)`` records. While their estimated size stays under the
memory bound they live in a list; past it the list is sorted (stably) and written as a *run* file, and
reading merges the runs and the in-memory tail with :func:`heapq.merge`, which is stable across runs, so
records with equal keys come out in the order they were added. Run files are a sequence of blocks, each
``u64 length | u32 crc32 | pickle(list of records)``; a checksum mismatch or a truncated block raises
:class:`SpillCorruptionError`. Files live in a private directory under ``spill_dir`` that is removed by
:meth:`SpillStore.close` (and, as a last resort, when the store is garbage collected). Its name,
``twisternet-spill-<pid>-<tag>-<random>``, names the owner, so the directory of a killed process is removed
by the next Context started with the same ``spill_dir`` (:mod:`twisternet.leftovers`).
"""

from __future__ import annotations

import errno
import heapq
import io
import logging
import os
import pickle
import shutil
import struct
import sys
import tempfile
import weakref
import zlib
from itertools import chain, islice
from operator import itemgetter
from typing import Any, BinaryIO
from collections.abc import Iterable, Iterator

import numpy as np

from twisternet.errors import CodecError, TwisternetError
from twisternet.leftovers import spill_base, spill_dir_prefix

log = logging.getLogger(__name__)

_MAGIC = b"TNSPILL1"
_BLOCK_HEAD = struct.Struct("<QI")
_first = itemgetter(0)
_second = itemgetter(1)
_NO_KEY = object()


class SpillCorruptionError(TwisternetError):
    """A spill file does not read back as written (checksum mismatch, truncation, bad header)."""


class SpillWriteError(TwisternetError, OSError):
    """A spill file or directory could not be written (no space left, quota, permissions); the message
    names the directory, and ``errno`` / ``strerror`` are the operating system's."""


_SAMPLED = (dict, list, tuple)


def estimate_size(obj: Any, _depth: int = 0) -> int:
    """A cheap estimate of the memory ``obj`` holds, in bytes (used for the spill bound)."""
    t = type(obj)
    if t is bytes or t is str or t is bytearray:
        return len(obj) + 49
    if t is int or t is float or t is bool or obj is None:
        return 28
    if t is tuple or t is list:
        n = 56 + 8 * len(obj)
        if _depth < 4:
            if len(obj) > 64:  # sample large containers
                step = len(obj) // 32
                for o in obj[::step]:
                    n += estimate_size(o, _depth + 1) * step
            else:
                for o in obj:
                    n += estimate_size(o, _depth + 1)
        return n
    if t is dict:
        n = sys.getsizeof(obj)
        if _depth < 4 and len(obj) <= 64:
            for k, v in obj.items():
                n += estimate_size(k, _depth + 1) + estimate_size(v, _depth + 1)
        return n
    if isinstance(obj, np.ndarray):
        return obj.nbytes + 112
    if isinstance(obj, (bytes, bytearray, str)):
        return len(obj) + 49
    if isinstance(obj, (int, float, bool)):
        return 28
    if isinstance(obj, (tuple, list, dict)):   # subclasses: as their base type
        return estimate_size(dict(obj) if isinstance(obj, dict) else list(obj), _depth)
    return sys.getsizeof(obj)


def _dump(records: list) -> bytes:
    # Without the memo ("fast" mode) pickling a block of distinct small records is ~10x faster (the memo
    # costs a dict entry per object); shared references are then written once per use, and a record
    # that refers to itself, which fast mode cannot write, falls back to the usual pickler.
    try:
        try:
            f = io.BytesIO()
            p = pickle.Pickler(f, protocol=5)
            p.fast = True
            p.dump(records)
            return f.getvalue()
        except (RecursionError, ValueError):   # "fast mode: can't pickle cyclic objects"
            return pickle.dumps(records, protocol=5)
    except (pickle.PicklingError, AttributeError, TypeError):
        import cloudpickle
        try:
            return cloudpickle.dumps(records, protocol=5)
        except Exception as e:  # whatever pickling raises, the record cannot be stored
            raise CodecError(f"cannot write a record to a spill file: {e}") from e


class _RunWriter:
    """Writes one run file: the magic, then blocks of records."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.f: BinaryIO = open(path, "wb")
        self.f.write(_MAGIC)

    def write_block(self, block: list) -> None:
        if block:
            data = _dump(block)
            self.f.write(_BLOCK_HEAD.pack(len(data), zlib.crc32(data)))
            self.f.write(data)

    def close(self) -> None:
        self.f.close()


def _blocks(path: str) -> Iterator[list]:
    """The decoded blocks of one run file, in order; raises SpillCorruptionError on any damage."""
    with open(path, "rb") as f:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise SpillCorruptionError(f"spill file {path}: bad header (not a twisternet spill run)")
        index = 0
        while True:
            head = f.read(_BLOCK_HEAD.size)
            if not head:
                return
            if len(head) != _BLOCK_HEAD.size:
                raise SpillCorruptionError(f"spill file {path}: truncated block header at block {index}")
            n, crc = _BLOCK_HEAD.unpack(head)
            data = f.read(n)
            if len(data) != n:
                raise SpillCorruptionError(f"spill file {path}: block {index} truncated ({len(data)} of {n} bytes)")
            if zlib.crc32(data) != crc:
                raise SpillCorruptionError(f"spill file {path}: checksum mismatch in block {index}")
            try:
                block = pickle.loads(data)
            except Exception as e:  # any failure here means a damaged file
                raise SpillCorruptionError(f"spill file {path}: block {index} does not decode: {e}") from e
            yield block
            index += 1


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def read_run(path: str) -> Iterator[tuple]:
    """Records of one run file, in order (block by block, each record handed out by C-level iteration);
    raises SpillCorruptionError on any damage."""
    return chain.from_iterable(_blocks(path))


class SpillStore:
    """Records ``(sort_key, value)`` kept under ``memory_limit`` bytes, spilling sorted runs past it.

    With ``sort=True`` iteration yields records ordered by ``sort_key`` (stable: equal keys in insertion
    order); with ``sort=False`` in insertion order. Keys must be mutually orderable when sorting.

    With ``chunked=True`` the store keeps *chunks* ``(sort_key, [value, ...])`` (added with
    :meth:`add_chunk`, or grown one value at a time by :meth:`add`) and sorts, spills and merges whole
    chunks: the per-record work of a batch of records under one key (Gather's records of one source) is
    then one list, not one tuple per record. Iteration still yields ``(sort_key, value)`` records;
    :meth:`values` yields the values alone without building those tuples.
    """

    #: Chunked stores grow a chunk by :meth:`add` up to this many values before starting a new one.
    chunk_values = 4096

    def __init__(self, memory_limit: int, spill_dir: str | None = None, *, sort: bool = True,
                 name: str = "store", chunked: bool = False) -> None:
        if memory_limit < 1:
            raise ValueError(f"memory_limit must be >= 1, got {memory_limit}")
        self.memory_limit = memory_limit
        self.spill_dir = spill_dir
        self.sort = sort
        self.name = name
        self.block_bytes = max(4096, memory_limit // 64)
        #: Runs merged at once; more runs are first merged in passes (bounds merge memory).
        self.fan_in = max(2, min(64, memory_limit // (2 * self.block_bytes)))
        self._mem: list[tuple] = []
        self._mem_bytes = 0
        self._runs: list[str] = []
        self._next_run = 0
        self._dir: str | None = None
        self._finalizer: weakref.finalize | None = None
        self._closed = False
        self._sorted = True
        self.count = 0
        self.spilled_bytes = 0
        self._est_n = 0      # records whose size was estimated, and the sum of those estimates
        self._est_sum = 0
        self.chunked = chunked
        self._open: list | None = None   # chunked: the chunk add() appends to (None after a sort/spill)
        self._open_key: Any = None

    # ------------------------------------------------------------------ writing
    def add(self, key: Any, value: Any) -> None:
        """Add one record."""
        self._check_open()
        if self.chunked:
            chunk = self._open
            if chunk is not None and len(chunk) < self.chunk_values and self._open_key == key:
                chunk.append(value)
                self.count += 1
                self._took(0, self._sampled_size(value, self._est_n, extra=8))
                return
            self.add_chunk(key, [value])
            return
        self._mem.append((key, value))
        self._took(1, self._sampled_size(value, self.count, key=key, extra=72))

    def add_many(self, records: list) -> None:
        """Add ``(key, value)`` records (a plain store only), their size estimated from a sample; the
        same as :meth:`add` for each, spilling at the same bound."""
        self._check_open()
        if self.chunked:
            raise TwisternetError(f"{self.name}: add_many() is for stores made with chunked=False")
        n = len(records)
        if not n:
            return
        step = max(1, n // 16)
        sample = records[::step]
        per = max(1, sum(estimate_size(v) + estimate_size(k) + 72 for k, v in sample) // len(sample))
        self._est_n += 1
        self._est_sum += per
        start = 0
        while start < n:
            room = max(1, (self.memory_limit - self._mem_bytes) // per + 1)
            part = records[start:start + room] if start or room < n else records
            start += len(part)
            self._mem.extend(part)
            self._took(len(part), per * len(part))

    def add_chunk(self, key: Any, values: list) -> None:
        """Add the records ``(key, v)`` for every ``v`` of ``values`` (a chunked store only). The store
        takes ``values`` over: the caller must not change that list afterwards."""
        self._check_open()
        if not self.chunked:
            raise TwisternetError(f"{self.name}: add_chunk() needs a store made with chunked=True")
        if type(values) is not list:
            values = list(values)
        if not values:
            return
        self._mem.append((key, values))
        self._open, self._open_key = values, key
        size = estimate_size(values) + estimate_size(key) + 72
        self._est_n += 1
        self._est_sum += size // len(values)
        self._took(len(values), size)

    def _check_open(self) -> None:
        if self._closed:
            raise TwisternetError(f"{self.name}: store already closed")

    def _sampled_size(self, value: Any, seen: int, *, key: Any = _NO_KEY, extra: int = 0) -> int:
        """The estimated size of a record holding ``value`` (and ``key``, plus ``extra`` bytes). Walking
        every small container costs more than storing it: the first records (``seen`` < 64), every 8th
        one and anything that is not a dict/list/tuple (arrays, strings: exact and cheap) are measured,
        the other containers are charged the running mean of the measured records."""
        if seen < 64 or not self.count & 7 or type(value) not in _SAMPLED:
            size = estimate_size(value) + extra + (0 if key is _NO_KEY else estimate_size(key))
            self._est_n += 1
            self._est_sum += size
            return size
        return self._est_sum // self._est_n

    def _took(self, n: int, size: int) -> None:
        """Account ``n`` new records (or values grown into an open chunk: n=0) of ``size`` bytes, and
        spill past the bound."""
        self._mem_bytes += size
        self.count += n
        if n:
            self._sorted = False
        if self._mem_bytes > self.memory_limit:
            self._spill()

    @property
    def runs(self) -> int:
        """Number of run files on disk."""
        return len(self._runs)

    @property
    def directory(self) -> str | None:
        """The private spill directory (None until the first spill)."""
        return self._dir

    def _new_path(self) -> str:
        if self._dir is None:
            base = spill_base(self.spill_dir)
            try:
                os.makedirs(base, exist_ok=True)
                self._dir = tempfile.mkdtemp(prefix=spill_dir_prefix(), dir=base)
            except OSError as e:
                raise self._write_error(e, base) from e
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._next_run += 1
        return os.path.join(self._dir, f"run-{self._next_run:06d}.bin")

    def _write_error(self, e: OSError, where: str) -> SpillWriteError:
        """``e`` (raised writing under ``where``) as an error that names the directory and what to do."""
        hint = ""
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            hint = ("; free space there, point config spill_dir at a larger filesystem, or raise "
                    f"memory_limit (now {self.memory_limit} bytes for this store)")
        return SpillWriteError(e.errno or 0, f"{self.name}: cannot write spill files in {where}: "
                                             f"{e.strerror or e}{hint}")

    def _sort_mem(self) -> None:
        self._open = None
        if self.sort and not self._sorted:
            try:
                self._mem.sort(key=_first)
            except TypeError as e:
                raise TypeError(f"{self.name}: keys are not mutually orderable ({e}); sorted batch "
                                "results need comparable keys of one type") from None
        self._sorted = True

    def _write_run(self, records: Iterable[tuple]) -> str:
        """Write ``records`` as a new run file, in blocks of about ``block_bytes`` (the records per block
        set from the sampled size of the first ones)."""
        path = self._new_path()
        try:
            w = _RunWriter(path)
            it = iter(records)
            try:
                block = list(islice(it, 64))
                if block:
                    sample = block[::max(1, len(block) // 16)]
                    per = sum(estimate_size(r[1]) + 72 for r in sample) // len(sample)
                    count = max(1, self.block_bytes // max(1, per))
                    block += islice(it, max(0, count - len(block)))
                    while block:
                        w.write_block(block)
                        block = list(islice(it, count))
            finally:
                w.close()
        except BaseException as e:
            _remove(path)                    # a partial run is of no use, and takes the space
            if isinstance(e, OSError) and not isinstance(e, TwisternetError):
                raise self._write_error(e, self._dir or os.path.dirname(path)) from e
            if isinstance(e, CodecError):
                raise CodecError(f"{self.name}: {e}") from e
            raise
        self.spilled_bytes += os.path.getsize(path)
        return path

    def _spill(self) -> None:
        self._sort_mem()
        path = self._write_run(self._mem)
        log.debug("%s: spilled %d records (%d bytes estimated) to %s", self.name, len(self._mem),
                  self._mem_bytes, path)
        self._runs.append(path)
        self._mem = []
        self._mem_bytes = 0

    def _merge(self, sources: list[Iterator[tuple]]) -> Iterator[tuple]:
        if not self.sort:
            for s in sources:
                yield from s
            return
        try:
            yield from heapq.merge(*sources, key=_first)
        except TypeError as e:
            raise TypeError(f"{self.name}: keys are not mutually orderable ({e})") from None

    def _compact(self) -> None:
        """Merge runs in passes until at most ``fan_in`` remain (bounded memory for the final merge)."""
        while self.sort and len(self._runs) > self.fan_in:
            group, self._runs = self._runs[:self.fan_in], self._runs[self.fan_in:]
            merged = self._write_run(self._merge([read_run(p) for p in group]))
            for p in group:
                os.unlink(p)
            self._runs.insert(0, merged)  # earliest records first: keeps equal keys in insertion order

    # ------------------------------------------------------------------ reading
    def _entries(self) -> Iterator[tuple]:
        """The stored entries in order: records, or ``(key, chunk)`` in a chunked store."""
        self._check_open()
        self._sort_mem()
        if not self._runs:
            return iter(list(self._mem))
        if not self.sort:
            return self._merge([read_run(p) for p in self._runs] + [iter(list(self._mem))])
        self._compact()
        return self._merge([read_run(p) for p in self._runs] + [iter(list(self._mem))])

    def __iter__(self) -> Iterator[tuple]:
        """All records, ordered (see class doc). May be iterated more than once until :meth:`close`."""
        entries = self._entries()
        if not self.chunked:
            return entries
        return ((k, v) for k, chunk in entries for v in chunk)

    def values(self) -> Iterator[Any]:
        """The values of all records, in the order of iteration (no ``(key, value)`` tuples built)."""
        entries = self._entries()
        if not self.chunked:
            return map(_second, entries)
        return chain.from_iterable(map(_second, entries))

    def __len__(self) -> int:
        return self.count

    def close(self) -> None:
        """Drop the records and remove every spill file (idempotent)."""
        self._closed = True
        self._mem = []
        self._open = None
        if self._finalizer is not None:
            self._finalizer()
        self._runs = []
