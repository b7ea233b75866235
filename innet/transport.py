"""UDP datagram transport of the ATP stack, with seeded loss injection for tests.

Every component (worker, switch, parameter server) sends through a ``UdpTransport``. A ``LossConfig``
drops a fraction of outgoing packets by kind: *gradient* (sent by a worker), *aggregate* (a non-ACK packet
sent by a switch or forwarded by it), *parameter* (an ACK, sent by the PS or multicast by a switch). The
kind is read from the packet header (``isAck``) and the role of the sender.
"""

from __future__ import annotations

import errno
import logging
import random
import socket
from dataclasses import dataclass

from .wire import FLAG_ACK, HEADER_SIZE

__all__ = ["LossConfig", "UdpTransport", "ROLE_WORKER", "ROLE_SWITCH", "ROLE_PS"]

log = logging.getLogger(__name__)

ROLE_WORKER = "worker"
ROLE_SWITCH = "switch"
ROLE_PS = "ps"

_RECV_BUF = 8 * 1024 * 1024


@dataclass(frozen=True)
class LossConfig:
    """Fractions (0..1) of packets to drop on send, by kind; ``seed`` makes the drops reproducible."""

    gradient: float = 0.0
    aggregate: float = 0.0
    parameter: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("gradient", "aggregate", "parameter"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"loss fraction {name} must be in [0, 1], got {v}")

    @classmethod
    def uniform(cls, fraction: float, seed: int = 0) -> LossConfig:
        """The same loss fraction for all three kinds."""
        return cls(fraction, fraction, fraction, seed)

    @property
    def active(self) -> bool:
        return bool(self.gradient or self.aggregate or self.parameter)


class UdpTransport:
    """A non-blocking UDP socket with optional loss injection; ``dropped`` counts injected losses."""

    def __init__(self, bind: tuple[str, int] = ("127.0.0.1", 0), *, role: str = ROLE_WORKER,
                 loss: LossConfig | None = None, connect: tuple[str, int] | None = None) -> None:
        self.role = role
        self.loss = loss or LossConfig()
        self._rng = random.Random(self.loss.seed)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, opt, _RECV_BUF)
            except OSError:  # pragma: no cover - platform limits
                pass
        self.sock.bind(bind)
        if connect is not None:
            # A connected UDP socket reports ICMP port-unreachable as ECONNREFUSED: that is how a worker
            # notices on a LAN that its switch died.
            self.sock.connect(connect)
        self.sock.setblocking(False)
        self.connected_to = connect
        self.dropped = 0
        self.sent = 0
        self.refused = 0

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()[:2]

    def fileno(self) -> int:
        return self.sock.fileno()

    def _kind_loss(self, data: bytes) -> float:
        if not self.loss.active or len(data) < HEADER_SIZE:
            return 0.0
        if data[9] & FLAG_ACK:   # flags u16 at bytes 8..9; isAck is bit 0 of byte 9
            return self.loss.parameter
        return self.loss.gradient if self.role == ROLE_WORKER else self.loss.aggregate

    def send(self, data: bytes, addr: tuple[str, int] | None = None) -> bool:
        """Send one datagram (to ``addr``, or the connected peer); False if dropped or refused."""
        p = self._kind_loss(data)
        if p and self._rng.random() < p:
            self.dropped += 1
            return False
        try:
            if addr is None:
                self.sock.send(data)
            else:
                self.sock.sendto(data, addr)
        except ConnectionRefusedError:
            self.refused += 1
            return False
        except BlockingIOError:
            log.debug("%s send buffer full, datagram dropped", self.role)
            return False
        except OSError as e:
            if e.errno in (errno.ENOBUFS, errno.EAGAIN, errno.EHOSTUNREACH, errno.ENETUNREACH):
                return False
            raise
        self.sent += 1
        return True

    def recv_batch(self, max_packets: int = 256) -> list[tuple[bytes, tuple[str, int]]]:
        """Drain up to ``max_packets`` datagrams without blocking; ECONNREFUSED is counted, not raised."""
        out = []
        recvfrom = self.sock.recvfrom
        for _ in range(max_packets):
            try:
                data, addr = recvfrom(65536)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionRefusedError:
                self.refused += 1
                continue
            out.append((data, addr[:2]))
        return out

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:  # pragma: no cover
            pass
