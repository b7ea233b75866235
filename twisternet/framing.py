"""Buffer pool and framing: records packed into fixed-size buffers and reassembled by length.

A *record* is the codec's bytes for one value. The :class:`Packer` writes records into buffers of
exactly ``buffer_size`` bytes taken from a :class:`BufferPool`, each record preceded by its u64 length;
a record that does not fit the space left continues in the next buffer(s), so records of any size
travel through buffers of any size >= 8. The :class:`Unpacker` consumes the buffers in order and yields
whole records, using the lengths alone to find record boundaries. The pool bounds how many buffers a
process holds for packing: when it is empty, packing waits (back pressure) instead of allocating more.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator, Sequence

from .channel import Buffer
from .errors import ProtocolError

_U64 = struct.Struct("<Q")
LENGTH_HEADER = _U64.size
#: Largest record the framing accepts (the u64 length leaves room for far more; this guards against
#: corrupt lengths allocating absurd memory).
MAX_RECORD = 1 << 48


class BufferPool:
    """A fixed number of ``buffer_size``-byte buffers; ``acquire`` waits or fails when all are out."""

    def __init__(self, buffer_size: int, count: int) -> None:
        if buffer_size < LENGTH_HEADER:
            raise ValueError(f"buffer_size must be >= {LENGTH_HEADER}, got {buffer_size}")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.buffer_size = buffer_size
        self.count = count
        self._free: list[bytearray] = []
        self._created = 0
        self._cond = threading.Condition()

    @property
    def available(self) -> int:
        """Buffers that ``acquire`` could hand out now without waiting."""
        with self._cond:
            return len(self._free) + self.count - self._created

    def try_acquire(self) -> bytearray | None:
        """A free buffer, or None when every buffer is in use."""
        with self._cond:
            if self._free:
                return self._free.pop()
            if self._created < self.count:
                self._created += 1
                return bytearray(self.buffer_size)
            return None

    def acquire(self, timeout: float | None = None) -> bytearray | None:
        """A free buffer, waiting up to ``timeout`` seconds; None if none came free in time."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._free or self._created < self.count, timeout)
            if not ok:
                return None
            if self._free:
                return self._free.pop()
            self._created += 1
            return bytearray(self.buffer_size)

    def release(self, buf: bytearray) -> None:
        """Give ``buf`` back; it must have come from this pool."""
        if len(buf) != self.buffer_size:
            raise ValueError("buffer does not belong to this pool")
        with self._cond:
            if len(self._free) + 1 > self._created:
                raise ValueError("more buffers released than acquired")
            self._free.append(buf)
            self._cond.notify()


class Packer:
    """Packs records into pool buffers. Not thread-safe: one Packer per (peer, edge) stream, used under
    the caller's lock.

    ``add`` returns the buffers it filled completely; ``flush`` returns the partly filled one (as a
    memoryview of its used bytes). A buffer is handed out once and must be given back to the pool by
    whoever sends it, after sending.
    """

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self._buf: bytearray | None = None
        #: Bytes in the partly filled buffer (read-only outside the class; an attribute, since every
        #: send looks at it).
        self.pending_bytes = 0

    def space_needed(self, record_len: int) -> int:
        """How many new buffers ``add`` of a record of ``record_len`` bytes would take from the pool."""
        size = self.pool.buffer_size
        total = self.pending_bytes + LENGTH_HEADER + record_len
        have = 1 if self._buf is not None else 0
        return max(0, -(-total // size) - have)

    def add(self, parts: Sequence[Buffer]) -> list[bytearray]:
        """Append one record (the concatenation of ``parts``); returns buffers that became full.

        The caller must ensure the pool can supply ``space_needed`` buffers (else ProtocolError-free
        RuntimeError is raised before anything is written).
        """
        buf = self._buf
        if buf is not None:
            # fast path: the record fits in the current buffer
            n = 0
            for p in parts:
                n += len(p) if type(p) is bytes else memoryview(p).nbytes
            used = self.pending_bytes
            end = used + LENGTH_HEADER + n
            if end < len(buf):
                _U64.pack_into(buf, used, n)
                pos = used + LENGTH_HEADER
                for p in parts:
                    k = len(p) if type(p) is bytes else memoryview(p).nbytes
                    buf[pos:pos + k] = p if type(p) is bytes else memoryview(p).cast("B")
                    pos += k
                self.pending_bytes = end
                return []
        views = [memoryview(p).cast("B") if memoryview(p).format != "B" or memoryview(p).ndim != 1
                 else memoryview(p) for p in parts]
        n = sum(v.nbytes for v in views)
        need = self.space_needed(n)
        got: list[bytearray] = []
        for _ in range(need):
            b = self.pool.try_acquire()
            if b is None:
                for g in got:
                    self.pool.release(g)
                raise RuntimeError("buffer pool exhausted; check space_needed() first")
            got.append(b)
        fresh = iter(got)
        full: list[bytearray] = []

        def write(src: memoryview) -> None:
            pos = 0
            while pos < len(src):
                if self._buf is None:
                    self._buf = next(fresh)
                    self.pending_bytes = 0
                k = min(len(src) - pos, len(self._buf) - self.pending_bytes)
                self._buf[self.pending_bytes:self.pending_bytes + k] = src[pos:pos + k]
                self.pending_bytes += k
                pos += k
                if self.pending_bytes == len(self._buf):
                    full.append(self._buf)
                    self._buf = None
                    self.pending_bytes = 0

        write(memoryview(_U64.pack(n)))
        for v in views:
            write(v)
        return full

    def flush(self) -> tuple[bytearray, memoryview] | None:
        """The partly filled buffer and a view of its used bytes, or None if there is none."""
        if self._buf is None or self.pending_bytes == 0:
            return None
        buf, used = self._buf, self.pending_bytes
        self._buf, self.pending_bytes = None, 0
        return buf, memoryview(buf)[:used]

    def discard(self) -> None:
        """Return the partly filled buffer to the pool (on close)."""
        if self._buf is not None:
            self.pool.release(self._buf)
            self._buf, self.pending_bytes = None, 0


class Unpacker:
    """Reassembles records from buffers produced by a :class:`Packer`, in order, by length alone.

    Records that lie wholly inside one fed buffer are returned as zero-copy memoryviews of it; a record
    spanning buffers is assembled into a fresh bytearray.
    """

    def __init__(self, max_record: int = MAX_RECORD) -> None:
        self.max_record = max_record
        self._head = bytearray()        # partial length header
        self._rec: bytearray | None = None
        self._rec_pos = 0

    @property
    def partial(self) -> bool:
        """Whether a record is half received (more buffers are needed to finish it)."""
        return bool(self._head) or self._rec is not None

    def feed(self, data: Buffer) -> list[memoryview]:
        """Consume one buffer's bytes; return the records it completed."""
        mv = memoryview(data).cast("B") if memoryview(data).format != "B" else memoryview(data)
        out: list[memoryview] = []
        pos, end = 0, len(mv)
        while pos < end:
            if self._rec is not None:
                k = min(end - pos, len(self._rec) - self._rec_pos)
                self._rec[self._rec_pos:self._rec_pos + k] = mv[pos:pos + k]
                self._rec_pos += k
                pos += k
                if self._rec_pos == len(self._rec):
                    out.append(memoryview(self._rec))
                    self._rec = None
                continue
            if self._head or end - pos < LENGTH_HEADER:
                k = min(LENGTH_HEADER - len(self._head), end - pos)
                self._head += mv[pos:pos + k]
                pos += k
                if len(self._head) < LENGTH_HEADER:
                    break
                (n,) = _U64.unpack(self._head)
                self._head = bytearray()
            else:
                (n,) = _U64.unpack_from(mv, pos)
                pos += LENGTH_HEADER
            if n > self.max_record:
                raise ProtocolError(f"record length {n} exceeds the limit {self.max_record}")
            if end - pos >= n:
                out.append(mv[pos:pos + n])
                pos += n
            else:
                self._rec = bytearray(n)
                self._rec_pos = 0
        return out

    def records(self, buffers: Sequence[Buffer]) -> Iterator[memoryview]:
        """All records completed by ``buffers``, in order."""
        for b in buffers:
            yield from self.feed(b)
