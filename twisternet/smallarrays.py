"""Records of lone small numpy arrays without msgpack: the codec's fast path for small messages.

A lone array below the out-of-band threshold is encoded by the general encoder as ``KIND_PLAIN``, then
a msgpack ext whose last bytes are the array's data: for a given dtype and shape everything before the
data is the same. :class:`SmallArrays` remembers that head per (dtype, shape), so encoding such an array
again is a dict look-up and a copy of its bytes, and recognises records of a remembered kind by their
length and head, so decoding one is ``np.frombuffer`` and a copy. The bytes are exactly the general
encoder's (a peer without this path reads them), and decoded arrays are copies, as the general path's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import numpy as np

from .channel import Buffer

#: Kinds (dtype, shape) remembered at most, each way; the tables are emptied when full.
_KINDS = 256
#: Kinds remembered at most for one record length (each costs a comparison when decoding).
_PER_LENGTH = 4


class KindsByLength:
    """Byte strings that hold a small array after a head fixed by its dtype and shape (a lone array's
    record here, an array's extension body in :mod:`twisternet.smallrecords`), remembered by their
    length, so one seen again is read with a comparison and a copy."""

    __slots__ = ("by_len",)

    def __init__(self) -> None:
        #: Length of the string -> [(head, dtype, shape)]: the kinds of that length, in the order
        #: learned (one dict for the object's life: twisternet._smallcodec reads it directly).
        self.by_len: dict[int, list[tuple[bytes, np.dtype, tuple[int, ...]]]] = {}

    def find(self, mv: memoryview) -> np.ndarray | None:
        """A writable copy of the array ``mv`` holds after a remembered head, or None."""
        kinds = self.by_len.get(len(mv))
        if kinds is None:
            return None
        for head, dtype, shape in kinds:
            n = len(head)
            if mv[:n] == head:
                # a copy that owns its memory (no base: collectives.reduction.own keeps it as it is;
                # a view of a fresh bytearray would be copied again there); positional arguments,
                # as keywords cost as much as the copy
                arr: np.ndarray = np.frombuffer(mv, dtype, -1, n)
                out: np.ndarray = (arr if len(shape) == 1 else arr.reshape(shape)).copy()
                return out
        return None

    def add(self, length: int, head: bytes, value: np.ndarray) -> None:
        """Strings of ``length`` bytes starting with ``head`` hold an array of ``value``'s kind."""
        if len(self.by_len) >= _KINDS:
            self.by_len.clear()
        kinds = self.by_len.setdefault(length, [])
        if len(kinds) < _PER_LENGTH and all(h != head for h, _, _ in kinds):
            kinds.append((head, value.dtype, value.shape))


class SmallArrays:
    """Heads of lone small-array records by (dtype, shape), and by record length for decoding."""

    def __init__(self, generic: Callable[[np.ndarray], Sequence[Buffer]], limit: int) -> None:
        self._generic = generic          # the general encoder's record of an array, as parts
        self._limit = limit              # arrays of at least this many bytes are not small
        self._heads: dict[tuple[np.dtype, tuple[int, ...]], bytes | None] = {}
        self._kinds = KindsByLength()

    def head(self, a: np.ndarray) -> bytes | None:
        """The record of ``a`` up to its data (None: not a small lone array this path can take): the
        plain-record byte, then the array's extension value up to its data, as the general encoder
        writes them (an array inside a short tuple is that extension value: twisternet.smallrecords)."""
        key = (a.dtype, a.shape)
        try:
            return self._heads[key]
        except KeyError:
            pass
        head = None
        if a.dtype.names is None and not a.dtype.hasobject:
            record = b"".join(bytes(memoryview(p)) for p in self._generic(a))
            data = a.tobytes()
            if record[:1] == b"\x00" and record.endswith(data):
                head = record[:len(record) - len(data)]
        if len(self._heads) >= _KINDS:
            self._heads.clear()
        self._heads[key] = head
        return head

    def encode(self, a: np.ndarray) -> list[Buffer] | None:
        """The parts of ``a``'s record (its bytes copied), or None if ``a`` is not a small lone array."""
        if a.nbytes >= self._limit or not a.flags.c_contiguous:
            return None
        head = self._heads.get((a.dtype, a.shape))     # (a kind seen before, without head()'s call)
        if head is None:
            head = self.head(a)
        return None if head is None else [head, a.tobytes()]

    @property
    def lengths(self) -> dict[int, list[tuple[bytes, np.dtype, tuple[int, ...]]]]:
        """The remembered kinds by record length (a record of a length not in it is not one of them);
        the same dict for the life of this object."""
        return self._kinds.by_len

    def decode(self, mv: memoryview) -> np.ndarray | None:
        """A copy of the array a remembered kind of record holds, or None if ``mv`` is not one."""
        return self._kinds.find(mv)

    def remember(self, mv: memoryview, value: np.ndarray) -> None:
        """``mv`` decoded (the general way) to ``value``: if it is exactly the record this path makes
        for ``value``, recognise records of its kind from now on."""
        if value.nbytes >= self._limit or not value.flags.c_contiguous:
            return
        head = self.head(value)
        if head is None or len(mv) != len(head) + value.nbytes or mv[:len(head)] != head:
            return
        self._kinds.add(len(mv), head, value)
