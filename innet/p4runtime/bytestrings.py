"""P4Runtime binary strings: decode with bitwidth checks (canonical or zero-padded), encode canonically.

The spec (section "Bytestrings") requires servers to accept any big-endian encoding whose value fits the
P4Info bitwidth (so padded strings from older clients, e.g. p4runtime-shell without canonical mode, are
fine), to reject empty strings and values that do not fit with OUT_OF_RANGE, and to answer with the
shortest encoding (read-write symmetry).
"""

from __future__ import annotations

from .errors import out_of_range


def decode_uint(data: bytes, bitwidth: int, what: str) -> int:
    """Return the unsigned value of ``data``; OUT_OF_RANGE if empty or wider than ``bitwidth`` bits."""
    if len(data) == 0:
        raise out_of_range(f"{what}: empty bytestring")
    value = int.from_bytes(data, "big")
    if value.bit_length() > bitwidth:
        raise out_of_range(f"{what}: value {value} (0x{data.hex()}) does not fit in {bitwidth} bits")
    return value


def encode_uint(value: int, bitwidth: int | None = None) -> bytes:
    """Canonical (shortest) big-endian encoding of a non-negative ``value``; 0 encodes as one zero byte."""
    if value < 0:
        raise ValueError(f"cannot encode negative value {value} as an unsigned bytestring")
    if bitwidth is not None and value.bit_length() > bitwidth:
        raise ValueError(f"value {value} does not fit in {bitwidth} bits")
    return value.to_bytes(max(1, (value.bit_length() + 7) // 8), "big")


def to_canonical(data: bytes) -> bytes:
    """Strip leading zero bytes, keeping one byte for zero (what p4runtime-shell's canonical mode sends)."""
    stripped = data.lstrip(b"\x00")
    return stripped if stripped else data[:1]
