"""Short tuples of scalars and small arrays without the encoder's callbacks: the codec's fast path for
the collectives' protocol records.

Collective operations send tuples such as ``("d", call, step, 0, array, {descriptor: [ranks]})``: a few
scalars, small numpy arrays, small dicts and lists of scalars. The general encoder packs such a tuple
through msgpack's ``default`` callback (the tuple, then each array, each on its own nested Packer);
:class:`SmallRecords` writes the same bytes directly: the tuple's extension header, the list header, each
scalar, dict or list packed natively, and each small array as a head remembered per dtype and shape
followed by its bytes. Anything else in the tuple (a nested tuple, a large array, bytes that travel out
of band, an object) makes it decline, and the general encoder takes the record.

Decoding an array inside such a record, the extension body ``[dtype, shape, bytes]`` has the same bytes
before the data for a given dtype and shape: :class:`ArrayBodies` remembers them, so the decoder reads
such an array with a comparison and one copy instead of a nested msgpack call and a dtype parse.

Both directions have a compiled form, ``twisternet._smallcodec`` (built by ``setup.py`` when a C compiler
is there; see :data:`COMPILED`): :meth:`SmallRecords.encode` writes the whole record in one C call, and
:func:`decode_plain` reads a plain record of such values without msgpack's callbacks into Python. The
Python code here is the reference: both give the same bytes and the same values
(``tests/twisternet/test_smallcodec.py``), and the environment variable ``TWISTERNET_SMALLCODEC=python``
keeps the compiled form out.
"""

from __future__ import annotations

import importlib
import os
import struct
import threading
from typing import Any
from collections.abc import Callable

import msgpack
import numpy as np

from .channel import Buffer
from .smallarrays import KindsByLength, SmallArrays

#: Items of a tuple this path takes at most (msgpack's fixarray).
_MAX_ITEMS = 15
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
#: msgpack's fixext markers, by payload length.
_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}


def _compiled() -> Any:
    """The compiled form, unless it is not built or ``TWISTERNET_SMALLCODEC=python`` asks for the reference."""
    if os.environ.get("TWISTERNET_SMALLCODEC", "auto").strip().lower() == "python":
        return None
    try:
        return importlib.import_module("twisternet._smallcodec")
    except ImportError:
        return None


_C = _compiled()
#: Whether the compiled form (``twisternet._smallcodec``) is in use.
COMPILED = _C is not None
#: What :func:`decode_plain` returns for a record it leaves to the general decoder.
DECLINE: Any = _C.DECLINE if _C is not None else object()


def _declined(record: Any, tuple_code: int, ndarray_code: int, kinds: Any, empty: Any) -> Any:
    return DECLINE


#: ``PLAIN_DECODE(record, tuple_code, ndarray_code, bodies.table, numpy.empty)``: what
#: :func:`decode_plain` does, for a hot caller that holds ``bodies.table`` (one Python call fewer
#: per record): the compiled decoder, or one that declines every record when it is not built.
PLAIN_DECODE: Callable[..., Any] = _C.decode if _C is not None else _declined
#: The compiled short-tuple encoder (what :meth:`SmallRecords.encode` calls), or None.
COMPILED_ENCODE: Callable[..., Any] | None = _C.encode if _C is not None else None


def ext_header(code: int, length: int) -> bytes:
    """The bytes msgpack writes before the ``length``-byte payload of extension type ``code``."""
    fix = _FIXEXT.get(length)
    if fix is not None:
        return bytes((fix, code))
    if length < 0x100:
        return bytes((0xC7, length, code))
    if length < 0x10000:
        return b"\xc8" + _U16.pack(length) + bytes((code,))
    return b"\xc9" + _U32.pack(length) + bytes((code,))


class SmallRecords:
    """Encoder of short tuples (see the module doc). ``tuple_code``: the codec's extension type of a
    tuple; ``arrays``: the codec's lone-array path, whose record heads (per dtype and shape) are a plain
    record's first byte and then the array's extension value up to its data, which is what an array
    inside a tuple is; arrays and bytes of at least ``limit`` bytes decline."""

    def __init__(self, tuple_code: int, arrays: SmallArrays, limit: int) -> None:
        self._tuple_code = tuple_code
        self._arrays = arrays
        self._limit = limit
        self._local = threading.local()     # one plain Packer per thread (a Packer is not thread-safe)

    def encode(self, t: tuple[Any, ...]) -> list[Buffer] | None:
        """The parts of the plain record of ``t`` (a copy of every value), or None to decline."""
        if COMPILED_ENCODE is not None:
            rec = COMPILED_ENCODE(t, np.ndarray, self._arrays.head, self._limit, self._tuple_code)
            return None if rec is None else [rec]
        return self.encode_py(t)

    def encode_py(self, t: tuple[Any, ...]) -> list[Buffer] | None:
        """:meth:`encode` in Python (the reference of the compiled form)."""
        n = len(t)
        if n > _MAX_ITEMS:
            return None
        items: list[bytes] = [bytes((0x90 | n,))]
        size = 1
        limit = self._limit
        packer = getattr(self._local, "packer", None)
        if packer is None:
            packer = self._local.packer = msgpack.Packer(strict_types=True, use_bin_type=True, autoreset=True)
        pack = packer.pack
        for x in t:
            tx = type(x)
            if tx is np.ndarray:
                if x.nbytes >= limit or not x.flags.c_contiguous:
                    return None
                record_head = self._arrays.head(x)     # (None for dtypes the fast paths do not take)
                if record_head is None:
                    return None
                head = record_head[1:]
                data = x.tobytes()
                items.append(head)
                items.append(data)
                size += len(head) + len(data)
                continue
            if tx is str or tx is int or tx is float or tx is bool or x is None or tx is dict or tx is list \
                    or tx is bytes:
                try:
                    packed = pack(x)
                except (TypeError, ValueError, OverflowError):
                    packer.reset()
                    return None      # a value msgpack cannot take as it is (the general encoder can)
                if len(packed) >= limit:
                    return None      # large bytes inside travel out of band the general way
                items.append(packed)
                size += len(packed)
                continue
            return None
        return [b"\x00", ext_header(self._tuple_code, size), *items]


class ArrayBodies:
    """Extension bodies ``[dtype, shape, bytes]`` of small arrays seen before, recognised by length and
    head (see the module doc)."""

    def __init__(self) -> None:
        self._kinds = KindsByLength()

    @property
    def table(self) -> dict[int, list[tuple[bytes, np.dtype, tuple[int, ...]]]]:
        """The remembered kinds by body length (what the compiled decoder reads; see KindsByLength)."""
        return self._kinds.by_len

    def decode(self, body: bytes) -> np.ndarray | None:
        """A writable copy of the array ``body`` holds, if it is of a remembered kind, else None."""
        return self._kinds.find(memoryview(body))

    def remember(self, body: bytes, value: np.ndarray) -> None:
        """``body`` decoded (the general way) to ``value``: recognise bodies of its kind from now on."""
        dt = value.dtype
        if dt.names is not None or dt.hasobject or value.nbytes > len(body):
            return
        head = body[:len(body) - value.nbytes]
        if body[len(head):] != value.tobytes():
            return
        self._kinds.add(len(body), head, value)


def decode_plain(record: memoryview, tuple_code: int, ndarray_code: int, bodies: ArrayBodies) -> Any:
    """The value of the plain record ``record`` (kind byte 0, then msgpack) read by the compiled form, or
    :data:`DECLINE`: the form is not built, or the record holds anything but nil, booleans, integers,
    floats, str, bin, lists, dicts, tuples (extension ``tuple_code``) and arrays of kinds ``bodies``
    remembers (extension ``ndarray_code``), or it is malformed."""
    return PLAIN_DECODE(record, tuple_code, ndarray_code, bodies.table, np.empty)
