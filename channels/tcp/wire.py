"""The TCP channel's frame format: ``u8 type | u32 edge | u64 length | payload``, and its limits.

``DATA`` carries one message; ``CREDIT`` returns ``length`` bytes of credit for ``edge`` (no payload);
``DATA_CREDIT`` is a CREDIT and a DATA frame in one (a small message carrying the one credit return its
sender owed the receiver): its payload is ``u32 credit edge | u64 credit bytes`` (:data:`CREDIT_ENTRY`)
then the message, and ``length`` counts both;
``HEARTBEAT`` keeps an idle link alive; ``BYE`` says the sender leaves cleanly; ``ABORT`` says it
fails, with why (UTF-8 payload of at most :data:`MAX_ABORT_REASON` bytes).
"""

from __future__ import annotations

import struct

from twisternet.errors import ProtocolError

#: Version of this frame protocol, in every peer link's hello (see mesh.build_mesh): 2 since DATA_CREDIT.
#: A peer of another version (or none: before 2) is refused, as it would not read every frame it gets.
WIRE_VERSION = 2

HDR = struct.Struct("<BIQ")
HEADER_SIZE = HDR.size
DATA, CREDIT, HEARTBEAT, BYE, ABORT, DATA_CREDIT = 1, 2, 3, 4, 5, 6
KINDS = (DATA, CREDIT, HEARTBEAT, BYE, ABORT, DATA_CREDIT)
#: Kinds whose frame has a payload after the header.
WITH_PAYLOAD = (DATA, ABORT, DATA_CREDIT)
#: The credit return at the start of a DATA_CREDIT frame's payload: edge, bytes.
CREDIT_ENTRY = struct.Struct("<IQ")
#: A DATA_CREDIT frame's header and credit return, packed at once: kind, edge, length, credit edge, bytes.
HDR_CREDIT = struct.Struct("<BIQIQ")
#: Longest reason (encoded bytes) an ABORT frame carries.
MAX_ABORT_REASON = 4096
#: Largest payload length a header may announce.
MAX_FRAME = 1 << 48


def header(kind: int, edge: int = 0, length: int = 0) -> bytes:
    """The header of one frame."""
    return HDR.pack(kind, edge, length)


def check_wire_version(hello: dict, peer: object) -> None:
    """ProtocolError unless the peer's hello speaks this frame protocol (:data:`WIRE_VERSION`)."""
    theirs = hello.get("wire", 1)
    if theirs != WIRE_VERSION:
        raise ProtocolError(f"{peer} speaks the TCP channel's frame protocol version {theirs!r}, this process "
                            f"speaks {WIRE_VERSION}: run the same twisternet version on every rank")


def check_header(rank: int, kind: int, length: int) -> None:
    """ProtocolError unless ``(kind, length)`` is a frame the peer (``rank``) may send."""
    if (kind not in KINDS or length > MAX_FRAME or (kind == ABORT and length > MAX_ABORT_REASON)
            or (kind == DATA_CREDIT and length < CREDIT_ENTRY.size)):
        raise ProtocolError(f"rank {rank}: bad frame header (type {kind}, length {length})")
