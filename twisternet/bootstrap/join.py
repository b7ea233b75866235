"""The worker side of joining a job: connect to the bootstrap master, prove the token, wait for the table."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from twisternet.auth import PeerClosedDuringHandshake, handshake
from twisternet.errors import (
    ConfigError,
    OperationTimeout,
    PeerLostError,
    ProtocolError,
    TwisternetError,
)

from .addresses import host_id, parse_address
from .session import MasterSession
from .wire import FrameReader

log = logging.getLogger(__name__)

#: Seconds (at most; a quarter of the join timeout if less) a joined worker waits past its own join
#: deadline for the master's verdict on why the job did not start.
_VERDICT_GRACE = 3.0


def check_token(token: bytes) -> bytes:
    if not isinstance(token, (bytes, bytearray)) or not token:
        raise TypeError("token must be non-empty bytes")
    return bytes(token)



def join(master: str, token: bytes, *, listen: dict[str, Any], rank: int | None = None, world: int | None = None,
         timeout: float = 60.0, handshake_timeout: float = 5.0,
         heartbeat_interval: float = 1.0, peer_timeout: float = 15.0) -> MasterSession:
    """Join the job run by the bootstrap master at ``master`` (HOST:PORT); return the live session.

    Retries connecting until ``timeout``, proves the token, sends ``listen`` (this worker's addresses)
    and waits until every worker joined. Raises ConfigError (rank taken or out of range, world
    mismatch), PeerLostError (a worker died before the job started), AuthError/ProtocolError (failed
    handshake), OperationTimeout (the master could not be reached, or the job did not start within
    ``timeout``: then with the master's account of who joined and who was refused, if it gave one).
    """
    token = check_token(token)
    host, port = parse_address(master)
    if not isinstance(listen, dict):
        raise TypeError(f"listen must be a dict, got {type(listen).__name__}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ConfigError("rank", f"must be an integer >= 0, got {rank!r}")
    if world is not None and (isinstance(world, bool) or not isinstance(world, int) or world < 1):
        raise ConfigError("world", f"must be an integer >= 1, got {world!r}")
    if rank is not None and world is not None and rank >= world:
        raise ConfigError("rank", f"must be in [0, {world}), got {rank}")
    if not 0 < heartbeat_interval < peer_timeout:
        raise ConfigError("heartbeat_interval", "must be > 0 and smaller than peer_timeout")
    hello = {"kind": "worker", "rank": rank, "world": world, "listen": listen, "host_id": host_id(),
             "pid": os.getpid()}
    deadline = time.monotonic() + timeout
    delay = 0.05
    last_error: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise OperationTimeout(f"could not reach the bootstrap master at {master} from "
                                   f"{socket.gethostname()} ({last_error})",
                                   operation="bootstrap join", timeout=timeout)
        try:
            sock = socket.create_connection((host, port), timeout=min(remaining, 5.0))
        except OSError as e:
            last_error = e
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer = handshake(sock, token, initiator=True, hello=hello,
                             timeout=max(0.001, min(handshake_timeout, deadline - time.monotonic())))
            break
        except PeerClosedDuringHandshake as e:
            # a busy master closes connections beyond its handshake limit unread: try again
            sock.close()
            last_error = e
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)
        except BaseException:
            sock.close()
            raise
    try:
        if peer.get("kind") != "master":
            raise ProtocolError(f"{master} is not a bootstrap master (hello kind {peer.get('kind')!r})")
        frames = FrameReader()
        # Past our own deadline, wait a little longer for the master's verdict: it times the join out
        # at about the same moment and says why (who joined, who was refused), which we would miss.
        grace = min(_VERDICT_GRACE, 0.25 * timeout)
        while True:
            batch = _recv_messages(sock, frames, deadline + grace, master, timeout)
            for i, msg in enumerate(batch):
                kind = msg.get("type")
                if kind == "table":
                    return _make_session(sock, frames, msg, master, world, heartbeat_interval,
                                         peer_timeout, batch[i + 1:])
                if kind == "error":
                    raise _join_error(msg)
                if kind not in ("hb",):
                    log.debug("join: ignoring %r before the table", kind)
    except BaseException:
        sock.close()
        raise


def _recv_messages(sock: socket.socket, frames: FrameReader, deadline: float, master: str,
                   timeout: float) -> list[dict[str, Any]]:
    remaining = deadline - time.monotonic()
    silent = (f"the job did not start: not every worker joined the master at {master}, and it did not "
              f"say why (this worker: {socket.gethostname()})")
    if remaining <= 0:
        raise OperationTimeout(silent, operation="bootstrap join", timeout=timeout)
    sock.settimeout(remaining)
    try:
        data = sock.recv(1 << 16)
    except TimeoutError:
        raise OperationTimeout(silent, operation="bootstrap join", timeout=timeout) from None
    except OSError as e:
        raise TwisternetError(f"connection to the bootstrap master at {master} failed: {e}") from None
    if not data:
        raise TwisternetError(f"the bootstrap master at {master} closed the connection before the job "
                              "started")
    return frames.feed(data)


def _join_error(msg: dict[str, Any]) -> TwisternetError:
    message = str(msg.get("message", "join refused"))
    if isinstance(msg.get("timeout"), (int, float)) and not isinstance(msg.get("timeout"), bool):
        return OperationTimeout(f"the job did not start: {message}", operation="bootstrap join",
                                timeout=float(msg["timeout"]))
    if msg.get("key") in ("rank", "world"):
        return ConfigError(msg["key"], f"refused by the bootstrap master: {message}")
    if isinstance(msg.get("rank"), int):
        return PeerLostError(msg["rank"], str(msg.get("reason", message)))
    return TwisternetError(f"the bootstrap master refused this worker: {message}")


def _make_session(sock: socket.socket, frames: FrameReader, msg: dict[str, Any], master: str,
                  world: int | None, heartbeat_interval: float, peer_timeout: float,
                  pending: list[dict[str, Any]]) -> MasterSession:
    rank, n, table = msg.get("rank"), msg.get("world"), msg.get("table")
    if not isinstance(rank, int) or not isinstance(n, int) or not isinstance(table, list) \
            or len(table) != n or not 0 <= rank < n or not all(isinstance(e, dict) for e in table):
        raise ProtocolError(f"malformed table from the bootstrap master: {msg!r:.200}")
    if world is not None and n != world:
        raise ConfigError("world", f"the master runs world={n}, this worker expects {world}")
    session = MasterSession(sock, frames, rank, n, table, master, heartbeat_interval=heartbeat_interval,
                            peer_timeout=peer_timeout, pending=pending)
    log.info("joined the job as rank %d of %d", rank, n)
    return session
