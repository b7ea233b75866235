"""Arrow tables and record batches through the codec: exact round trips, buffers out of band and not
copied, sliced arrays trimmed, and twisternet usable without pyarrow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
from hypothesis import given, settings, strategies as st

from twisternet.codec import Codec
from twisternet.errors import CodecError

ROOT = Path(__file__).resolve().parents[2]

_INTS = st.integers(-(1 << 63), (1 << 63) - 1)
_COLUMN_KINDS = {
    "int64": (pa.int64(), _INTS),
    "int8": (pa.int8(), st.integers(-128, 127)),
    "uint32": (pa.uint32(), st.integers(0, (1 << 32) - 1)),
    "float64": (pa.float64(), st.floats(allow_nan=False)),
    "float32": (pa.float32(), st.floats(width=32, allow_nan=False)),
    "bool": (pa.bool_(), st.booleans()),
    "string": (pa.string(), st.text(max_size=12)),
    "large_string": (pa.large_string(), st.text(max_size=12)),
    "binary": (pa.binary(), st.binary(max_size=12)),
    "large_binary": (pa.large_binary(), st.binary(max_size=12)),
    "fixed10": (pa.binary(10), st.binary(min_size=10, max_size=10)),
    "date32": (pa.date32(), st.dates()),
    "ts_us": (pa.timestamp("us"), st.datetimes()),
    "list_int": (pa.list_(pa.int32()), st.lists(st.integers(-1000, 1000), max_size=4)),
}


@st.composite
def tables(draw: st.DrawFn) -> pa.Table:
    n = draw(st.integers(0, 40))
    kinds = draw(st.lists(st.sampled_from(sorted(_COLUMN_KINDS)), min_size=1, max_size=4))
    cols = {}
    for i, kind in enumerate(kinds):
        typ, values = _COLUMN_KINDS[kind]
        vals = draw(st.lists(st.one_of(st.none(), values), min_size=n, max_size=n))
        arr = pa.array(vals, type=typ)
        if draw(st.booleans()) and kind in ("string", "int64", "binary"):
            arr = arr.dictionary_encode()
        cols[f"c{i}_{kind}"] = arr
    table = pa.table(cols)
    if draw(st.booleans()):                      # several chunks
        cut = draw(st.integers(0, n))
        table = pa.concat_tables([table.slice(0, cut), table.slice(cut)])
    if draw(st.booleans()):                      # a slice: offsets into the buffers
        lo = draw(st.integers(0, n))
        hi = draw(st.integers(lo, n))
        table = table.slice(lo, hi - lo)
    return table


def _roundtrip(value, threshold: int):
    codec = Codec(oob_threshold=threshold)
    record = bytearray(b"".join(bytes(memoryview(p)) for p in codec.encode(value)))
    out = codec.decode(record)
    return out, record


@settings(max_examples=150, deadline=None)
@given(tables(), st.sampled_from([0, 16, 1 << 20]))
def test_table_roundtrip_is_exact(table, threshold):
    out, _ = _roundtrip(table, threshold)
    assert isinstance(out, pa.Table)
    out.validate(full=True)
    assert out.schema.equals(table.schema, check_metadata=True)
    assert out.equals(table)


@settings(max_examples=50, deadline=None)
@given(tables())
def test_record_batch_roundtrip_is_exact(table):
    batch = table.combine_chunks().to_batches()
    batch = batch[0] if batch else pa.RecordBatch.from_pylist([], schema=table.schema)
    out, _ = _roundtrip(batch, 16)
    assert isinstance(out, pa.RecordBatch)
    out.validate(full=True)
    assert out.equals(batch)


def test_tables_nested_in_containers_and_metadata_kept():
    t = pa.table({"k": [1, 2, 3]}).replace_schema_metadata({"origin": "test"})
    out, _ = _roundtrip({"a": (t, 5), "b": [t.slice(1)]}, 0)
    assert out["a"][0].equals(t) and out["a"][1] == 5 and out["b"][0].equals(t.slice(1))
    assert out["a"][0].schema.metadata == {b"origin": b"test"}


def test_large_buffers_travel_out_of_band_without_copy():
    values = np.arange(1 << 18, dtype=np.int64)
    table = pa.table({"v": values, "s": pa.array([str(i) for i in range(1 << 18)])})
    parts = Codec().encode(table)
    data_buf = table.column("v").chunk(0).buffers()[1]
    # the int64 data part is the table's own buffer, not a copy
    assert any(memoryview(p).nbytes == data_buf.size and
               np.frombuffer(memoryview(p), dtype=np.uint8).ctypes.data == data_buf.address for p in parts)
    body = sum(memoryview(p).nbytes for p in parts[:3])
    assert body < 4096                              # schema and layout only, in band

    # decoding does not copy either: the column buffers lie inside the record
    record = bytearray(b"".join(bytes(memoryview(p)) for p in parts))
    out, views = Codec().decode_views(record)
    lo = np.frombuffer(record, dtype=np.uint8).ctypes.data
    addr = out.column("v").chunk(0).buffers()[1].address
    assert views and lo <= addr < lo + len(record)
    assert out.equals(table)
    # copy=True gives memory of its own
    out2, views2 = Codec().decode_views(record, copy=True)
    addr2 = out2.column("v").chunk(0).buffers()[1].address
    assert not views2 and not lo <= addr2 < lo + len(record)


def test_slices_send_only_their_rows():
    table = pa.table({"v": np.arange(1 << 20, dtype=np.int64), "s": pa.array(["abcdefgh"] * (1 << 20))})
    part = table.slice(1000, 10)
    size = sum(memoryview(p).nbytes for p in Codec(oob_threshold=0).encode(part))
    assert size < 4096
    out, _ = _roundtrip(part, 0)
    assert out.equals(part)


def test_own_copies_a_received_table_out_of_the_receive_buffer():
    from collectives.reduction import own
    table = pa.table({"v": np.arange(1 << 16, dtype=np.int64)})
    out, record = _roundtrip((7, table), 0)
    kept = own(out)
    record[:] = b"\0" * len(record)                 # the channel reuses its buffer
    assert kept[1].equals(table) and kept[0] == 7


def test_corrupt_arrow_record_is_a_codec_error():
    codec = Codec(oob_threshold=0)
    record = b"".join(bytes(memoryview(p)) for p in codec.encode(pa.table({"s": ["a", "bb"]})))
    assert record.count(b"flat") == 1
    with pytest.raises(CodecError, match="Arrow"):
        codec.decode(record.replace(b"flat", b"flax"))
    with pytest.raises(CodecError):
        codec.decode(record[:-1])


def test_twisternet_imports_and_explains_without_pyarrow():
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "import twisternet, collectives, twisternet.codec\n"
        "from twisternet.codec import Codec\n"
        "assert Codec().decode(Codec().encode_bytes({'a': [1, 2]})) == {'a': [1, 2]}\n"
        "from twisternet.arrowcodec import require_pyarrow\n"
        "from twisternet.errors import ArrowUnavailableError\n"
        "try:\n"
        "    require_pyarrow()\n"
        "except ArrowUnavailableError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'twisternet[arrow]'" in out.stdout


def test_table_api_without_pyarrow_says_how_to_install():
    code = (
        "import sys; sys.modules['pyarrow'] = None\n"
        "import collectives as C\n"
        "from twisternet.testing import run_local\n"
        "from twisternet.errors import ArrowUnavailableError\n"
        "import numpy as np\n"
        "def body(ctx):\n"
        "    with C.KeyedGather(ctx, edge=1) as op:\n"
        "        try:\n"
        "            op.send_table(op.local_sources[0], np.zeros(3, dtype=[('k', '<i8')]), key='k')\n"
        "        except ArrowUnavailableError as e:\n"
        "            msg = str(e)\n"
        "        for t in op.local_sources:\n"
        "            op.finish(t)\n"
        "        list(op.results())\n"
        "    return msg\n"
        "print(run_local(2, body, timeout=60)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'twisternet[arrow]'" in out.stdout
