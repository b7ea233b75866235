"""Buffer pool and framing: any records, any buffer size >= the header, round-trip exactly."""

import pytest
from hypothesis import given, settings, strategies as st

from twisternet.errors import ProtocolError
from twisternet.framing import LENGTH_HEADER, BufferPool, Packer, Unpacker


@given(st.lists(st.binary(max_size=300), max_size=40), st.integers(min_value=LENGTH_HEADER, max_value=128),
       st.lists(st.integers(min_value=0, max_value=5), max_size=40))
@settings(max_examples=400, deadline=None)
def test_any_records_any_buffer_size_round_trip(records, size, flush_points):
    pool = BufferPool(size, 10_000)
    packer, unpacker = Packer(pool), Unpacker()
    wire = []
    for i, r in enumerate(records):
        # split each record into a few parts, as the codec does
        cut = flush_points[i] if i < len(flush_points) else 0
        parts = [r[:cut], r[cut:]]
        for buf in packer.add(parts):
            assert len(buf) == size  # full buffers are exactly buffer_size
            wire.append(bytes(buf))
            pool.release(buf)
        if i < len(flush_points) and flush_points[i] == 0:
            got = packer.flush()
            if got:
                wire.append(bytes(got[1]))
                pool.release(got[0])
    got = packer.flush()
    if got:
        wire.append(bytes(got[1]))
        pool.release(got[0])
    out = [bytes(r) for r in unpacker.records(wire)]
    assert out == records
    assert not unpacker.partial


@given(st.lists(st.binary(min_size=1, max_size=64), min_size=1, max_size=20), st.data())
@settings(deadline=None)
def test_unpacker_accepts_arbitrary_chunking(records, data):
    pool = BufferPool(1 << 16, 4)
    packer = Packer(pool)
    assert packer.add([b"".join([])]) == [] or True
    stream = bytearray()
    packer2 = Packer(BufferPool(1 << 16, 4))
    for r in records:
        packer2.add([r])
    buf, view = packer2.flush()
    stream = bytes(view)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    chunks = [stream[a:b] for a, b in zip([0] + cuts, cuts + [len(stream)])]
    out = [bytes(r) for r in Unpacker().records(chunks)]
    assert out[1:] == records if out and out[0] == b"" else out == records


def test_pool_is_bounded_and_blocks():
    pool = BufferPool(64, 2)
    a, b = pool.acquire(), pool.acquire()
    assert pool.try_acquire() is None and pool.acquire(timeout=0.05) is None
    pool.release(a)
    assert pool.acquire(timeout=0.05) is a
    with pytest.raises(ValueError):
        pool.release(bytearray(10))
    pool.release(b)


def test_packer_never_overdraws_the_pool():
    pool = BufferPool(16, 2)
    packer = Packer(pool)
    assert packer.space_needed(100) > 2
    with pytest.raises(RuntimeError):
        packer.add([b"x" * 100])
    assert pool.available == 2  # nothing leaked by the failed add


def test_corrupt_length_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        Unpacker(max_record=1000).feed(b"\xff" * 16)
