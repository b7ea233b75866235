"""Codec: turns values into buffers and back, with no sizes or serializers asked of the user.

Record layout (all lengths little-endian u64, so objects over 2 GiB and 4 GiB work):

* ``0x00`` + msgpack body — the common case: no out-of-band buffers.
* ``0x01`` + u32 n + u64 body_len + n * u64 buffer_len + body + buffer_0 + ... + buffer_{n-1} — large
  numpy arrays and large bytes-like values travel *out of band*: the body holds a reference and the
  raw bytes follow untouched (zero-copy on send; on receive arrays are views of the received memory).

pyarrow Tables and RecordBatches (optional: the ``arrow`` extra) keep their schema in band and send
their column buffers out of band, untouched (see :mod:`twisternet.arrowcodec`).

msgpack carries None, bool, int (64-bit), float, str, bytes, list and dict; bytes-like values
(bytes, bytearray, memoryview) arrive as ``bytes``. Extension types keep what
msgpack would lose: tuples stay tuples, numpy arrays and scalars keep dtype and shape, ints beyond 64
bits keep their value. Anything else goes through cloudpickle (:mod:`twisternet.pickling`: the job
script's own classes arrive as the receiver's classes, large buffers inside, such as a dataclass's numpy
arrays, travel out of band like a bare array's), but only when ``allow_pickle`` is true (it is refused
on decode too, so a process that forbids pickle never unpickles peer bytes). A value that cannot be
encoded raises :class:`~twisternet.errors.CodecError`.

Tensors and other array-likes travel as numpy arrays, without a copy (:func:`as_array`): a CPU torch
tensor, an object with ``__array_interface__`` or ``__dlpack__`` (on the CPU), or one that exports the
buffer protocol is encoded as the numpy view of its memory (out of band when large) and arrives as a
numpy array. Memory on another device (CUDA, meta) is refused with a CodecError naming the device.

Keys of keyed operations use :class:`KeyCodec`: fixed-size keys (int, float) carry no length, variable
keys (str, bytes, object) carry a u64 length.
"""

from __future__ import annotations

import pickle
import struct
import threading
from typing import Any
from collections.abc import Callable, Sequence

import msgpack
import numpy as np

from . import arrowcodec, pickling
from .channel import Buffer
from .errors import CodecError
from .smallarrays import SmallArrays
from .smallrecords import COMPILED_ENCODE, DECLINE, PLAIN_DECODE, ArrayBodies, SmallRecords

_EXT_TUPLE = 1
_EXT_NDARRAY = 2        # inline: [dtype, shape, bytes]
_EXT_NDARRAY_OOB = 3    # out of band: [dtype, shape, index]
_EXT_BYTES_OOB = 4      # out of band: [index, kind]  kind 0 bytes, 1 bytearray
_EXT_PICKLE = 5
_EXT_BIGINT = 6
_EXT_NPSCALAR = 7       # [dtype, bytes]
_EXT_PICKLE_OOB = 8     # [pickle, [index, ...]]: a pickle whose large buffers travel out of band
_EXT_ARROW = 9          # a pyarrow Table/RecordBatch: schema in band, buffers out of band (arrowcodec)

_U64 = struct.Struct("<Q")
_OOB_HEAD = struct.Struct("<BIQ")
KIND_PLAIN = 0
KIND_OOB = 1

#: Lone-array record bodies remembered by a Codec (see Codec._array_bodies), and their longest.
_ARRAY_BODIES = 256
_ARRAY_BODY_MAX = 256
#: Arrays and bytes at least this large travel out of band by default.
DEFAULT_OOB_THRESHOLD = 64 << 10


def _dtype_ok(dt: np.dtype) -> bool:
    return not dt.hasobject


_KDLCPU = 1


def _is_torch_tensor(obj: Any) -> bool:
    """A torch.Tensor (or Parameter), recognised without importing torch."""
    mod = type(obj).__module__
    return (mod == "torch" or mod.startswith("torch.")) and hasattr(obj, "untyped_storage") and hasattr(obj, "device")


def _torch_view(t: Any) -> np.ndarray:
    device = t.device.type
    if device != "cpu":
        raise CodecError(f"a torch tensor on device {str(t.device)!r} ({t.dtype}, shape {list(t.shape)}): "
                         "twisternet moves host memory only; pass tensor.cpu()")
    if t.is_sparse or getattr(t, "is_quantized", False):
        raise CodecError(f"a {'sparse' if t.is_sparse else 'quantized'} torch tensor cannot travel as an array; "
                         "pass tensor.to_dense() / dequantize() first")
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    try:
        arr: np.ndarray = t.numpy()
        return arr
    except (TypeError, RuntimeError) as e:   # e.g. bfloat16, which numpy has no dtype for
        raise CodecError(f"a torch tensor of dtype {t.dtype} has no numpy equivalent ({e}); convert it, e.g. "
                         "tensor.float()") from None


def as_array(obj: Any) -> np.ndarray | None:
    """A numpy view of ``obj``'s memory without a copy, or None if ``obj`` is not array-like.

    Array-like: a numpy array (returned as it is), a CPU torch tensor (detached; its grad is not
    touched), an object with ``__array_interface__`` or a CPU ``__dlpack__``, or one exporting the
    buffer protocol (bytes-like values excepted: the codec sends those as bytes). Writing into the view
    writes into ``obj``. Memory on another device raises CodecError.
    """
    if isinstance(obj, np.ndarray):
        return obj
    t = type(obj)
    if t in (bytes, bytearray, memoryview, str, int, float, bool, complex, type(None)) or isinstance(obj, np.generic):
        return None
    if _is_torch_tensor(obj):
        return _torch_view(obj)
    if hasattr(obj, "__array_interface__"):
        return np.asarray(obj)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev = obj.__dlpack_device__()
        if int(dev[0]) != _KDLCPU:
            raise CodecError(f"a {t.__qualname__} on DLPack device {tuple(dev)!r}: twisternet moves host memory "
                             "only; copy it to the CPU first")
        return np.from_dlpack(obj)
    try:
        mv = memoryview(obj)
    except TypeError:
        return None
    return np.asarray(mv)


def _array_like(obj: Any) -> np.ndarray | None:
    """:func:`as_array` for the encoder: None for numpy subclasses and arrow data (they keep their type)."""
    if isinstance(obj, np.ndarray) or arrowcodec.is_arrow_data(obj):
        return None
    return as_array(obj)


#: Nesting levels of extension values (tuples in tuples...) that keep their own Packer; deeper ones
#: pack with a fresh one each time. And the buffer such a Packer starts with, and the size of a packed
#: value past which its Packer (whose buffer grew to that) is dropped rather than kept.
_KEEP_SUB_LEVELS = 8
_SUB_BUFFER = 8 << 10
_KEEP_SUB_BYTES = 1 << 20


class _Encoder:
    __slots__ = ("allow_pickle", "threshold", "oob", "_packer", "_subs", "_depth", "busy")

    def __init__(self, allow_pickle: bool, threshold: int) -> None:
        self.allow_pickle = allow_pickle
        self.threshold = threshold
        self.oob: list[Buffer] = []
        self.busy = False
        self._packer = self._new_packer()
        #: One Packer per nesting level of :meth:`_sub`, kept (see there).
        self._subs: list[msgpack.Packer] = []
        self._depth = 0

    def _new_packer(self, buf_size: int = 256 << 10) -> msgpack.Packer:
        return msgpack.Packer(default=self._default, strict_types=True, use_bin_type=True, autoreset=True,
                              buf_size=buf_size)

    def _sub(self, obj: Any) -> bytes:
        """``obj`` packed on its own, for the body of an extension value (a tuple, an array's header).

        A Packer must not be re-entered, so each nesting level has its own, made once: a fresh one per
        value (``msgpack.packb``) costs ~14 µs here while the outer Packer is alive (each allocates a
        large buffer, which then comes from fresh pages), against ~1 µs for the whole small record."""
        d = self._depth
        if d >= _KEEP_SUB_LEVELS:
            packed: bytes = msgpack.packb(obj, default=self._default, strict_types=True, use_bin_type=True)
            return packed
        if d == len(self._subs):
            self._subs.append(self._new_packer(_SUB_BUFFER))
        packer = self._subs[d]
        self._depth = d + 1
        try:
            packed = packer.pack(obj)
        except BaseException:
            packer.reset()
            raise
        finally:
            self._depth = d
        if len(packed) > _KEEP_SUB_BYTES:
            del self._subs[d:]      # its buffer grew to this size: do not keep that much per thread
        return packed

    def _default(self, obj: Any) -> Any:
        t = type(obj)
        if t is tuple:
            return msgpack.ExtType(_EXT_TUPLE, self._sub(list(obj)))
        if t is np.ndarray and _dtype_ok(obj.dtype):
            dt = obj.dtype.str if obj.dtype.names is None else obj.dtype.descr
            if not obj.flags.c_contiguous:
                obj = np.ascontiguousarray(obj)
            if obj.nbytes >= self.threshold:
                self.oob.append(memoryview(obj).cast("B") if obj.ndim else obj.tobytes())
                return msgpack.ExtType(_EXT_NDARRAY_OOB,
                                       self._sub([dt, list(obj.shape), len(self.oob) - 1]))
            return msgpack.ExtType(_EXT_NDARRAY, self._sub([dt, list(obj.shape), obj.tobytes()]))
        if t in (bytearray, memoryview) or (t is bytes and len(obj) >= self.threshold):
            mv = memoryview(obj)
            if not mv.c_contiguous:
                mv = memoryview(mv.tobytes())
            self.oob.append(mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv)
            return msgpack.ExtType(_EXT_BYTES_OOB, self._sub([len(self.oob) - 1,
                                                                      1 if t is bytearray else 0]))
        if t is int:  # only reached when it does not fit 64 bits
            return msgpack.ExtType(_EXT_BIGINT, str(obj).encode())
        if isinstance(obj, np.generic) and _dtype_ok(obj.dtype):
            return msgpack.ExtType(_EXT_NPSCALAR, self._sub([obj.dtype.str, obj.tobytes()]))
        if arrowcodec.is_arrow_data(obj):
            return msgpack.ExtType(_EXT_ARROW, self._sub(arrowcodec.encode(obj, self._arrow_buffer)))
        arr = _array_like(obj)
        if arr is not None and type(arr) is np.ndarray and _dtype_ok(arr.dtype):
            return self._default(arr)      # a tensor or other array-like: as the numpy view of its memory
        if not self.allow_pickle:
            raise CodecError(f"cannot encode a value of type {t.__module__}.{t.__qualname__} without "
                             "pickle (config allow_pickle is false)")
        first = len(self.oob)
        try:
            data = pickling.dumps(obj, buffer_callback=self._pickle_buffer)
        except Exception as e:  # surface any pickling failure as a codec error
            del self.oob[first:]
            raise CodecError(f"cannot encode a value of type {t.__qualname__}: {e}") from e
        if len(self.oob) == first:
            return msgpack.ExtType(_EXT_PICKLE, data)
        return msgpack.ExtType(_EXT_PICKLE_OOB, self._sub([data, list(range(first, len(self.oob)))]))

    def _arrow_buffer(self, buf: Any) -> Any:
        """Reference to one Arrow buffer of a table: None, an out-of-band index (the buffer itself, not
        copied) or, below the threshold, its bytes in band."""
        if buf is None:
            return None
        if buf.size < self.threshold:
            return buf.to_pybytes()
        self.oob.append(memoryview(buf))
        return len(self.oob) - 1

    def _pickle_buffer(self, buf: pickle.PickleBuffer) -> bool:
        """pickle's ``buffer_callback``: a large buffer (an array's data inside a pickled object) goes
        out of band like a bare array's (False); a small one stays in the pickle (True)."""
        try:
            raw = buf.raw()
        except BufferError:      # not contiguous: pickle copies it in band
            return True
        if raw.nbytes < self.threshold:
            return True
        self.oob.append(raw)
        return False

    def encode(self, obj: Any) -> list[Buffer]:
        t = type(obj)
        try:
            try:
                body = self._packer.pack(obj)
            except (OverflowError, BufferError):
                # An int beyond 64 bits, or a memoryview that is not contiguous, inside a container
                # msgpack tried natively: pack a converted copy of the containers.
                self._packer.reset()
                self.oob = []
                body = self._pack_converted(obj)
        except CodecError:
            self._packer.reset()
            raise
        except (TypeError, ValueError, OverflowError, BufferError, RecursionError) as e:
            self._packer.reset()
            raise CodecError(f"cannot encode a value of type {t.__qualname__}: {e}") from e
        if not self.oob:
            return [b"\x00", body]
        head = _OOB_HEAD.pack(KIND_OOB, len(self.oob), len(body))
        lens = b"".join(_U64.pack(memoryview(b).nbytes) for b in self.oob)
        return [head, lens, body, *self.oob]

    def _pack_converted(self, obj: Any) -> bytes:
        """Pack ``obj`` with the values msgpack refuses natively (big ints, non-contiguous
        memoryviews) already converted, walking lists, tuples and dicts."""
        def conv(o: Any) -> Any:
            t = type(o)
            if t is int and not -(1 << 63) <= o < (1 << 64):
                return msgpack.ExtType(_EXT_BIGINT, str(o).encode())
            if t is memoryview:
                return self._default(o)
            if t is list:
                return [conv(x) for x in o]
            if t is tuple:
                return msgpack.ExtType(_EXT_TUPLE, self._sub([conv(x) for x in o]))
            if t is dict:
                return {conv(k): conv(v) for k, v in o.items()}
            return o
        packed: bytes = self._packer.pack(conv(obj))
        return packed


class _Decoder:
    __slots__ = ("allow_pickle", "oob", "copy", "views", "bodies")

    def __init__(self, allow_pickle: bool, oob: Sequence[memoryview], copy: bool,
                 bodies: ArrayBodies | None = None) -> None:
        self.allow_pickle = allow_pickle
        self.oob = oob
        self.copy = copy
        self.views = False      # whether a decoded array is a view of the record's memory
        self.bodies = bodies    # inline arrays' bodies seen before (twisternet.smallrecords)

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_TUPLE:
            return tuple(self._unpack(data))
        if code == _EXT_NDARRAY:
            bodies = self.bodies
            if bodies is not None:
                known = bodies.decode(data)
                if known is not None:
                    return known
            dt, shape, raw = self._unpack(data)
            arr = np.frombuffer(raw, dtype=_dtype(dt)).reshape(shape).copy()  # writable, like the sender's
            if bodies is not None:
                bodies.remember(data, arr)
            return arr
        if code == _EXT_NDARRAY_OOB:
            dt, shape, idx = self._unpack(data)
            buf = self._oob(idx)
            arr = np.frombuffer(buf, dtype=_dtype(dt)).reshape(shape)
            # views of read-only memory (bytes) are copied so every decoded array is writable
            if self.copy or not arr.flags.writeable:
                return arr.copy()
            self.views = True
            return arr
        if code == _EXT_BYTES_OOB:
            idx, kind = self._unpack(data)
            buf = self._oob(idx)
            return bytes(buf)
        if code == _EXT_ARROW:
            return arrowcodec.decode(self._unpack(data), self._arrow_buffer)
        if code == _EXT_BIGINT:
            return int(data.decode())
        if code == _EXT_NPSCALAR:
            dt, raw = self._unpack(data)
            return np.frombuffer(raw, dtype=_dtype(dt))[0]
        if code in (_EXT_PICKLE, _EXT_PICKLE_OOB):
            if not self.allow_pickle:
                raise CodecError("received a pickled value but config allow_pickle is false")
            if code == _EXT_PICKLE:
                return pickling.loads(data)
            data, indexes = self._unpack(data)
            buffers: list[bytearray | memoryview] = []
            for idx in indexes:
                buf = self._oob(idx)
                if self.copy or buf.readonly:   # a writable copy, as for out-of-band arrays
                    buffers.append(bytearray(buf))
                else:
                    buffers.append(buf)
                    self.views = True
            return pickling.loads(data, buffers)
        raise CodecError(f"unknown codec extension type {code}")

    def _arrow_buffer(self, ref: Any) -> Any:
        pa = arrowcodec.require_pyarrow()
        if ref is None:
            return None
        if type(ref) is bytes:
            return pa.py_buffer(ref)
        buf = self._oob(ref)
        if self.copy:
            return pa.py_buffer(bytes(buf))
        self.views = True
        return pa.py_buffer(buf)

    def _oob(self, idx: int) -> memoryview:
        if not 0 <= idx < len(self.oob):
            raise CodecError(f"out-of-band buffer {idx} missing (record has {len(self.oob)})")
        return self.oob[idx]

    def _unpack(self, data: bytes) -> Any:
        return msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False,
                               max_bin_len=1 << 62, max_str_len=1 << 62)


def _dtype(spec: Any) -> np.dtype:
    try:
        dt: np.dtype = np.dtype([tuple(f) for f in spec]) if isinstance(spec, list) else np.dtype(spec)
        return dt
    except TypeError as e:
        raise CodecError(f"bad dtype in record: {spec!r}") from e


class Codec:
    """Encodes values to a list of buffers (concatenated on the wire) and decodes them back."""

    def __init__(self, *, allow_pickle: bool = True, oob_threshold: int = DEFAULT_OOB_THRESHOLD) -> None:
        self.allow_pickle = allow_pickle
        self.oob_threshold = oob_threshold
        self._local = threading.local()  # one reusable encoder per thread
        #: Bodies of lone-array records seen before -> (dtype, shape): decoding such a record again
        #: skips msgpack and its callback (a third of the Python time of receiving a large array).
        self._array_bodies: dict[bytes, tuple[np.dtype, tuple[int, ...]]] = {}
        #: And the other way: (dtype, shape) -> the first three parts of such a record.
        self._array_heads: dict[tuple[np.dtype, tuple[int, ...]], list[bytes]] = {}
        #: Lone arrays below the threshold, both ways, without msgpack (twisternet.smallarrays).
        self._small = SmallArrays(lambda a: _Encoder(allow_pickle, oob_threshold).encode(a), oob_threshold)
        #: Short tuples of scalars and small arrays, encoded without callbacks, and the bodies of the
        #: small arrays inside records, decoded without msgpack (twisternet.smallrecords).
        self._records = SmallRecords(_EXT_TUPLE, self._small, oob_threshold)
        self._bodies = ArrayBodies()
        # The hot paths below call the compiled short-record forms directly when they are built (the
        # same calls SmallRecords.encode and decode_plain make, one Python call fewer per record),
        # and look a lone small array's record length up before asking SmallArrays for its kind.
        self._small_head = self._small.head
        self._small_lengths = self._small.lengths
        self._bodies_table = self._bodies.table

    def encode(self, obj: Any) -> list[Buffer]:
        """Buffers whose concatenation is the record for ``obj``; large arrays/bytes are not copied."""
        if type(obj) is np.ndarray:
            parts = self._large_array(obj) if obj.nbytes >= self.oob_threshold else self._small.encode(obj)
            if parts is not None:
                return parts
        elif type(obj) is tuple:
            if COMPILED_ENCODE is not None:
                rec = COMPILED_ENCODE(obj, np.ndarray, self._small_head, self.oob_threshold, _EXT_TUPLE)
                if rec is not None:
                    return [rec]
            else:
                parts = self._records.encode(obj)
                if parts is not None:
                    return parts
        elif _is_torch_tensor(obj):
            parts = self._large_array(_torch_view(obj))
            if parts is not None:
                return parts
        enc = getattr(self._local, "enc", None)
        if enc is None or enc.busy:
            enc = _Encoder(self.allow_pickle, self.oob_threshold)
            if getattr(self._local, "enc", None) is None:
                self._local.enc = enc
        enc.busy = True
        try:
            return enc.encode(obj)
        finally:
            enc.oob = []
            enc.busy = False

    def _large_array(self, a: np.ndarray) -> list[Buffer] | None:
        """The record of a lone large array without the encoder (the same bytes, its first three parts
        remembered per dtype and shape), or None if ``a`` is not one (small, not contiguous, a scalar,
        or a structured or object dtype). Sending the same kind of array again then costs a dict look-up
        instead of two msgpack calls and the encoder's callback: most of the Python time of the send."""
        if a.nbytes < self.oob_threshold or not a.flags.c_contiguous:
            return None
        key = (a.dtype, a.shape)
        head = self._array_heads.get(key)
        if head is None:
            dt = a.dtype
            if not a.ndim or dt.names is not None or dt.hasobject:
                return None
            body = msgpack.packb(msgpack.ExtType(_EXT_NDARRAY_OOB, msgpack.packb([dt.str, list(a.shape), 0])))
            head = [_OOB_HEAD.pack(KIND_OOB, 1, len(body)), _U64.pack(a.nbytes), body]
            if len(self._array_heads) >= _ARRAY_BODIES:
                self._array_heads.clear()
            self._array_heads[key] = head
        return [*head, memoryview(a).cast("B")]  # type: ignore[arg-type]  # numpy declares __buffer__ for >= 3.12 only

    def _remember_array(self, body: bytes, a: np.ndarray) -> None:
        """Cache ``body`` -> (dtype, shape) if it is exactly the body of a lone array of ``a``'s kind."""
        parts = self._large_array(a)
        if parts is None or parts[2] != body:
            return
        if len(self._array_bodies) >= _ARRAY_BODIES:
            self._array_bodies.clear()
        self._array_bodies[body] = (a.dtype, a.shape)

    def encode_bytes(self, obj: Any) -> bytes:
        """The record for ``obj`` as one bytes object (a copy)."""
        return b"".join(self.encode(obj))

    def decode(self, record: Buffer, *, copy: bool = False) -> Any:
        """The value of a whole record. With ``copy=False`` large arrays are views of ``record``."""
        return self.decode_views(record, copy=copy)[0]

    def decode_views(self, record: Buffer, *, copy: bool = False) -> tuple[Any, bool]:
        """``(value, views)``: :meth:`decode`'s value and whether any array in it is a view of ``record``
        (False: the value holds no reference to ``record``'s memory, which may then be reused)."""
        mv = memoryview(record)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        if len(mv) < 1:
            raise CodecError("empty record")
        kind = mv[0]
        try:
            if kind == KIND_PLAIN:   # no out-of-band buffers: nothing can be a view of the record
                # The compiled plain-record decoder first: it also reads a lone small array whose body
                # kind it knows (in a quarter of SmallArrays' time); SmallArrays when it is not built.
                plain = PLAIN_DECODE(mv, _EXT_TUPLE, _EXT_NDARRAY, self._bodies_table, np.empty)
                if plain is not DECLINE:
                    return plain, False
                if len(mv) in self._small_lengths:
                    small = self._small.decode(mv)
                    if small is not None:
                        return small, False
                dec = _Decoder(self.allow_pickle, (), copy, self._bodies)
                plain = msgpack.unpackb(mv[1:], ext_hook=dec.ext_hook, raw=False, strict_map_key=False,
                                        max_bin_len=1 << 62, max_str_len=1 << 62)
                if type(plain) is np.ndarray:
                    self._small.remember(mv, plain)
                return plain, False
            if kind == KIND_OOB:
                if len(mv) < _OOB_HEAD.size:
                    raise CodecError("truncated record header")
                _, n, body_len = _OOB_HEAD.unpack_from(mv, 0)
                pos = _OOB_HEAD.size
                if n > (len(mv) - pos) // 8:
                    raise CodecError(f"record claims {n} buffers but is {len(mv)} bytes")
                lens = [_U64.unpack_from(mv, pos + 8 * i)[0] for i in range(n)]
                pos += 8 * n
                if pos + body_len + sum(lens) != len(mv):
                    raise CodecError(f"record lengths do not add up: header says "
                                     f"{pos + body_len + sum(lens)} bytes, got {len(mv)}")
                body = mv[pos:pos + body_len]
                pos += body_len
                key = bytes(body) if n == 1 and body_len <= _ARRAY_BODY_MAX else None
                if key is not None:
                    known = self._array_bodies.get(key)
                    if known is not None:
                        arr = np.frombuffer(mv[pos:], dtype=known[0]).reshape(known[1])
                        if copy or not arr.flags.writeable:
                            return arr.copy(), False
                        return arr, True
                oob = []
                for ln in lens:
                    oob.append(mv[pos:pos + ln])
                    pos += ln
                dec = _Decoder(self.allow_pickle, oob, copy, self._bodies)
                value = msgpack.unpackb(body, ext_hook=dec.ext_hook, raw=False, strict_map_key=False,
                                        max_bin_len=1 << 62, max_str_len=1 << 62)
                if key is not None and type(value) is np.ndarray:
                    self._remember_array(key, value)
                return value, dec.views
        except CodecError:
            raise
        except Exception as e:  # msgpack's own errors for corrupt bytes
            raise CodecError(f"corrupt record: {e}") from e
        raise CodecError(f"unknown record kind {kind}")


def join(parts: Sequence[Buffer]) -> bytearray:
    """The concatenation of ``parts`` in one new, writable buffer (a single copy)."""
    views = [memoryview(p).cast("B") if memoryview(p).format != "B" or memoryview(p).ndim != 1
             else memoryview(p) for p in parts]
    out = bytearray(sum(v.nbytes for v in views))
    pos = 0
    for v in views:
        out[pos:pos + v.nbytes] = v
        pos += v.nbytes
    return out


def record_size(parts: Sequence[Buffer]) -> int:
    """Total bytes of a record given as parts."""
    n = 0
    for p in parts:
        n += len(p) if type(p) is bytes else memoryview(p).nbytes   # (the common part, without a view)
    return n


# ------------------------------------------------------------------------------------------------ keys
_KEY_FIXED = {"int": struct.Struct("<q"), "float": struct.Struct("<d")}


class KeyCodec:
    """Compact encoding of keys: ``int`` and ``float`` are 8 bytes with no length; ``str``, ``bytes``
    and ``object`` (any codec value) are length-prefixed (u64)."""

    TYPES = ("int", "float", "str", "bytes", "object")

    def __init__(self, key_type: str, codec: Codec | None = None) -> None:
        if key_type not in self.TYPES:
            raise CodecError(f"key_type must be one of {', '.join(self.TYPES)}, got {key_type!r}")
        self.key_type = key_type
        self.fixed_size: int | None = _KEY_FIXED[key_type].size if key_type in _KEY_FIXED else None
        self._codec = codec or Codec()
        self.encode: Callable[[Any], bytes]
        self.decode_from: Callable[[Buffer, int], tuple[Any, int]]
        st = _KEY_FIXED.get(key_type)
        if st is not None:
            pytype = int if key_type == "int" else float

            def enc_fixed(key: Any) -> bytes:
                if type(key) is not pytype and not (pytype is float and type(key) is int) \
                        and not isinstance(key, np.integer if pytype is int else np.floating):
                    raise CodecError(f"key {key!r} is not of key_type {key_type!r}")
                try:
                    return st.pack(key)
                except struct.error as e:
                    raise CodecError(f"key {key!r} does not fit key_type {key_type!r}: {e}") from e

            def dec_fixed(buf: Buffer, pos: int) -> tuple[Any, int]:
                return st.unpack_from(buf, pos)[0], pos + st.size
            self.encode, self.decode_from = enc_fixed, dec_fixed
        else:
            def enc_var(key: Any) -> bytes:
                if key_type == "str":
                    if type(key) is not str:
                        raise CodecError(f"key {key!r} is not of key_type 'str'")
                    raw = key.encode()
                elif key_type == "bytes":
                    if not isinstance(key, (bytes, bytearray, memoryview)):
                        raise CodecError(f"key {key!r} is not of key_type 'bytes'")
                    raw = bytes(key)
                else:
                    raw = self._codec.encode_bytes(key)
                return _U64.pack(len(raw)) + raw

            def dec_var(buf: Buffer, pos: int) -> tuple[Any, int]:
                (n,) = _U64.unpack_from(buf, pos)
                pos += 8
                raw = bytes(memoryview(buf)[pos:pos + n])
                if len(raw) != n:
                    raise CodecError("truncated key")
                if key_type == "str":
                    return raw.decode(), pos + n
                if key_type == "bytes":
                    return raw, pos + n
                return self._codec.decode(raw, copy=True), pos + n
            self.encode, self.decode_from = enc_var, dec_var

    def decode(self, buf: Buffer) -> Any:
        """The key encoded in the whole of ``buf``."""
        key, end = self.decode_from(buf, 0)
        if end != memoryview(buf).nbytes:
            raise CodecError(f"{memoryview(buf).nbytes - end} trailing bytes after key")
        return key
