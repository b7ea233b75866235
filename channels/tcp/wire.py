"""The TCP channel's frame format: ``u8 type | u32 edge | u64 length | payload``, and its limits.

``DATA`` carries one message; ``CREDIT`` returns ``length`` bytes of credit for ``edge`` (no payload);
``HEARTBEAT`` keeps an idle link alive; ``BYE`` says the sender leaves cleanly; ``ABORT`` says it
fails, with why (UTF-8 payload of at most :data:`MAX_ABORT_REASON` bytes).
"""

from __future__ import annotations

import struct

from twisternet.errors import ProtocolError

HDR = struct.Struct("<BIQ")
HEADER_SIZE = HDR.size
DATA, CREDIT, HEARTBEAT, BYE, ABORT = 1, 2, 3, 4, 5
KINDS = (DATA, CREDIT, HEARTBEAT, BYE, ABORT)
#: Kinds whose frame has a payload after the header.
WITH_PAYLOAD = (DATA, ABORT)
#: Longest reason (encoded bytes) an ABORT frame carries.
MAX_ABORT_REASON = 4096
#: Largest payload length a header may announce.
MAX_FRAME = 1 << 48


def header(kind: int, edge: int = 0, length: int = 0) -> bytes:
    """The header of one frame."""
    return HDR.pack(kind, edge, length)


def check_header(rank: int, kind: int, length: int) -> None:
    """ProtocolError unless ``(kind, length)`` is a frame the peer (``rank``) may send."""
    if kind not in KINDS or length > MAX_FRAME or (kind == ABORT and length > MAX_ABORT_REASON):
        raise ProtocolError(f"rank {rank}: bad frame header (type {kind}, length {length})")
