"""Codec: every supported value round-trips exactly; unsupported ones fail clearly."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from twisternet.codec import Codec, KeyCodec, join
from twisternet.errors import CodecError

codec = Codec()

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    st.text(), st.binary())
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.tuples(inner, inner),
                            st.dictionaries(st.one_of(st.text(), st.integers()), inner, max_size=5)),
    max_leaves=20)


def same(a, b):
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


@given(values)
@settings(max_examples=300, deadline=None)
def test_records_round_trip(v):
    assert same(codec.decode(codec.encode_bytes(v)), v)


@given(hnp.arrays(dtype=st.sampled_from([np.float32, np.float64, np.int8, np.int64, np.uint16, np.bool_,
                                         np.complex64]),
                  shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=40)),
       st.sampled_from([0, 16, 1 << 20]))
@settings(max_examples=200, deadline=None)
def test_arrays_round_trip_inline_and_out_of_band(arr, threshold):
    c = Codec(oob_threshold=threshold)
    out = c.decode(c.encode_bytes(arr))
    assert same(out, arr)
    out[...] = out  # writable


def test_big_ints_numpy_scalars_and_nesting():
    v = {"a": (2**100, -(2**70)), 5: [np.float32(1.5), np.int64(-3)], (1, 2): np.arange(70000)}
    out = codec.decode(codec.encode_bytes(v))
    assert out["a"] == (2**100, -(2**70)) and type(out[5][0]) is np.float32
    assert np.array_equal(out[(1, 2)], np.arange(70000))


def test_non_contiguous_and_structured_arrays():
    a = np.arange(100.0).reshape(10, 10)[:, ::3]
    assert same(codec.decode(codec.encode_bytes(a)), np.ascontiguousarray(a))
    s = np.zeros(4, dtype=[("x", "<i4"), ("y", "<f8")])
    s["x"] = [1, 2, 3, 4]
    assert np.array_equal(codec.decode(codec.encode_bytes(s)), s)


def test_large_arrays_are_not_copied_on_encode():
    a = np.arange(1 << 20, dtype=np.float64)
    parts = codec.encode(a)
    assert any(isinstance(p, memoryview) and p.obj is not None and np.shares_memory(np.frombuffer(p, np.uint8), a)
               for p in parts)


def test_pickle_only_when_allowed():
    class Thing:
        def __init__(self, x):
            self.x = x
    assert codec.decode(codec.encode_bytes({1, 2})) == {1, 2}
    assert codec.decode(codec.encode_bytes(Thing(3))).x == 3
    strict = Codec(allow_pickle=False)
    with pytest.raises(CodecError, match="allow_pickle"):
        strict.encode({1, 2})
    with pytest.raises(CodecError, match="allow_pickle"):
        strict.decode(codec.encode_bytes(Thing(3)))


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_garbage_never_crashes_with_anything_but_codec_error(data):
    strict = Codec(allow_pickle=False)
    try:
        strict.decode(data)
    except CodecError:
        pass


def test_oob_lengths_are_checked():
    rec = bytearray(codec.encode_bytes(np.arange(100000)))
    with pytest.raises(CodecError, match="add up"):
        codec.decode(rec[:-1])


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_int_keys_are_fixed_size(k):
    kc = KeyCodec("int")
    assert len(kc.encode(k)) == 8 and kc.decode(kc.encode(k)) == k


@given(st.floats(allow_nan=False))
def test_float_keys_are_fixed_size(k):
    kc = KeyCodec("float")
    assert len(kc.encode(k)) == 8 and kc.decode(kc.encode(k)) == k


@given(st.text())
def test_str_keys_carry_their_length(k):
    kc = KeyCodec("str")
    raw = kc.encode(k)
    assert len(raw) == 8 + len(k.encode()) and kc.decode(raw) == k


@given(values)
@settings(deadline=None)
def test_object_keys(k):
    kc = KeyCodec("object")
    assert same(kc.decode(kc.encode(k)), k)


def test_key_type_mismatch_is_an_error():
    with pytest.raises(CodecError):
        KeyCodec("int").encode("a")
    with pytest.raises(CodecError):
        KeyCodec("str").encode(5)
    with pytest.raises(CodecError):
        KeyCodec("int").encode(2**64)
    with pytest.raises(CodecError):
        KeyCodec("nope")


def test_decode_views_says_whether_the_value_refers_to_the_record():
    c = Codec(oob_threshold=1024)
    plain = join(c.encode({"a": [1, 2], "s": "x", "small": np.arange(4)}))
    value, views = c.decode_views(plain)
    assert not views and value["s"] == "x"
    big = join(c.encode({"arr": np.arange(4096, dtype=np.int64), "b": b"y" * 4096}))
    value, views = c.decode_views(big)
    assert views and value["arr"].base is not None and np.array_equal(value["arr"], np.arange(4096))
    value, views = c.decode_views(big, copy=True)          # copies: nothing refers to the record
    assert not views and value["arr"].base is None
    only_bytes = join(c.encode([b"z" * 4096]))              # out-of-band bytes are always copied out
    assert c.decode_views(only_bytes) == ([b"z" * 4096], False)


def _generic_record(c: Codec, obj) -> bytes:
    """The record the general encoder (msgpack with its callback) makes, bypassing the lone-array path."""
    from twisternet.codec import _Encoder
    return b"".join(bytes(memoryview(p)) for p in _Encoder(c.allow_pickle, c.oob_threshold).encode(obj))


@given(hnp.arrays(dtype=st.sampled_from([np.float32, np.float64, np.int8, np.int64, np.uint16, np.bool_,
                                         np.complex64, np.dtype(">f4"), np.dtype("<U3")]),
                  shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=40)),
       st.sampled_from([0, 16, 1 << 20]))
@settings(max_examples=200, deadline=None)
def test_lone_arrays_encode_to_the_general_encoders_bytes(arr, threshold):
    c = Codec(oob_threshold=threshold)
    want = _generic_record(c, arr)
    for _ in range(2):                       # the second time from the remembered head
        assert join(c.encode(arr)) == want
        value, views = c.decode_views(bytearray(want))   # and back, the second time without msgpack
        assert same(value, arr)
        assert views == (arr.nbytes >= threshold)     # out of band: the value is a view of the record


def test_lone_array_fast_paths_keep_their_checks():
    c = Codec(oob_threshold=1024)
    a = np.arange(4096, dtype=np.int64)
    rec = join(c.encode(a))
    c.decode(rec)                                         # now remembered
    assert len(c._array_bodies) == 1
    with pytest.raises(CodecError, match="add up"):
        c.decode(rec[:-8])
    # A record that announces the same dtype and shape but carries the wrong number of bytes.
    bad = bytearray(rec)
    bad[13:21] = (4096 * 8 - 8).to_bytes(8, "little")     # the buffer length in the header
    with pytest.raises(CodecError):
        c.decode(bad[:-8])
    out = c.decode(bytes(rec))                            # read-only memory: a writable copy
    out[0] = 7
    assert rec[-8 * 4096] == 0
    # non-contiguous and structured arrays still take the general path (and still round-trip)
    assert same(c.decode(join(c.encode(a[::2]))), a[::2].copy())
    s = np.zeros(512, dtype=[("x", "<i4"), ("y", "<f8")])
    assert np.array_equal(c.decode(join(c.encode(s))), s)


def test_non_contiguous_memoryviews_round_trip_as_bytes() -> None:
    """msgpack refuses them natively (a BufferError used to escape encode): they travel as bytes."""
    c = Codec(oob_threshold=16)
    strided = memoryview(bytes(range(200)))[::3]
    nested = {"a": [memoryview(b"abcdef")[::2], 2**70], "b": (np.arange(10)[::2].data,)}
    assert c.decode(c.encode_bytes(strided)) == bytes(range(200))[::3]
    out = c.decode(c.encode_bytes(nested))
    assert out["a"] == [b"ace", 2**70] and out["b"] == (np.arange(10)[::2].tobytes(),)


def test_unserializable_values_are_codec_errors_that_name_the_type() -> None:
    import threading

    for bad in (threading.Lock(), {"k": [threading.Lock()]}, (x for x in range(3))):
        with pytest.raises(CodecError, match="cannot encode a value of type"):
            codec.encode(bad)


def test_small_lone_arrays_skip_msgpack_once_their_kind_is_known(monkeypatch):
    """Below the out-of-band threshold a lone array's record is the general encoder's bytes, built from
    a remembered head (encode) and recognised by its length and head (decode), without msgpack; a record
    of the same length with another head still takes the general path."""
    import msgpack

    from twisternet import codec as codec_mod
    c = Codec(oob_threshold=64 << 10)
    a = np.arange(256, dtype=np.int32)
    rec = join(c.encode(a))
    assert rec == _generic_record(c, a)
    assert same(c.decode(rec), a)                           # the general way: now remembered
    other = np.arange(256, dtype=np.float32)                # same length, another dtype in the head
    other_rec = join(c.encode(other))
    assert len(other_rec) == len(rec)

    unpackb = msgpack.unpackb

    def no_msgpack(*args, **kwargs):
        raise AssertionError("msgpack used")
    monkeypatch.setattr(codec_mod.msgpack, "unpackb", no_msgpack)
    monkeypatch.setattr(codec_mod.msgpack, "packb", no_msgpack)
    b = np.arange(256, dtype=np.int32)[::-1].copy()
    rec_b = join(c.encode(b))                               # encoded from the remembered head
    value, views = c.decode_views(bytearray(rec_b))         # decoded without msgpack
    assert same(value, b) and not views and value.flags.writeable
    value[0] = -1
    assert rec_b == join(c.encode(b))                       # a copy, not a view of the record
    with pytest.raises(CodecError):                         # not recognised: the general path (patched)
        c.decode(other_rec)
    monkeypatch.setattr(codec_mod.msgpack, "unpackb", unpackb)
    assert same(c.decode(other_rec), other)
    for shaped in (np.arange(12, dtype=np.float64).reshape(3, 4), np.array(2.5, np.float32)):
        rec_s = join(c.encode(shaped))
        assert same(c.decode(rec_s), shaped)                # the general way, remembered
        monkeypatch.setattr(codec_mod.msgpack, "unpackb", no_msgpack)
        value, views = c.decode_views(rec_s)                # the fast way keeps the shape
        monkeypatch.setattr(codec_mod.msgpack, "unpackb", unpackb)
        assert same(value, shaped) and value.shape == shaped.shape and value.flags.writeable and not views
        assert value.base is None       # owns its memory: collectives.reduction.own does not copy it again


def test_nested_extension_values_after_a_failure_inside_them() -> None:
    """Tuples and arrays nested in tuples pack with one kept Packer per level: a value that fails deep
    inside leaves no partial bytes behind, levels past the kept ones pack too, and a nested value that
    grew its Packer's buffer past the limit round-trips (its Packer is not kept)."""
    import threading

    strict = Codec(allow_pickle=False)
    good = ("d", 7, (np.arange(5, dtype=np.int32), ("x", (1.5, b"y"))), {"k": (1, 2)})
    for _ in range(2):
        with pytest.raises(CodecError, match="cannot encode a value of type"):
            strict.encode(("a", ("b", ("c", threading.Lock()))))
        assert same(strict.decode(join(strict.encode(good))), good)
    deep: object = 1
    for i in range(20):
        deep = (deep, np.full(3, i, np.int16))
    assert same(strict.decode(join(strict.encode(deep))), deep)
    big = ("big", (list(range(300_000)), ("inner", 1)))
    for _ in range(2):
        assert same(strict.decode(join(strict.encode(big))), big)
    enc = strict._local.enc          # this thread's encoder: back at the top level, and no Packer
    assert enc._depth == 0           # kept whose buffer grew to the big value's size
    assert enc._subs == []
    assert same(strict.decode(join(strict.encode(deep))), deep)
    from twisternet.codec import _KEEP_SUB_LEVELS
    assert len(enc._subs) == _KEEP_SUB_LEVELS and enc._depth == 0
