"""Framing of a master link: length-prefixed msgpack maps (u32 length, at most :data:`MAX_MESSAGE` bytes).

After the token handshake (:func:`twisternet.auth.handshake`; the worker's hello is ``{"kind": "worker",
"rank": r|None, "world": n|None, "listen": {...}, "host_id": str, "pid": int}``, the master's
``{"kind": "master", "world": n}``) each message is a map with a ``"type"``:

* master -> worker: ``table`` (rank, world, table: one entry per rank), ``error`` (join refused:
  ``message``, ``key`` naming the offending setting, or ``rank``/``reason`` of a lost peer, or
  ``timeout`` when the job did not assemble in time), ``hb``, ``peer_lost`` (rank, reason, place:
  ``rank R on HOST (ADDRESS; ranks on that host: ...)``), ``service`` (a reply from a master-side
  service), ``shutdown``.
* worker -> master: ``hb``, ``bye`` (clean leave), ``abort`` (reason: why this worker fails; its link
  drops next and the others hear of its loss with that reason), and service requests
  ``{"service": name, ...}``.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

from twisternet.errors import ProtocolError

#: Largest message (encoded bytes) accepted on a master link.
MAX_MESSAGE = 16 << 20
#: Longest reason (characters) a worker's ``abort`` message may give.
MAX_REASON = 2000
_LEN = struct.Struct("!I")


def encode_message(msg: dict[str, Any]) -> bytes:
    """One frame of a master link: u32 length + msgpack map. Raises ValueError if too large."""
    if not isinstance(msg, dict):
        raise TypeError(f"a master-link message must be a dict, got {type(msg).__name__}")
    try:
        body: bytes = msgpack.packb(msg, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"message is not msgpack-serializable: {e}") from None
    if len(body) > MAX_MESSAGE:
        raise ValueError(f"message of {len(body)} bytes exceeds the master-link limit of {MAX_MESSAGE}")
    return _LEN.pack(len(body)) + body


class FrameReader:
    """Reassembles length-prefixed msgpack maps from a byte stream."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Append received bytes; return the complete messages. ProtocolError on malformed input."""
        self._buf += data
        out: list[dict[str, Any]] = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if n > MAX_MESSAGE:
                raise ProtocolError(f"message of {n} bytes exceeds the master-link limit of {MAX_MESSAGE}")
            if len(self._buf) < _LEN.size + n:
                break
            body = bytes(self._buf[_LEN.size:_LEN.size + n])
            del self._buf[:_LEN.size + n]
            try:
                msg = msgpack.unpackb(body, raw=False, strict_map_key=False)
            except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types on corrupt input
                raise ProtocolError(f"undecodable message on the master link: {e}") from None
            if not isinstance(msg, dict):
                raise ProtocolError(f"master-link message must be a map, got {type(msg).__name__}")
            out.append(msg)
        return out

