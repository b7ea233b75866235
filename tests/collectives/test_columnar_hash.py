"""The columnar key hash and routing (collectives.columnar): the documented hash, pinned and recomputed in
plain Python, null keys, split_rows, unsupported key types, and to_table's conversions."""

from __future__ import annotations

import struct

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")

from collectives.columnar import (destination_index, row_hashes, sort_by_keys, split_rows,
                                  to_table)
from twisternet.errors import TableSchemaError


MASK = (1 << 64) - 1
G = 0x9E3779B97F4A7C15


# ------------------------------------------------------------------- the documented hash, in plain Python
def mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def value_hash(v) -> int:
    if isinstance(v, bool):
        return mix(int(v))
    if isinstance(v, int):
        return mix(v & MASK)
    if isinstance(v, float):
        if v == 0.0:
            v = 0.0
        bits = 0x7FF8000000000000 if v != v else struct.unpack("<Q", struct.pack("<d", v))[0]
        return mix(bits)
    raw = v.encode() if isinstance(v, str) else bytes(v)
    h = mix((len(raw) + G) & MASK)
    for i in range(0, len(raw), 8):
        h = mix(h ^ int.from_bytes(raw[i:i + 8].ljust(8, b"\0"), "little"))
    return h


def row_hash(values) -> int:
    h = 0
    for v in values:
        h = mix(h ^ value_hash(v))
    return h


def test_hash_is_pinned():
    """Fixed inputs, fixed hashes: a change of the routing function (which would send keys to other
    destinations than a peer running the old version) fails here."""
    t = pa.table({"i": pa.array([0, 1, -1, 2 ** 62], pa.int64()),
                  "s": ["", "a", "abcdefgh", "abcdefghi"],
                  "f": pa.array([1.5, -0.0, float("nan"), None])})
    assert [hex(x) for x in row_hashes(t, ["i"])[0].tolist()] == [
        "0x0", "0x7ab40e090f363a7d", "0x4bffd802ebfb15e4", "0x56451be349e0883f"]
    assert [hex(x) for x in row_hashes(t, ["s"])[0].tolist()] == [
        "0x48218226ff3cd4bf", "0xc55cb0205a68155c", "0x7db02c005bb88b11", "0x5f980d803b83011e"]
    assert [hex(x) for x in row_hashes(t, ["i", "s"])[0].tolist()] == [
        "0x48218226ff3cd4bf", "0x2f2dd09d4bdef515", "0xbb43f252bc32d9ff", "0xeb619a0d743efbdb"]
    h, nulls = row_hashes(t, ["f"])
    assert hex(int(h[0])) == "0xf16c38690e67bf1c" and nulls.tolist() == [False, False, False, True]


def test_hash_matches_the_documented_definition():
    rng = np.random.default_rng(5)
    ints = [int(x) for x in rng.integers(-(1 << 63), (1 << 63) - 1, 50)]
    strs = ["".join(chr(c) for c in rng.integers(32, 0x2FF, int(n))) for n in rng.integers(0, 30, 50)]
    floats = [float(x) for x in rng.normal(size=46)] + [-0.0, 0.0, float("nan"), float("inf")]
    t = pa.table({"i": ints, "s": strs, "f": floats, "b": [s.encode() for s in strs],
                  "x": [bool(i % 2) for i in range(50)]})
    for keys in (["i"], ["s"], ["f"], ["b"], ["x"], ["s", "i"], ["i", "f", "x"]):
        got = row_hashes(t, keys)[0].tolist()
        want = [row_hash([t.column(k)[r].as_py() for k in keys]) for r in range(50)]
        assert got == want, keys


def test_hash_depends_on_values_not_layout_or_width():
    vals = ["alpha", "b", "", "a much longer key that spans words", "ü-ñ"]
    base = row_hashes(pa.table({"k": vals}), ["k"])[0]
    for arr in (pa.array(vals, pa.large_string()), pa.array([v.encode() for v in vals], pa.binary()),
                pa.array(vals).dictionary_encode(),
                pa.chunked_array([pa.array(vals[:2]), pa.array(vals[2:])])):
        assert row_hashes(pa.table({"k": arr}), ["k"])[0].tolist() == base.tolist()
    # a slice hashes like the same values unsliced
    big = pa.array(["pad"] * 7 + vals)
    assert row_hashes(pa.table({"k": big.slice(7)}), ["k"])[0].tolist() == base.tolist()
    # integer widths and signedness agree on equal values; -0.0 == 0.0
    ints = [0, 5, -3, 127]
    h64 = row_hashes(pa.table({"k": pa.array(ints, pa.int64())}), ["k"])[0].tolist()
    assert row_hashes(pa.table({"k": pa.array(ints, pa.int8())}), ["k"])[0].tolist() == h64
    f = row_hashes(pa.table({"k": pa.array([0.0, -0.0], pa.float32())}), ["k"])[0]
    assert f[0] == f[1]
    # fixed-size binary hashes like variable binary of the same bytes
    fixed = [b"0123456789", b"abcdefghij"]
    assert row_hashes(pa.table({"k": pa.array(fixed, pa.binary(10))}), ["k"])[0].tolist() == \
        row_hashes(pa.table({"k": pa.array(fixed, pa.binary())}), ["k"])[0].tolist()


def test_null_keys_go_to_the_first_destination_and_sort_first():
    t = pa.table({"a": pa.array([1, None, 3, 4]), "b": pa.array(["x", "y", None, "z"])})
    idx = destination_index(t, ["a", "b"], 5)
    assert idx[1] == 0 and idx[2] == 0
    out = sort_by_keys(t, ["a"])
    assert out.column("a").to_pylist()[0] is None


def test_split_rows_keeps_order_with_one_take():
    t = pa.table({"i": np.arange(1000)})
    idx = np.random.default_rng(1).integers(0, 4, 1000)
    parts = split_rows(t, idx, 4)
    for d in range(4):
        assert parts[d].column("i").to_pylist() == np.flatnonzero(idx == d).tolist()


def test_unsupported_key_type_is_a_clear_error():
    t = pa.table({"k": pa.array([[1], [2]])})
    with pytest.raises(TableSchemaError, match="not supported"):
        row_hashes(t, ["k"])


def test_to_table_converts_batches_structured_arrays_and_dataframes():
    rb = pa.record_batch({"a": [1, 2]})
    assert to_table(rb).equals(pa.table({"a": [1, 2]}))
    arr = np.zeros(3, dtype=[("k", "<i8"), ("v", "<f8")])
    arr["k"] = [1, 2, 3]
    t = to_table(arr)
    assert t.column_names == ["k", "v"] and t.column("k").to_pylist() == [1, 2, 3]
    with pytest.raises(TypeError, match="pyarrow Table"):
        to_table([1, 2])
    pd = pytest.importorskip("pandas")
    df = pd.DataFrame({"k": [3, 4], "s": ["a", "b"]}, index=[10, 11])
    # the index is dropped; pandas >= 3 stores strings as large_string, which the table keeps
    assert to_table(df).to_pydict() == {"k": [3, 4], "s": ["a", "b"]}
