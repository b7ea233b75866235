"""Quantization: the int32 encoding, the overflow path, and the documented error bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from innet.quantize import INT32_MAX, Quantizer, error_bound

floats32 = st.floats(-1e4, 1e4, width=32, allow_nan=False)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 16), st.sampled_from([1.0, 2.0**10, 2.0**20, 1e6]),
       st.data())
def test_sum_of_quantized_within_bound(world: int, scale: float, data) -> None:
    q = Quantizer(scale, world)
    xs = [data.draw(arrays(np.float32, (3, 4), elements=floats32)) for _ in range(world)]
    total = np.zeros((3, 4), np.float64)
    floats = np.zeros((3, 4), np.float64)
    for x in xs:
        qi, ovf = q.quantize_fragments(x)
        assert np.all(np.abs(qi[~ovf].astype(np.int64)) <= q.limit)
        total[~ovf] += qi[~ovf]
        floats[ovf] += qi[ovf].view(np.float32)
    # world quantized values never overflow int32 when summed
    assert np.all(np.abs(total) <= INT32_MAX)
    got = (total / scale + floats).astype(np.float32)
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    assert np.all(np.abs(got - ref) <= error_bound(ref, scale, world))


def test_overflow_fragments_carry_float_bits() -> None:
    q = Quantizer(2.0**20, 4)
    frags = np.array([[1.0, 2.0], [1e6, 0.0], [np.nan, 1.0], [np.inf, 0.0]], np.float32)
    qi, ovf = q.quantize_fragments(frags)
    assert ovf.tolist() == [False, True, True, True]
    assert qi[0].tolist() == [2**20, 2**21]
    assert np.array_equal(qi[1:].view(np.float32)[:, 1], frags[1:, 1])
    assert np.isnan(qi[2].view(np.float32)[0])


def test_limit_depends_on_world() -> None:
    assert Quantizer(1.0, 1).limit == INT32_MAX
    assert Quantizer(1.0, 8).limit == INT32_MAX // 8
    qi, ovf = Quantizer(1.0, 8).quantize_fragments(np.array([[INT32_MAX // 8 + 1]], np.float32))
    assert ovf[0]


def test_rejects_bad_scale() -> None:
    with pytest.raises(ValueError, match="scale"):
        Quantizer(0.0, 2)
    with pytest.raises(ValueError, match="scale"):
        Quantizer(float("nan"), 2)
    with pytest.raises(ValueError, match="world"):
        Quantizer(1.0, 0)
