"""The MPI channel's wire format: its four tags, message kinds and flags, the structs of headers
and control messages, and the functions that build and parse them (pure: no MPI, no channel state).

See the package docstring (:mod:`channels.mpi`) for what each message does."""

from __future__ import annotations

import logging
import struct
from typing import Any
from collections.abc import Sequence

from twisternet.channel import Buffer
from twisternet.errors import ProtocolError

from .. import shm_slots

log = logging.getLogger(__name__)


#: MPI tag of message headers, eager payloads and goodbyes.
TAG_DATA = 1
#: MPI tag of rendezvous payloads (the segments of messages larger than ``buffer_size``).
TAG_BULK = 2
#: MPI tag of batched credit returns and abort notices.
TAG_CTRL = 3
#: MPI tag of rendezvous payloads that go into the receiver's pre-posted payload receive.
TAG_PRE = 4

# Header of every TAG_DATA message: kind, flags (reserved, 0), page (rendezvous: where in a page the
# payload would start for its largest segment to sit where the sender's does; else 0), edge, size.
_HDR = struct.Struct("<BBHIQ")
_PAGE = 4096
# A rendezvous header continues with the number of segments and their lengths (u64 each).
_U32 = struct.Struct("<I")
_KIND_EAGER = 1
#: Rendezvous flag: the first segment (at most _INLINE_MAX bytes) travels in the header itself.
_FLAG_INLINE = 1
_INLINE_MAX = 4096
_KIND_RNDV = 2
#: Eager flag: credit returns ride along (piggybacked): after the header come a u32 count and that
#: many ``(edge, bytes)`` entries (_CREDIT_ENTRY), then the payload. Saves a control message (an
#: Isend, a completion and a reposted receive on each side) per small message in request/reply
#: traffic. Only when header, entries and payload fit one pool buffer.
_FLAG_CREDIT = 16
#: Most credit entries one eager message carries.
_PIGGY_MAX = 8
_KIND_BYE = 3
#: Rendezvous flag: the payload's one segment goes to the receiver's next pre-posted receive (TAG_PRE).
_FLAG_PRE = 2
#: With _FLAG_PRE: no message; an empty TAG_PRE send used up a pre-posted receive too small for the
#: next payload (so the next, bigger one, can be used).
_FLAG_SKIP = 4
# Control message: kind, count. Credit: count entries (edge, bytes) follow. Abort: count bytes of reason.
_CTRL_HDR = struct.Struct("<BxxxI")
_CREDIT_ENTRY = struct.Struct("<IQ")
#: The count and the one entry of an eager message carrying one credit return (the common case), and
#: where its payload starts.
_PIGGY_ONE = struct.Struct("<IIQ")
_PIGGY_ONE_END = _HDR.size + _PIGGY_ONE.size
#: A header and that one entry, packed at once.
_HDR_PIGGY_ONE = struct.Struct("<BBHIQIIQ")
assert _HDR_PIGGY_ONE.size == _PIGGY_ONE_END
_KIND_CREDIT = 4
_KIND_ABORT = 5
#: Control message: the receiver's offer of pre-posted payload receives (see MPIChannel._pre_offer).
_KIND_OFFER = 6
_OFFER = struct.Struct("<QQ")
#: Data message: a payload the sender put into one of our shared-memory slots (channels.shm_slots).
#: The header continues with _SLOT_EXT (slot id, bytes of head) and the head itself.
_KIND_SLOT = 7
_SLOT_EXT = struct.Struct("<II")
#: Slot header flag: the payload is split (_SLOT_SPLIT after _SLOT_EXT: where); the sender copies the
#: part before that offset into the slot itself while the part after it comes on TAG_BULK, received
#: straight into the slot, so both processes copy at once; _KIND_SLOT_DONE says the sender's part is in.
_FLAG_SPLIT = 8
_SLOT_SPLIT = struct.Struct("<Q")
_KIND_SLOT_DONE = 12
#: Data message: the sender's answer about one of our slots (flags: _ANSWERS; edge field: slot id).
#: On the data tag, so it stays in order with the headers that fill the slot.
_KIND_SLOT_ANSWER = 8
_ANSWERS = {1: "ack", 2: "refuse", 3: "retired"}
_ANSWER_CODES = {v: k for k, v in _ANSWERS.items()}
#: Control messages about shared-memory slots: an offer (_SLOT_OFFER, then the file's path), grants
#: and retirements (count slot ids, u32 each).
_KIND_SLOT_OFFER = 9
_KIND_SLOT_GRANT = 10
_KIND_SLOT_RETIRE = 11
#: Control message: a heartbeat (no body). Every rank sends one to each live peer every
#: ``heartbeat_interval`` seconds; a peer heard from neither by data nor by heartbeat for
#: ``peer_timeout`` seconds is reported lost (the same keys and meaning as the TCP channel).
_KIND_HEARTBEAT = 13
_HEARTBEAT_MSG = _CTRL_HDR.pack(_KIND_HEARTBEAT, 0)
_SLOT_OFFER = struct.Struct(f"<IQQ{shm_slots.NONCE}s")
_CTRL_BUF_SIZE = 4096
_SLOT_IDS_MAX = (_CTRL_BUF_SIZE - _CTRL_HDR.size) // 4
_CREDIT_MAX_ENTRIES = (_CTRL_BUF_SIZE - _CTRL_HDR.size) // _CREDIT_ENTRY.size
#: Parts smaller than this are joined (copied) into one segment of a rendezvous message.
_COALESCE = 64 << 10
#: Largest block of an hindexed datatype (keeps every block length a 32-bit int).
_MAX_BLOCK = 1 << 30


def _byte_view(part: Buffer) -> memoryview:
    """A flat unsigned-byte view of one message part (raises TypeError for non-contiguous memory)."""
    mv = part if isinstance(part, memoryview) else memoryview(part)
    if mv.format != "B" or mv.ndim != 1:
        try:
            mv = mv.cast("B")
        except TypeError:
            raise TypeError(f"message parts must be C-contiguous buffers; got {type(part).__name__} "
                            f"with shape {mv.shape} and strides {mv.strides}") from None
    return mv


def _encode_credit(items: Sequence[tuple[int, int]]) -> list[bytes]:
    """Credit-return messages carrying ``(edge, bytes)`` pairs, as many as the control buffers need."""
    out = []
    for start in range(0, len(items), _CREDIT_MAX_ENTRIES):
        chunk = items[start:start + _CREDIT_MAX_ENTRIES]
        out.append(b"".join([_CTRL_HDR.pack(_KIND_CREDIT, len(chunk)),
                             *(_CREDIT_ENTRY.pack(edge, nbytes) for edge, nbytes in chunk)]))
    return out


def _encode_piggy(items: Sequence[tuple[int, int]]) -> bytes:
    """The credit entries an eager message flagged _FLAG_CREDIT carries after its header (one entry,
    the common case, is packed with the header: MPIChannel._eager_wire, _HDR_PIGGY_ONE)."""
    return b"".join([_U32.pack(len(items)), *(_CREDIT_ENTRY.pack(edge, nbytes) for edge, nbytes in items)])


def _decode_piggy(buf: Buffer, size: int, peer: int) -> tuple[int, list[tuple[int, int]]]:
    """``(offset of the payload, [(edge, bytes), ...])`` of an eager message flagged _FLAG_CREDIT
    whose payload has ``size`` bytes (validated: a malformed one raises ProtocolError). One entry, the
    common case, is read with the header instead (ReceiveMixin._data_received, _PIGGY_ONE)."""
    mv = memoryview(buf)
    (n,) = _U32.unpack_from(mv, _HDR.size)
    start = _HDR.size + _U32.size
    off = start + n * _CREDIT_ENTRY.size
    if not 0 < n <= _PIGGY_MAX or off + size > mv.nbytes:
        raise ProtocolError(f"eager message from rank {peer} with {n} piggybacked credit entries")
    return off, [_CREDIT_ENTRY.unpack_from(mv, start + i * _CREDIT_ENTRY.size) for i in range(n)]


def _encode_abort(reason: str) -> bytes:
    """An abort notice carrying (a prefix of) ``reason`` that fits one control buffer."""
    text = reason.encode("utf-8", "replace")[:_CTRL_BUF_SIZE - _CTRL_HDR.size]
    text = text.decode("utf-8", "ignore").encode("utf-8")  # do not cut a character in half
    return _CTRL_HDR.pack(_KIND_ABORT, len(text)) + text


def _encode_offer(first: int, cap: int) -> bytes:
    """An offer of pre-posted receives: those numbered ``first`` on hold ``cap`` bytes or more."""
    return _CTRL_HDR.pack(_KIND_OFFER, 0) + _OFFER.pack(first, cap)


def _encode_slot_offer(offer: shm_slots.Offer) -> bytes:
    """An offer of one shared-memory slot (see channels.shm_slots)."""
    path = offer.path.encode()
    if _CTRL_HDR.size + _SLOT_OFFER.size + len(path) > _CTRL_BUF_SIZE:
        raise ValueError(f"slot path too long: {offer.path!r}")
    return (_CTRL_HDR.pack(_KIND_SLOT_OFFER, len(path))
            + _SLOT_OFFER.pack(offer.slot, offer.cap, offer.size, offer.nonce) + path)


def _encode_slot_ids(kind: int, ids: Sequence[int]) -> list[bytes]:
    """Grants or retirements (``kind``) of the slots ``ids``, as many messages as control buffers need."""
    return [_CTRL_HDR.pack(kind, len(chunk)) + struct.pack(f"<{len(chunk)}I", *chunk)
            for chunk in (ids[i:i + _SLOT_IDS_MAX] for i in range(0, len(ids), _SLOT_IDS_MAX))]


def _encode_slot_answer(slot: int, answer: str) -> bytes:
    """The sender's answer ("ack", "refuse", "retired") about the receiver's slot ``slot``."""
    return _HDR.pack(_KIND_SLOT_ANSWER, _ANSWER_CODES[answer], 0, slot, 0)


def _decode_ctrl(buf: Buffer) -> tuple[int, Any]:
    """Parse a control message: ``(_KIND_CREDIT, [(edge, bytes), ...])``, ``(_KIND_ABORT, reason)``,
    ``(_KIND_OFFER, (first, cap))``, ``(_KIND_SLOT_OFFER, Offer)`` or ``(_KIND_SLOT_GRANT or
    _KIND_SLOT_RETIRE, [slot ids])``."""
    mv = memoryview(buf)
    if mv.nbytes < _CTRL_HDR.size:
        raise ProtocolError(f"control message of {mv.nbytes} bytes is shorter than its header")
    kind, n = _CTRL_HDR.unpack_from(mv, 0)
    if kind == _KIND_SLOT_OFFER:
        end = _CTRL_HDR.size + _SLOT_OFFER.size + n
        if end > mv.nbytes:
            raise ProtocolError("truncated slot offer")
        slot, cap, size, nonce = _SLOT_OFFER.unpack_from(mv, _CTRL_HDR.size)
        try:
            path = bytes(mv[_CTRL_HDR.size + _SLOT_OFFER.size:end]).decode()
        except UnicodeDecodeError:
            raise ProtocolError("slot offer with a path that is not UTF-8") from None
        return kind, shm_slots.Offer(slot, cap, size, nonce, path)
    if kind in (_KIND_SLOT_GRANT, _KIND_SLOT_RETIRE):
        if n > _SLOT_IDS_MAX or _CTRL_HDR.size + 4 * n > mv.nbytes:
            raise ProtocolError(f"malformed slot message ({n} ids)")
        return kind, list(struct.unpack_from(f"<{n}I", mv, _CTRL_HDR.size))
    if kind == _KIND_ABORT:
        if _CTRL_HDR.size + n > mv.nbytes:
            raise ProtocolError("abort notice longer than its message")
        return kind, bytes(mv[_CTRL_HDR.size:_CTRL_HDR.size + n]).decode("utf-8", "replace")
    if kind == _KIND_HEARTBEAT:
        return kind, ()
    if kind == _KIND_OFFER:
        if _CTRL_HDR.size + _OFFER.size > mv.nbytes:
            raise ProtocolError("truncated pre-post offer")
        return kind, _OFFER.unpack_from(mv, _CTRL_HDR.size)
    if kind != _KIND_CREDIT or n > _CREDIT_MAX_ENTRIES or _CTRL_HDR.size + n * _CREDIT_ENTRY.size > mv.nbytes:
        raise ProtocolError(f"malformed control message (kind {kind}, {n} entries)")
    return kind, [_CREDIT_ENTRY.unpack_from(mv, _CTRL_HDR.size + i * _CREDIT_ENTRY.size) for i in range(n)]


def _segments(views: list[memoryview]) -> list[Buffer]:
    """The contiguous MPI messages that carry a rendezvous payload, in order: each large part as is
    (cut at 1 GiB), runs of small parts joined into one copy. Contiguous sends let MPI use its
    single-copy path; non-contiguous datatypes are pipelined through small chunks instead."""
    out: list[Buffer] = []
    run: list[memoryview] = []
    for v in views:
        n = v.nbytes
        if n == 0:
            continue
        if n < _COALESCE:
            run.append(v)
            continue
        if run:
            out.append(b"".join(run) if len(run) > 1 else run[0])
            run = []
        for off in range(0, n, _MAX_BLOCK):
            out.append(v[off:off + _MAX_BLOCK] if n > _MAX_BLOCK else v)
    if run:
        out.append(b"".join(run) if len(run) > 1 else run[0])
    return out


def _rndv_header(edge: int, size: int, lengths: Sequence[int], page: int = 0, inline: Buffer = b"",
                 flags: int = 0) -> bytes:
    """Header announcing a rendezvous message of ``size`` bytes that follows as ``lengths`` segments;
    ``page``: the receiver's preferred offset of the payload within a page (0 to 4095); ``inline``:
    the first segment's bytes, carried by the header itself (then only the others follow)."""
    return b"".join((_HDR.pack(_KIND_RNDV, flags | (_FLAG_INLINE if inline else 0), page, edge, size),
                     _U32.pack(len(lengths)), struct.pack(f"<{len(lengths)}Q", *lengths), inline))


def _rndv_inline(buf: Buffer, lengths: Sequence[int], peer: int) -> int:
    """Where in a rendezvous header (flagged _FLAG_INLINE) its inline first segment starts, checked:
    others must follow it, and it must be small and inside the header."""
    start = _HDR.size + _U32.size + 8 * len(lengths)
    if len(lengths) < 2 or lengths[0] > _INLINE_MAX or start + lengths[0] > memoryview(buf).nbytes:
        raise ProtocolError(f"rendezvous header from rank {peer} with a bad inline segment")
    return start


def _pre_cap(n: int) -> int:
    """Capacity of the pre-posted receives offered for payloads of ``n`` bytes: at most 1/8 more,
    in steps of at least 64 KiB (0 for 0)."""
    grain = 1 << max(16, n.bit_length() - 4)
    return -(-n // grain) * grain


def _slot_parts(segments: list[Buffer], pool_buf_size: int) -> tuple[Buffer, list[Buffer], int]:
    """``(head, body, bytes of body)`` of a message going into a shared-memory slot: a small first
    segment (the codec's head) travels in the header, so the payload after it lands page-aligned."""
    if len(segments) > 1:
        n = memoryview(segments[0]).nbytes
        if n <= _INLINE_MAX and _HDR.size + _SLOT_EXT.size + n <= pool_buf_size:
            return segments[0], segments[1:], sum(memoryview(s).nbytes for s in segments[1:])
    return b"", segments, sum(memoryview(s).nbytes for s in segments)


def _rndv_lengths(buf: Buffer, size: int) -> tuple[int, ...]:
    """The segment lengths announced by a rendezvous header (validated against ``size``)."""
    mv = memoryview(buf)
    (n,) = _U32.unpack_from(mv, _HDR.size)
    start = _HDR.size + _U32.size
    if n == 0 or start + 8 * n > mv.nbytes:
        raise ProtocolError(f"rendezvous header announces {n} segments")
    lengths = struct.unpack_from(f"<{n}Q", mv, start)
    if sum(lengths) != size or not all(lengths):
        raise ProtocolError(f"rendezvous segments {lengths[:8]}... do not add up to {size} bytes")
    return lengths

