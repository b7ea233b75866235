"""P4Runtime bytestrings (innet.p4runtime.bytestrings): canonical and padded round trips, values wider
than the bitwidth, empty strings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from innet.p4runtime.bytestrings import decode_uint, encode_uint, to_canonical
from innet.p4runtime.errors import P4RuntimeError


pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- bytestrings
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64).flatmap(lambda w: st.tuples(st.just(w), st.integers(0, 2**w - 1))),
       st.integers(0, 4))
def test_bytestrings_roundtrip_canonical_and_padded(width_value, pad):
    width, value = width_value
    canonical = encode_uint(value)
    assert len(canonical) == max(1, (value.bit_length() + 7) // 8)
    assert decode_uint(canonical, width, "x") == value
    assert decode_uint(b"\x00" * pad + canonical, width, "x") == value
    assert to_canonical(b"\x00" * pad + canonical) == canonical


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 63).flatmap(lambda w: st.tuples(st.just(w), st.integers(2**w, 2**64))))
def test_bytestrings_reject_values_wider_than_the_bitwidth(width_value):
    width, value = width_value
    with pytest.raises(P4RuntimeError) as info:
        decode_uint(value.to_bytes(9, "big"), width, "field")
    assert info.value.code_name == "OUT_OF_RANGE"


def test_bytestrings_reject_empty():
    with pytest.raises(P4RuntimeError) as info:
        decode_uint(b"", 8, "field")
    assert info.value.code_name == "OUT_OF_RANGE"
