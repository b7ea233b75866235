"""Batched datagram I/O of the ATP end hosts (worker, PS): many datagrams per call, in preallocated rows.

``RowIO`` receives into and sends from rows of a numpy ``uint8`` matrix (one datagram per row). With
the compiled helper (``innet/_hostio.c``: ``recvmmsg`` / ``sendmmsg`` with UDP GSO trains, no GIL) one
call moves a whole window; without it (not built, ``TWISTERNET_INNET_HOSTIO=python``, or loss injection,
which needs ``UdpTransport.send``) the same calls loop over ``recvfrom_into`` / ``send``, the reference
the tests compare the C path with. Addresses are IPv4 as ``ip << 16 | port`` (``addr_key``).
"""

from __future__ import annotations

import socket

import numpy as np

from .engines import choose_engine, import_extension
from .transport import UdpTransport

__all__ = ["HOSTIO_ENV", "RowIO", "addr_key", "key_addr", "c_hostio_available", "datagram_truesize",
           "socket_buffer_window"]

HOSTIO_ENV = "TWISTERNET_INNET_HOSTIO"

_hostio, _IMPORT_ERROR = import_extension("_hostio")    # (None when not built: the Python loops below)

def datagram_truesize(packet_bytes: int) -> int:
    """What the kernel charges a receive buffer for one queued datagram of ``packet_bytes`` (measured on
    Linux loopback: a small datagram's buffer is a power of two plus ~256 bytes of bookkeeping; above
    ~16 KB the data goes in pages and the charge is its size plus ~1 KB). An estimate, rounded up."""
    linear = packet_bytes + 320
    if linear <= 16384:
        return (1 << (linear - 1).bit_length()) + 256
    return packet_bytes + 1024


def c_hostio_available() -> bool:
    """True when the compiled helper imports."""
    return _hostio is not None


def addr_key(addr: tuple[str, int]) -> int:
    """An IPv4 (host, port) as one integer, ``ip << 16 | port``."""
    return int.from_bytes(socket.inet_aton(addr[0]), "big") << 16 | int(addr[1])


def key_addr(key: int) -> tuple[str, int]:
    """The inverse of ``addr_key``."""
    return socket.inet_ntoa(int(key >> 16).to_bytes(4, "big")), int(key & 0xFFFF)


def socket_buffer_window(sock: socket.socket, packet_bytes: int, senders: int = 1) -> int:
    """How many datagrams of ``packet_bytes`` each of ``senders`` may have queued at once in ``sock``'s
    receive buffer without the kernel dropping any (``datagram_truesize`` each); at least 1."""
    rcvbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    return max(1, rcvbuf // (datagram_truesize(packet_bytes) * max(1, senders)))


class RowIO:
    """Batched receive and send of one ``UdpTransport``'s socket (see the module doc)."""

    def __init__(self, transport: UdpTransport, *, compiled: bool | None = None, mode: str | None = None) -> None:
        """``mode``: ``auto`` (the compiled helper when built), ``c`` (an error if it is not) or ``python``;
        None reads ``TWISTERNET_INNET_HOSTIO`` (default ``auto``). ``compiled`` (tests) overrides both."""
        self.transport = transport
        if compiled is None:
            compiled = choose_engine(mode, HOSTIO_ENV, _hostio, _IMPORT_ERROR,
                                     "innet_hostio: the compiled helper (innet._hostio)", RuntimeError) == "c"
        self.compiled = bool(compiled and _hostio is not None and not transport.loss.active)
        self.gso = True

    def recv(self, buf: np.ndarray, lengths: np.ndarray, addrs: np.ndarray, max_count: int) -> int:
        """Receive up to ``max_count`` datagrams without blocking into rows of ``buf`` (a C-contiguous
        uint8 matrix); ``lengths`` / ``addrs`` (int64 / uint64) get each one's length and sender.
        Returns the count; ECONNREFUSED is counted in ``transport.refused``."""
        max_count = min(max_count, buf.shape[0], lengths.shape[0], addrs.shape[0])
        width = buf.shape[1]
        if self.compiled:
            got, refused = _hostio.recv_rows(self.transport.fileno(), buf, width, max_count, lengths, addrs)
            self.transport.refused += refused
            return int(got)
        got = 0
        recv = self.transport.sock.recvfrom_into
        flat = memoryview(buf.reshape(-1))  # type: ignore[arg-type]  # numpy arrays are buffers
        while got < max_count:
            try:
                nbytes, addr = recv(flat[got * width:(got + 1) * width])
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionRefusedError:
                self.transport.refused += 1
                continue
            lengths[got] = nbytes
            addrs[got] = addr_key(addr)
            got += 1
        return got

    def send(self, buf: np.ndarray, rows: np.ndarray, length: int, addrs: np.ndarray | None = None) -> int:
        """Send the first ``length`` bytes of rows ``rows`` of ``buf``, to ``addrs`` (one key per row) or
        to the connected peer; returns the datagrams the kernel took (a full buffer drops, as
        ``UdpTransport.send`` does)."""
        rows = np.ascontiguousarray(rows, np.int64)
        if self.compiled:
            keys = None if addrs is None else np.ascontiguousarray(addrs, np.uint64)
            sent, refused, self.gso = _hostio.send_rows(self.transport.fileno(), buf, buf.shape[1], length,
                                                        rows, keys, self.gso)
            self.transport.refused += refused
            self.transport.sent += sent
            return int(sent)
        sent = 0
        for k, r in enumerate(rows.tolist()):
            dest = None if addrs is None else key_addr(int(addrs[k]))
            sent += self.transport.send(buf[r, :length].tobytes(), dest)
        return sent
