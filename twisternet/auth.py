"""Mutual job-token authentication of one stream connection (TCP or Unix), with authenticated hellos.

Every connection twisternet opens (worker to bootstrap master, worker to worker) starts with this
handshake, so a process that does not hold the job token learns nothing it could use and can never get
its bytes accepted. Wire format (all integers big-endian)::

    both sides, first:  MAGIC (4 bytes b"TNA1") | VERSION (u8) | nonce (32 random bytes)
    both sides, then:   mac (32 bytes) | hello length (u32, <= MAX_HELLO) | hello (msgpack map)

    mac = HMAC-SHA256(token, CONTEXT | role | initiator nonce | acceptor nonce | SHA-256(hello bytes))

``role`` is the *sender's* role (``b"initiator"`` or ``b"acceptor"``), so a MAC reflected back to its
author never verifies; both fresh nonces make every MAC single-use (no replay). Each side checks the
peer's MAC with :func:`hmac.compare_digest` before decoding its hello. The two sides send
simultaneously, so a hello is seen (but never accepted) by a peer that fails the proof: hellos must not
carry secrets, only addresses and such.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import time
from typing import Any

import msgpack

from .errors import AuthError, ProtocolError

__all__ = ["handshake", "PeerClosedDuringHandshake", "MAGIC", "VERSION", "MAX_HELLO", "NONCE_SIZE"]

log = logging.getLogger(__name__)

#: First bytes of every twisternet connection.
MAGIC = b"TNA1"
#: Handshake protocol version; a peer with another version is refused with ProtocolError.
VERSION = 1
#: Size of each side's fresh random nonce.
NONCE_SIZE = 32
#: Largest hello (encoded msgpack bytes) either side accepts.
MAX_HELLO = 64 * 1024
#: Domain-separation string mixed into every MAC.
CONTEXT = b"twisternet-auth-v1\x00"

class PeerClosedDuringHandshake(ProtocolError):
    """The peer closed the connection (or reset it) before the handshake was over: a busy acceptor
    drops connections beyond its handshake limit that way, so an initiator may try again."""


_OPENING = struct.Struct(f"!4sB{NONCE_SIZE}s")
_PROOF = struct.Struct("!32sI")
_ROLES = {True: b"initiator", False: b"acceptor"}


def _mac(token: bytes, initiator: bool, nonce_i: bytes, nonce_a: bytes, hello: bytes) -> bytes:
    digest = hashlib.sha256(hello).digest()
    msg = CONTEXT + _ROLES[initiator] + b"\x00" + nonce_i + nonce_a + digest
    return hmac.new(token, msg, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    """Read exactly ``n`` bytes before ``deadline`` (monotonic), else AuthError (timeout) / ProtocolError (EOF)."""
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AuthError(f"handshake timed out waiting for the peer's {what}")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise AuthError(f"handshake timed out waiting for the peer's {what}") from None
        except ConnectionError as e:
            raise PeerClosedDuringHandshake(f"connection failed during the handshake ({what}): {e}") from None
        if not chunk:
            raise PeerClosedDuringHandshake(f"peer closed the connection during the handshake (expected "
                                            f"its {what})")
        buf += chunk
    return bytes(buf)


def _send_all(sock: socket.socket, data: bytes, deadline: float, what: str) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise AuthError(f"handshake timed out sending our {what}")
    sock.settimeout(remaining)
    try:
        sock.sendall(data)
    except TimeoutError:
        raise AuthError(f"handshake timed out sending our {what}") from None
    except ConnectionError as e:
        raise PeerClosedDuringHandshake(f"connection failed during the handshake ({what}): {e}") from None


def handshake(sock: socket.socket, token: bytes, *, initiator: bool, hello: dict[str, Any],
              timeout: float) -> dict[str, Any]:
    """Mutual proof of the job token over a connected socket; returns the peer's (authenticated) hello.

    Raises AuthError on a wrong token, a bad MAC or when ``timeout`` seconds (in total) pass, and
    ProtocolError on garbage, a bad magic or version, an oversize hello or EOF. The socket's previous
    blocking mode / timeout is restored before returning or raising.
    """
    if not isinstance(token, (bytes, bytearray)) or not token:
        raise TypeError("token must be non-empty bytes")
    if not isinstance(hello, dict):
        raise TypeError(f"hello must be a dict, got {type(hello).__name__}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    try:
        hello_bytes = msgpack.packb(hello, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"hello is not msgpack-serializable: {e}") from None
    if len(hello_bytes) > MAX_HELLO:
        raise ValueError(f"hello is {len(hello_bytes)} bytes encoded; the limit is {MAX_HELLO}")
    token = bytes(token)
    deadline = time.monotonic() + timeout
    previous = sock.gettimeout()
    try:
        my_nonce = os.urandom(NONCE_SIZE)
        _send_all(sock, _OPENING.pack(MAGIC, VERSION, my_nonce), deadline, "opening")
        magic, version, peer_nonce = _OPENING.unpack(_recv_exact(sock, _OPENING.size, deadline, "opening"))
        if magic != MAGIC:
            raise ProtocolError(f"not a twisternet peer (bad magic {magic!r})")
        if version != VERSION:
            raise ProtocolError(f"peer speaks handshake version {version}, this process speaks {VERSION}")
        if peer_nonce == my_nonce:
            # Only possible if our own bytes are echoed back to us (a reflecting peer).
            raise AuthError("peer echoed our nonce (reflection)")
        nonce_i, nonce_a = (my_nonce, peer_nonce) if initiator else (peer_nonce, my_nonce)

        my_mac = _mac(token, initiator, nonce_i, nonce_a, hello_bytes)
        _send_all(sock, _PROOF.pack(my_mac, len(hello_bytes)) + hello_bytes, deadline, "proof")
        peer_mac, length = _PROOF.unpack(_recv_exact(sock, _PROOF.size, deadline, "proof"))
        if length > MAX_HELLO:
            raise ProtocolError(f"peer hello of {length} bytes exceeds the limit of {MAX_HELLO}")
        peer_hello_bytes = _recv_exact(sock, length, deadline, "hello")
        expected = _mac(token, not initiator, nonce_i, nonce_a, peer_hello_bytes)
        if not hmac.compare_digest(peer_mac, expected):
            raise AuthError("peer failed the job-token proof (wrong token or tampered hello)")
        try:
            peer_hello = msgpack.unpackb(peer_hello_bytes, raw=False)
        except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types on corrupt input
            raise ProtocolError(f"peer hello is not valid msgpack: {e}") from None
        if not isinstance(peer_hello, dict):
            raise ProtocolError(f"peer hello must be a map, got {type(peer_hello).__name__}")
        return peer_hello
    except OSError as e:  # anything the helpers did not already translate
        raise ProtocolError(f"socket error during the handshake: {e}") from None
    finally:
        try:
            sock.settimeout(previous)
        except OSError:  # socket closed under us
            pass
