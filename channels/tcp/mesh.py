"""Building the TCP mesh: listen, join the job through the bootstrap master, connect to every peer.

Each rank dials every lower rank and accepts every higher one; every link proves the job token first
(:func:`twisternet.auth.handshake`). Peers on one host connect over abstract Unix sockets.
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import socket
import threading
import time
from typing import Any, cast

from twisternet.auth import handshake
from twisternet.config import Config
from twisternet.errors import AuthError, ConfigError, OperationTimeout, ProtocolError
from twisternet.logthrottle import LogThrottle

from .accept import ACCEPT_BACKOFF_MIN, MAX_PENDING_HANDSHAKES
from .channel import TCPChannel
from .liveness import rank_places
from .peer import Peer
from .wire import WIRE_VERSION, check_wire_version

log = logging.getLogger(__name__)


def tune(sock: socket.socket, config: Config, tcp: bool) -> None:
    if config.socket_buffer:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, config.socket_buffer)
            except OSError:
                pass
    if tcp:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def open_listeners(config: Config, bind_host: str) -> tuple[list[socket.socket], dict]:
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    tcp = socket.socket(family, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((bind_host, 0))
    tcp.listen(256)
    out = [tcp]
    listen: dict[str, Any] = {"tcp_port": tcp.getsockname()[1]}
    if not config.force_tcp and hasattr(socket, "AF_UNIX"):
        uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"\0twisternet-{os.getpid()}-{secrets.token_hex(8)}"
        uds.bind(name)
        uds.listen(256)
        out.append(uds)
        listen["uds"] = name[1:]
    return out, listen


def connect(entry: dict, my_host: str, config: Config) -> tuple[socket.socket, str]:
    if not config.force_tcp and entry.get("uds") and entry.get("host_id") == my_host:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tune(s, config, tcp=False)
        s.settimeout(config.connect_timeout)
        s.connect("\0" + entry["uds"])
        return s, "uds"
    host, port = entry["tcp_host"], entry["tcp_port"]
    s = socket.create_connection((host, port), timeout=config.connect_timeout)
    tune(s, config, tcp=True)
    return s, "tcp"


# Complexity accepted: the mesh handshake, step by step.
def build_mesh(rank: int, world: int, table: list[dict], listeners: list[socket.socket], token: bytes,  # noqa: C901
               config: Config) -> dict[int, Peer]:
    """Connect to every lower rank and accept every higher one, proving the token on each link."""
    from twisternet.bootstrap import host_id
    my_host = host_id()
    places = rank_places(world, table)
    peers: dict[int, Peer] = {}
    errors: list[str] = []
    lock = threading.Lock()
    deadline = time.monotonic() + config.connect_timeout
    hello = {"rank": rank, "world": world, "wire": WIRE_VERSION}

    def dial(j: int) -> None:
        delay = 0.02
        while True:
            try:
                s, kind = connect(table[j], my_host, config)
                s.settimeout(None)
                got = handshake(s, token, initiator=True, hello=hello, timeout=config.handshake_timeout)
                if got.get("rank") != j:
                    s.close()
                    raise ProtocolError(f"expected rank {j}, the peer says {got.get('rank')!r}")
                try:
                    check_wire_version(got, f"rank {j}")
                except ProtocolError:
                    s.close()
                    raise
                with lock:
                    peers[j] = Peer(j, s, kind)
                return
            except (TimeoutError, ConnectionError, OSError) as e:
                if time.monotonic() + delay >= deadline:
                    with lock:
                        errors.append(f"{places[j]}: {e}")
                    return
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except (AuthError, ProtocolError) as e:
                with lock:
                    errors.append(f"{places[j]}: {e}")
                return

    dialers = [threading.Thread(target=dial, args=(j,), daemon=True) for j in range(rank)]
    for t in dialers:
        t.start()
    expected = set(range(rank + 1, world))
    sel = selectors.DefaultSelector()
    for ls in listeners:
        ls.setblocking(False)
        sel.register(ls, selectors.EVENT_READ)
    vetting: list[threading.Thread] = []
    # Handshakes at once: enough for every expected peer plus some strangers; more are closed at once.
    slots = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES + world)
    noise = LogThrottle(log)

    def vet(sock: socket.socket, addr: Any, kind: str) -> None:
        try:
            sock.setblocking(True)
            got = handshake(sock, token, initiator=False, hello=hello, timeout=config.handshake_timeout)
            j = got.get("rank")
            try:
                check_wire_version(got, f"rank {j!r}")
            except ProtocolError as e:
                if isinstance(j, int) and j in expected:
                    with lock:
                        errors.append(f"{places[j]}: {e}")
                raise
            with lock:
                ok = isinstance(j, int) and j in expected and j not in peers
                if ok:
                    tune(sock, config, tcp=kind == "tcp")
                    peers[cast(int, j)] = Peer(cast(int, j), sock, kind)   # ok: j is an int
            if not ok:
                noise.warning("refused", "rank %d: refused a connection claiming rank %r", rank, j)
                sock.close()
        except (AuthError, ProtocolError, OSError) as e:
            noise.warning("dropped", "rank %d: dropped a connection from %s: %s", rank,
                          addr or "a local socket", e)
            try:
                sock.close()
            except OSError:
                pass
        finally:
            slots.release()

    try:
        while True:
            with lock:
                accepted = expected <= peers.keys()
            if accepted:
                break
            if time.monotonic() >= deadline:
                break
            for key, _ in sel.select(0.05):
                try:
                    sock, addr = key.fileobj.accept()  # type: ignore[union-attr]
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as e:   # e.g. EMFILE: the connection waits in the queue; rest a little
                    noise.warning("accept", "rank %d: accept failed while building the mesh: %s", rank, e)
                    time.sleep(ACCEPT_BACKOFF_MIN)
                    continue
                if not slots.acquire(blocking=False):
                    noise.warning("busy", "rank %d: closed a connection from %s unread: too many "
                                  "handshakes at once", rank, addr or "a local socket")
                    sock.close()
                    continue
                kind = "uds" if sock.family == getattr(socket, "AF_UNIX", None) else "tcp"
                t = threading.Thread(target=vet, args=(sock, addr, kind), daemon=True)
                t.start()
                vetting = [v for v in vetting if v.is_alive()]
                vetting.append(t)
    finally:
        sel.close()
    for t in dialers:
        t.join(max(0.0, deadline - time.monotonic()) + 1)
    missing = sorted(set(range(world)) - {rank} - peers.keys())
    if missing:
        for p in peers.values():
            p.sock.close()
        for j in missing:
            if j < rank and not any(e.startswith(f"{places[j]}:") for e in errors):
                errors.append(f"{places[j]}: no answer yet")
        silent = [places[j] for j in missing if j > rank]   # they were to connect to us
        if silent:
            errors.append("no connection arrived from " + ", ".join(silent))
        raise OperationTimeout(f"{places[rank]} could not connect to ranks {missing}: {'; '.join(errors)}",
                               timeout=config.connect_timeout)
    return peers


def create_channel(config: Config, **_: Any) -> TCPChannel:
    """Join the job through the bootstrap master (``config.master``) and connect to every peer."""
    from twisternet.bootstrap import join, route_to_master
    if config.master is None:
        raise ConfigError("master", "the tcp channel needs the bootstrap master's HOST:PORT "
                                    "(start the job with `twisternet run` or `twisternet worker`)")
    token = config.token_bytes
    if token is None:
        raise ConfigError("token", "the tcp channel needs the job token (TWISTERNET_TOKEN)")
    # Listen only on the interface this host reaches the master through (the one the master sees),
    # unless bind_host says otherwise.
    # Within connect_timeout: a link that is down yet may come up while the job assembles.
    started = time.monotonic()
    seen_by_master = route_to_master(config.master, config.connect_timeout)
    listeners, listen = open_listeners(config, config.bind_host or seen_by_master)
    listen["tcp_host"] = config.advertise_host or seen_by_master
    try:
        left = max(1.0, config.connect_timeout - (time.monotonic() - started))
        session = join(config.master, token, listen=listen, rank=config.rank, world=config.world,
                       timeout=left, handshake_timeout=config.handshake_timeout,
                       heartbeat_interval=config.heartbeat_interval, peer_timeout=config.peer_timeout)
    except BaseException:
        for ls in listeners:
            ls.close()
        raise
    try:
        table = [dict(e) for e in session.table]   # each worker's `listen` dict plus host_id (join())
        peers = build_mesh(session.rank, session.world, table, listeners, token, config)
    except BaseException:
        for ls in listeners:
            ls.close()
        session.close()
        raise
    ch = TCPChannel(session.rank, session.world, config, peers, listeners, token, session)
    log.debug("rank %d: mesh of %d peers ready (%s)", ch.rank, len(peers),
              ", ".join(f"{r}:{p.kind}" for r, p in sorted(peers.items())))
    return ch
