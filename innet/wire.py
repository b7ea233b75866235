"""The ATP packet: bit-exact encoding of the gradient / parameter header and its int32 payload.

Byte layout (network byte order, big-endian; offsets in bytes; 16-byte header then the payload)::

    0        4        8                10               12               16
    +--------+--------+----------------+----------------+----------------+----------- - -
    |bitmap0 |bitmap1 |     flags      |aggregatorIndex |  jobID+seq     | value[0..V-1]
    | u32    | u32    |      u16       |      u16       |     u32        | V x int32
    +--------+--------+----------------+----------------+----------------+----------- - -

``flags`` (u16), most significant bit first, in the order of the ATP header::

    bits 15..11  fanInDegree0 (5)      bit 5  overflow
    bits 10..6   fanInDegree1 (5)      bit 4  resend
                                       bit 3  collision
                                       bit 2  ecn
                                       bit 1  edgeSwitchIdentifier
                                       bit 0  isAck

A fan-in degree is 1..32; 32 does not fit 5 bits and is encoded as 0 (a fan-in of 0 is meaningless).

``jobID+seq`` (u32): the job id in the top 8 bits, the fragment sequence number in the low 24 bits
(``job_seq = job_id << 24 | seq``). Job ids are 1..255: job 0 is reserved, because a job_seq of 0 marks a
free aggregator in the switch. Sequence numbers wrap modulo 2**24; a sender must never have two
fragments whose sequence numbers are congruent modulo 2**24 in flight at once (the worker's window is
at most a few thousand fragments, far below 2**24), so a wrapped number is never confused with a live one.

The payload is ``V`` 32-bit values (``V`` = the switch-wide value count, default 62 = 248 bytes, as in
ATP). Gradient packets carry int32 quantized values, or float32 bit patterns when ``overflow`` is set;
parameter (ACK, ``isAck``) packets carry the float32 result of the reduction.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, replace
from typing import NamedTuple
from collections.abc import Sequence

import numpy as np

from twisternet.errors import ProtocolError

__all__ = [
    "DEFAULT_VALUE_COUNT", "HEADER_SIZE", "MAX_FAN_IN", "SEQ_BITS", "SEQ_MASK", "MAX_JOB_ID",
    "WireError", "Header", "Packet", "pack_job_seq", "unpack_job_seq", "encode_flags", "decode_flags",
    "encode_fan_in", "decode_fan_in", "encode", "encode_header", "decode", "decode_header",
    "payload_view", "packet_size", "HEADER_DTYPE", "decode_batch",
    "FLAG_OVERFLOW", "FLAG_RESEND", "FLAG_COLLISION", "FLAG_ECN", "FLAG_EDGE", "FLAG_ACK",
]

DEFAULT_VALUE_COUNT = 62
HEADER_SIZE = 16
MAX_FAN_IN = 32
SEQ_BITS = 24
SEQ_MASK = (1 << SEQ_BITS) - 1
MAX_JOB_ID = 255

FLAG_OVERFLOW = 1 << 5
FLAG_RESEND = 1 << 4
FLAG_COLLISION = 1 << 3
FLAG_ECN = 1 << 2
FLAG_EDGE = 1 << 1
FLAG_ACK = 1 << 0
_FAN0_SHIFT = 11
_FAN1_SHIFT = 6

_HEADER = struct.Struct("!IIHHI")

#: numpy dtype of the 16-byte header, for vectorised decoding of many packets.
HEADER_DTYPE = np.dtype([("bitmap0", ">u4"), ("bitmap1", ">u4"), ("flags", ">u2"),
                         ("agg_index", ">u2"), ("job_seq", ">u4")])


class WireError(ProtocolError, ValueError):
    """Bytes that are not a valid ATP packet (wrong length, reserved job id, bad field value)."""


def pack_job_seq(job_id: int, seq: int) -> int:
    """Combine a job id (1..255) and a sequence number (wrapped modulo 2**24) into the 32-bit field."""
    if not 1 <= job_id <= MAX_JOB_ID:
        raise WireError(f"job id must be in 1..{MAX_JOB_ID}, got {job_id}")
    if seq < 0:
        raise WireError(f"sequence number must be >= 0, got {seq}")
    return (job_id << SEQ_BITS) | (seq & SEQ_MASK)


def unpack_job_seq(job_seq: int) -> tuple[int, int]:
    """Split the 32-bit jobID+seq field into (job_id, seq)."""
    return job_seq >> SEQ_BITS, job_seq & SEQ_MASK


def encode_fan_in(fan_in: int) -> int:
    """The 5-bit field value of a fan-in degree 1..32 (32 is encoded as 0)."""
    if not 1 <= fan_in <= MAX_FAN_IN:
        raise WireError(f"fan-in degree must be in 1..{MAX_FAN_IN}, got {fan_in}")
    return fan_in & 0x1F


def decode_fan_in(field_value: int) -> int:
    """The fan-in degree 1..32 of a 5-bit field value (0 means 32)."""
    return field_value if field_value else MAX_FAN_IN


class Header(NamedTuple):
    """The decoded 16-byte header; ``flags`` keeps the six flag bits as in the wire (see module doc)."""

    bitmap0: int
    bitmap1: int
    fan_in0: int
    fan_in1: int
    flags: int
    agg_index: int
    job_seq: int

    @property
    def job_id(self) -> int:
        return self.job_seq >> SEQ_BITS

    @property
    def seq(self) -> int:
        return self.job_seq & SEQ_MASK


def encode_flags(fan_in0: int, fan_in1: int, flags: int) -> int:
    """The u16 flags word from two fan-in degrees (1..32) and the six flag bits."""
    if flags & ~0x3F:
        raise WireError(f"flag bits out of range: {flags:#x}")
    return (encode_fan_in(fan_in0) << _FAN0_SHIFT) | (encode_fan_in(fan_in1) << _FAN1_SHIFT) | flags


def decode_flags(word: int) -> tuple[int, int, int]:
    """(fan_in0, fan_in1, flag_bits) of a u16 flags word."""
    return (decode_fan_in((word >> _FAN0_SHIFT) & 0x1F), decode_fan_in((word >> _FAN1_SHIFT) & 0x1F),
            word & 0x3F)


def packet_size(value_count: int) -> int:
    """Bytes of one packet carrying ``value_count`` 32-bit values."""
    return HEADER_SIZE + 4 * value_count


def _check_u32(name: str, value: int) -> None:
    if not 0 <= value <= 0xFFFFFFFF:
        raise WireError(f"{name} must fit 32 bits, got {value}")


def encode_header(bitmap0: int, bitmap1: int, fan_in0: int, fan_in1: int, flags: int,
                  agg_index: int, job_seq: int) -> bytes:
    """The 16 header bytes; fan-ins are degrees (1..32), ``flags`` the six flag bits."""
    _check_u32("bitmap0", bitmap0)
    _check_u32("bitmap1", bitmap1)
    if not 0 <= agg_index <= 0xFFFF:
        raise WireError(f"aggregator index must fit 16 bits, got {agg_index}")
    _check_u32("jobID+seq", job_seq)
    if job_seq >> SEQ_BITS == 0:
        raise WireError("job id 0 is reserved (a jobID+seq of job 0 marks a free aggregator)")
    return _HEADER.pack(bitmap0, bitmap1, encode_flags(fan_in0, fan_in1, flags), agg_index, job_seq)


def decode_header(data: bytes | bytearray | memoryview) -> Header:
    """Decode the header of a packet (at least 16 bytes); raises WireError on short data or job 0."""
    if len(data) < HEADER_SIZE:
        raise WireError(f"packet too short: {len(data)} bytes, the ATP header alone is {HEADER_SIZE}")
    b0, b1, word, idx, js = _HEADER.unpack_from(data, 0)
    if js >> SEQ_BITS == 0:
        raise WireError("garbled packet: job id 0 is reserved")
    f0, f1, fl = decode_flags(word)
    return Header(b0, b1, f0, f1, fl, idx, js)


def payload_view(data: bytes | bytearray | memoryview, value_count: int) -> np.ndarray:
    """The payload as a read-only big-endian int32 view (no copy); checks the packet length."""
    expected = packet_size(value_count)
    if len(data) != expected:
        raise WireError(f"packet is {len(data)} bytes, expected {expected} "
                        f"({HEADER_SIZE}-byte header + {value_count} x 4-byte values)")
    return np.frombuffer(data, dtype=">i4", count=value_count, offset=HEADER_SIZE)


@dataclass(frozen=True, eq=False)
class Packet:
    """A whole ATP packet, decoded. ``values`` is int32 (native order, length = value count).

    Compare packets by their wire bytes (``encode(a) == encode(b)``): the numpy payload has no scalar ==.
    """

    job_id: int
    seq: int
    values: np.ndarray = field(repr=False)
    bitmap0: int = 0
    bitmap1: int = 0
    fan_in0: int = 1
    fan_in1: int = 1
    agg_index: int = 0
    overflow: bool = False
    resend: bool = False
    collision: bool = False
    ecn: bool = False
    edge: bool = False
    is_ack: bool = False

    @property
    def job_seq(self) -> int:
        return pack_job_seq(self.job_id, self.seq)

    @property
    def flags(self) -> int:
        return ((FLAG_OVERFLOW if self.overflow else 0) | (FLAG_RESEND if self.resend else 0)
                | (FLAG_COLLISION if self.collision else 0) | (FLAG_ECN if self.ecn else 0)
                | (FLAG_EDGE if self.edge else 0) | (FLAG_ACK if self.is_ack else 0))

    def float_values(self) -> np.ndarray:
        """The payload reinterpreted as float32 (overflow gradients and parameter packets)."""
        return np.asarray(self.values, dtype=np.int32).view(np.float32)

    def with_(self, **changes) -> Packet:
        """A copy with some fields changed."""
        return replace(self, **changes)


def encode(packet: Packet) -> bytes:
    """The wire bytes of ``packet``; the payload length is the length of ``packet.values``."""
    values = np.asarray(packet.values)
    if values.ndim != 1:
        raise WireError(f"payload must be one-dimensional, got shape {values.shape}")
    if values.dtype == np.float32:
        values = values.view(np.int32)
    elif values.dtype != np.int32 and values.dtype != np.dtype(">i4"):
        if values.size and (values.min() < -2**31 or values.max() > 2**31 - 1):
            raise WireError("payload values do not fit int32")
        values = values.astype(np.int32)
    head = encode_header(packet.bitmap0, packet.bitmap1, packet.fan_in0, packet.fan_in1, packet.flags,
                         packet.agg_index, packet.job_seq)
    return head + values.astype(">i4", copy=False).tobytes()


def decode(data: bytes | bytearray | memoryview, value_count: int = DEFAULT_VALUE_COUNT) -> Packet:
    """Decode a whole packet; raises WireError when the length or a field is invalid."""
    h = decode_header(data)
    values = payload_view(data, value_count).astype(np.int32)
    fl = h.flags
    return Packet(job_id=h.job_id, seq=h.seq, values=values, bitmap0=h.bitmap0, bitmap1=h.bitmap1,
                  fan_in0=h.fan_in0, fan_in1=h.fan_in1, agg_index=h.agg_index,
                  overflow=bool(fl & FLAG_OVERFLOW), resend=bool(fl & FLAG_RESEND),
                  collision=bool(fl & FLAG_COLLISION), ecn=bool(fl & FLAG_ECN),
                  edge=bool(fl & FLAG_EDGE), is_ack=bool(fl & FLAG_ACK))


def decode_batch(packets: Sequence[bytes], value_count: int = DEFAULT_VALUE_COUNT
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Decode many packets at once: (headers as a HEADER_DTYPE array, int32 payloads of shape (n, V)).

    All packets must have the full length; one bad packet raises WireError naming its position.
    """
    size = packet_size(value_count)
    for i, p in enumerate(packets):
        if len(p) != size:
            raise WireError(f"packet {i} is {len(p)} bytes, expected {size}")
    n = len(packets)
    if n == 0:
        return np.zeros(0, HEADER_DTYPE), np.zeros((0, value_count), np.int32)
    raw = np.frombuffer(b"".join(packets), dtype=np.uint8).reshape(n, size)
    headers = raw[:, :HEADER_SIZE].copy().view(HEADER_DTYPE).reshape(n)
    bad = np.nonzero((headers["job_seq"] >> SEQ_BITS) == 0)[0]
    if bad.size:
        raise WireError(f"packet {int(bad[0])} is garbled: job id 0 is reserved")
    payload = raw[:, HEADER_SIZE:].copy().view(">i4").astype(np.int32)
    return headers, payload
