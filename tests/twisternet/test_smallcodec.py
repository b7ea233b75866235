"""The compiled short-tuple codec (twisternet._smallcodec) against its Python reference: the same bytes
when it encodes, the same values when it decodes, and a decline (never a crash, never a different
value) for anything else, malformed records included."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from tests.twisternet.test_codec import same as _same
from twisternet import smallrecords
from twisternet.codec import _EXT_NDARRAY, _EXT_TUPLE, Codec, _Decoder

if not smallrecords.COMPILED:
    pytest.skip("twisternet._smallcodec is not built here (no C compiler at install time, or "
                "TWISTERNET_SMALLCODEC=python): the Python reference runs instead", allow_module_level=True)


def _reference(c: Codec, rec: bytes):
    """The general decoder's value of the plain record ``rec`` (what decode_views does without the
    compiled form), or the CodecError-worthy exception it raises."""
    dec = _Decoder(c.allow_pickle, (), False, c._bodies)
    return msgpack.unpackb(memoryview(rec)[1:], ext_hook=dec.ext_hook, raw=False, strict_map_key=False,
                           max_bin_len=1 << 62, max_str_len=1 << 62)


def _compiled(c: Codec, rec: bytes):
    return smallrecords.decode_plain(memoryview(rec), _EXT_TUPLE, _EXT_NDARRAY, c._bodies)


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
                     st.text(max_size=40), st.binary(max_size=300))
_arrays = hnp.arrays(dtype=st.sampled_from([np.float32, np.float64, np.int8, np.int64, np.uint16, np.bool_,
                                            np.dtype(">f4"), np.dtype("<U3"), np.complex64]),
                     shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=12))
_nested = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=20), st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), inner,
                                                  max_size=20)), max_leaves=40)
_values = st.one_of(_scalars, _arrays, _nested)


@settings(max_examples=400, deadline=None)
@given(st.lists(_values, max_size=15))
def test_it_encodes_the_references_bytes_and_decodes_the_references_values(items) -> None:
    c = Codec()
    t = tuple(items)
    compiled = c._records.encode(t)
    reference = c._records.encode_py(t)
    assert (compiled is None) == (reference is None)
    if compiled is None:
        return
    rec = b"".join(bytes(memoryview(p)) for p in compiled)
    assert rec == b"".join(bytes(memoryview(p)) for p in reference)
    want = _reference(c, rec)          # (also remembers the kinds of the arrays inside)
    got = _compiled(c, rec)
    assert got is not smallrecords.DECLINE
    assert _same(got, want) and _same(got, t)
    for v in got:
        if isinstance(v, np.ndarray):
            assert v.flags.writeable and v.flags.c_contiguous and v.base is None


@settings(max_examples=200, deadline=None)
@given(_nested)
def test_lone_plain_values_decode_as_the_reference_does(value) -> None:
    c = Codec()
    rec = b"".join(bytes(memoryview(p)) for p in c.encode(value))
    if rec[:1] != b"\x00":
        return
    got = _compiled(c, rec)
    assert got is not smallrecords.DECLINE
    assert _same(got, _reference(c, rec))


def test_an_array_kind_not_yet_remembered_is_left_to_the_general_decoder() -> None:
    c = Codec()
    t = ("d", 7, np.arange(5, dtype=np.float32))
    rec = b"".join(bytes(memoryview(p)) for p in c.encode(t))
    assert _compiled(c, rec) is smallrecords.DECLINE
    assert _same(c.decode(rec), t)                      # the general way, which remembers the kind
    assert _same(_compiled(c, rec), t)


@pytest.mark.parametrize("value", [
    (1, (2, 3)), ({"k": (1, 2)},), (1 << 70,), (np.float64(1.5),), (bytearray(b"ab"),), (np.arange(6)[::2],),
    (np.arange(20_000, dtype=np.float64),), (b"x" * (70 << 10),), ("\ud800",), (np.array([object()]),),
], ids=["tuple", "dict-tuple", "bigint", "npscalar", "bytearray", "strided", "oob-array", "oob-bytes",
        "surrogate", "object"])
def test_it_declines_what_the_reference_declines(value) -> None:
    c = Codec()
    assert c._records.encode(value) is None
    assert c._records.encode_py(value) is None


def test_deep_nesting_goes_the_general_way_both_ways() -> None:
    deep: list = [1]
    for _ in range(40):
        deep = [deep]
    c = Codec()
    t = (deep,)
    assert c._records.encode(t) is None                 # deeper than the compiled form goes
    rec = b"".join(bytes(memoryview(p)) for p in c.encode(t))
    assert _compiled(c, rec) is smallrecords.DECLINE
    assert c.decode(rec) == t


def test_malformed_records_are_declined_or_read_exactly_as_the_reference_reads_them() -> None:
    """Truncated, extended and bit-flipped records: the compiled form never reads past the end and
    never gives a value the general decoder would not (it raises, the compiled form declines)."""
    c = Codec()
    base = [("d", 12, 0, 0, np.arange(64, dtype=np.float32), {"float32[64]": [0, 1]}),
            ({"a": [1, 2.5, None, True]}, "text", b"\x00\x01" * 40, -70000, 1 << 40),
            ([[], {}, ""], np.zeros((2, 3), np.int16))]
    recs = [b"".join(bytes(memoryview(p)) for p in c.encode(t)) for t in base]
    for rec in recs:
        c.decode(rec)                                   # remember the array kinds
    rng = random.Random(1234)
    checked = 0
    for _ in range(6000):
        rec = bytearray(rng.choice(recs))
        how = rng.randrange(3)
        if how == 0:
            rec = rec[:rng.randrange(len(rec))]
        elif how == 1:
            rec += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
        else:
            for _ in range(rng.randrange(1, 4)):
                rec[rng.randrange(1, len(rec))] = rng.randrange(256)
        rec = bytes(rec)
        got = _compiled(c, rec)
        try:
            want = _reference(c, rec)
        except Exception:  # noqa: BLE001 - any error of the general decoder (it becomes a CodecError)
            assert got is smallrecords.DECLINE, rec
            continue
        if got is not smallrecords.DECLINE:
            assert _same(got, want), rec
            checked += 1
    assert checked > 100        # (the mutations that still decode were compared, not only declined)


def test_the_environment_variable_keeps_the_compiled_form_out() -> None:
    code = "from twisternet import smallrecords; print(smallrecords.COMPILED)"
    env = dict(os.environ, TWISTERNET_SMALLCODEC="python")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
