"""The codec's fast path for short tuples: the same bytes as the general encoder, or a decline."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from tests.twisternet.test_codec import same as _same
from twisternet.codec import Codec, _Encoder
from twisternet.smallrecords import ext_header


def _generic(c: Codec, obj) -> bytes:
    return b"".join(bytes(memoryview(p)) for p in _Encoder(c.allow_pickle, c.oob_threshold).encode(obj))


@pytest.mark.parametrize("length", [0, 1, 2, 3, 4, 8, 15, 16, 17, 255, 256, 65535, 65536, 70000])
def test_extension_headers_are_msgpacks(length: int) -> None:
    packed = msgpack.packb(msgpack.ExtType(1, bytes(length)))
    assert ext_header(1, length) == packed[:len(packed) - length]


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                     st.text(max_size=20), st.binary(max_size=40))
_arrays = hnp.arrays(dtype=st.sampled_from([np.float32, np.float64, np.int8, np.int64, np.uint16, np.bool_,
                                            np.dtype(">f4"), np.dtype("<U3")]),
                     shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=12))   # < 64 KB
_values = st.one_of(_scalars, _arrays, st.lists(_scalars, max_size=4),
                    st.dictionaries(st.text(max_size=8), st.lists(st.integers(0, 99), max_size=4), max_size=3))


@settings(max_examples=300, deadline=None)
@given(st.lists(_values, max_size=16))
def test_short_tuples_encode_to_the_general_encoders_bytes_and_decode_back(items) -> None:
    c = Codec()
    t = tuple(items)
    parts = c._records.encode(t)
    if len(t) <= 15:
        assert parts is not None
    if parts is not None:
        assert b"".join(bytes(memoryview(p)) for p in parts) == _generic(c, t)
    rec = b"".join(bytes(memoryview(p)) for p in c.encode(t))
    assert rec == _generic(c, t)
    for _ in range(2):                                      # the general way, then remembered arrays
        value, views = c.decode_views(rec)
        assert _same(value, t) and not views
        assert all(v.flags.writeable and v.base is None for v in value if isinstance(v, np.ndarray))


@pytest.mark.parametrize("value", [
    (1, (2, 3)),                                   # a nested tuple
    (np.arange(20_000, dtype=np.float64),),        # an array that travels out of band
    (b"x" * (70 << 10),),                          # bytes that travel out of band
    (bytearray(b"ab"),),                           # bytes-like values other than bytes
    (np.arange(6)[::2],),                          # not contiguous
    (np.float64(1.5),),                            # a numpy scalar
    ({"k": (1, 2)},),                              # a tuple inside a dict
    (1 << 70,),                                    # an int beyond 64 bits
    (np.array([object()]),),                       # an object array
], ids=["tuple", "oob-array", "oob-bytes", "bytearray", "strided", "npscalar", "dict-tuple", "bigint", "object"])
def test_what_the_fast_path_declines_still_round_trips(value) -> None:
    c = Codec()
    assert c._records.encode(value) is None
    got = c.decode(join_parts(c.encode(value)))
    assert type(got) is tuple and len(got) == len(value)
    if isinstance(value[0], np.ndarray) and value[0].dtype != object:
        assert np.array_equal(got[0], value[0])
    elif isinstance(value[0], bytearray):
        assert got[0] == bytes(value[0])
    elif not isinstance(value[0], np.ndarray):
        assert _same(got, value)


def test_a_remembered_array_body_of_another_kind_takes_the_general_way() -> None:
    """Two array kinds whose bodies have the same length: each decodes as itself."""
    c = Codec()
    a = (np.arange(4, dtype=np.int32),)
    b = (np.arange(4, dtype=np.float32),)
    ra, rb = (join_parts(c.encode(v)) for v in (a, b))
    assert len(ra) == len(rb)
    for _ in range(3):
        for v, r in ((a, ra), (b, rb)):
            got = c.decode(r)
            assert got[0].dtype == v[0].dtype and np.array_equal(got[0], v[0])


def join_parts(parts) -> bytes:
    return b"".join(bytes(memoryview(p)) for p in parts)
