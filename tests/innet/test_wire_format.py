"""Properties of the ATP wire format: round trip, exact bit positions, rejection of bad packets."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from innet.wire import (DEFAULT_VALUE_COUNT, HEADER_SIZE, Packet, WireError, decode, decode_batch,
                        decode_header, encode, encode_header, pack_job_seq, packet_size, unpack_job_seq)

u32 = st.integers(0, 2**32 - 1)
fan = st.integers(1, 32)


@st.composite
def packets(draw, value_count=None):
    v = value_count if value_count is not None else draw(st.integers(1, 80))
    vals = draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=v, max_size=v))
    return Packet(job_id=draw(st.integers(1, 255)), seq=draw(st.integers(0, 2**24 - 1)),
                  values=np.array(vals, np.int32), bitmap0=draw(u32), bitmap1=draw(u32),
                  fan_in0=draw(fan), fan_in1=draw(fan), agg_index=draw(st.integers(0, 65535)),
                  overflow=draw(st.booleans()), resend=draw(st.booleans()), collision=draw(st.booleans()),
                  ecn=draw(st.booleans()), edge=draw(st.booleans()), is_ack=draw(st.booleans()))


def _same(a: Packet, b: Packet) -> bool:
    fields = ("job_id", "seq", "bitmap0", "bitmap1", "fan_in0", "fan_in1", "agg_index", "overflow",
              "resend", "collision", "ecn", "edge", "is_ack")
    return all(getattr(a, f) == getattr(b, f) for f in fields) and np.array_equal(a.values, b.values)


@settings(max_examples=100, deadline=None)
@given(packets())
def test_round_trip(p: Packet) -> None:
    data = encode(p)
    assert len(data) == packet_size(len(p.values))
    assert _same(decode(data, len(p.values)), p)


@settings(max_examples=100, deadline=None)
@given(packets())
def test_fields_at_documented_bit_positions(p: Packet) -> None:
    """Rebuild the header independently from the documented layout and compare bytes."""
    data = encode(p)
    word = ((p.fan_in0 % 32) << 11) | ((p.fan_in1 % 32) << 6) | (p.overflow << 5) | (p.resend << 4) \
        | (p.collision << 3) | (p.ecn << 2) | (p.edge << 1) | int(p.is_ack)
    expect = (p.bitmap0.to_bytes(4, "big") + p.bitmap1.to_bytes(4, "big") + word.to_bytes(2, "big")
              + p.agg_index.to_bytes(2, "big") + ((p.job_id << 24) | p.seq).to_bytes(4, "big"))
    assert data[:HEADER_SIZE] == expect
    assert data[HEADER_SIZE:] == b"".join(int(v).to_bytes(4, "big", signed=True) for v in p.values)


def test_hand_computed_packet() -> None:
    p = Packet(job_id=3, seq=0x000102, values=np.array([1, -1], np.int32), bitmap0=0x80000001,
               bitmap1=0x2, fan_in0=4, fan_in1=32, agg_index=0xBEEF, resend=True, is_ack=True)
    data = encode(p)
    # fanIn0=4 -> 00100, fanIn1=32 -> 00000, overflow 0 resend 1 collision 0 ecn 0 edge 0 ack 1
    # = 0b00100_00000_010001 = 0x2011
    assert data.hex() == ("80000001" "00000002" "2011" "beef" "03000102" "00000001" "ffffffff")


def test_job_seq_split_and_wrap() -> None:
    assert pack_job_seq(1, 0) == 1 << 24
    assert pack_job_seq(255, 2**24 - 1) == 0xFFFFFFFF
    assert unpack_job_seq(pack_job_seq(7, 2**24 + 5)) == (7, 5)      # seq wraps modulo 2**24
    with pytest.raises(WireError, match="job id"):
        pack_job_seq(0, 1)
    with pytest.raises(WireError, match="job id"):
        pack_job_seq(256, 1)


@settings(max_examples=100, deadline=None)
@given(packets(value_count=DEFAULT_VALUE_COUNT), st.integers(0, 100))
def test_rejects_wrong_length(p: Packet, cut: int) -> None:
    data = encode(p)
    short = data[:cut] if cut < len(data) else data + b"\0"
    with pytest.raises(WireError):
        decode(short, DEFAULT_VALUE_COUNT)


@settings(max_examples=50, deadline=None)
@given(packets(value_count=4))
def test_rejects_reserved_job_zero(p: Packet) -> None:
    data = bytearray(encode(p))
    data[12] = 0                       # top byte of jobID+seq = job id
    with pytest.raises(WireError, match="job id 0"):
        decode(bytes(data), 4)
    with pytest.raises(WireError):
        decode_header(bytes(data))


def test_encode_rejects_bad_fields() -> None:
    with pytest.raises(WireError, match="fan-in"):
        encode_header(1, 1, 33, 1, 0, 0, 1 << 24)
    with pytest.raises(WireError, match="aggregator index"):
        encode_header(1, 1, 1, 1, 0, 70000, 1 << 24)
    with pytest.raises(WireError, match="bitmap0"):
        encode_header(2**32, 1, 1, 1, 0, 0, 1 << 24)
    with pytest.raises(WireError, match="reserved"):
        encode_header(1, 1, 1, 1, 0, 0, 5)
    with pytest.raises(WireError, match="int32"):
        encode(Packet(1, 0, np.array([2**31], np.int64)))
    with pytest.raises(WireError, match="too short"):
        decode_header(b"\x01\x02")


def test_float_payload_round_trip() -> None:
    f = np.array([1.5, -np.inf, np.nan, 3e38], np.float32)
    data = encode(Packet(1, 1, f, overflow=True))
    back = decode(data, 4).float_values()
    assert np.array_equal(back.view(np.int32), f.view(np.int32))


@settings(max_examples=50, deadline=None)
@given(st.lists(packets(value_count=5), min_size=0, max_size=20))
def test_batch_decoder_matches_single(ps: list[Packet]) -> None:
    datas = [encode(p) for p in ps]
    heads, payload = decode_batch(datas, 5)
    assert heads.shape == (len(ps),) and payload.shape == (len(ps), 5)
    for i, d in enumerate(datas):
        b0, b1, word, idx, js = struct.unpack("!IIHHI", d[:16])
        assert (heads["bitmap0"][i], heads["bitmap1"][i], heads["flags"][i], heads["agg_index"][i],
                heads["job_seq"][i]) == (b0, b1, word, idx, js)
        assert np.array_equal(payload[i], decode(d, 5).values)


def test_batch_decoder_rejects_bad_packet() -> None:
    good = encode(Packet(1, 1, np.zeros(3, np.int32)))
    with pytest.raises(WireError, match="packet 1"):
        decode_batch([good, good[:-1]], 3)
    bad = bytearray(good)
    bad[12] = 0
    with pytest.raises(WireError, match="packet 0"):
        decode_batch([bytes(bad), good], 3)
