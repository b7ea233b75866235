"""The raw-socket baseline: plain sendall / recv_into between two processes, no library.

The sender sends written memory, as twisternet's worker does (``np.ones``), never ``bytes(size)``:
that is calloc'ed, and while glibc still serves large allocations with fresh mmaps its pages are never
written and all map the kernel's one zero page, so the copy into the socket reads 4 KB of cache instead
of ``size`` bytes of memory (5.6-6.7 GB/s at 4 MB over UDS on this project's machine, against 4.1-5.3
GB/s for a written buffer in the same minutes). Once glibc raises its mmap threshold the same call
gets written memory, so such a baseline changes with the allocator's state, not with the transport.
"""

from __future__ import annotations

import os
import socket
import statistics
import time


def _pair(kind: str) -> tuple[socket.socket, socket.socket]:
    if kind == "uds":
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        a = socket.create_connection(ls.getsockname())
        b, _ = ls.accept()
        ls.close()
        for s in (a, b):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    return a, b


def _recv_exact(s: socket.socket, mv: memoryview) -> None:
    got = 0
    while got < len(mv):
        n = s.recv_into(mv[got:])
        if n == 0:
            raise ConnectionError("peer closed")
        got += n


def _payload(size: int) -> bytes:
    """``size`` bytes whose pages are written (ones, as the twisternet worker sends)."""
    return b"\x01" * size


def pass_reps(size: int, budget: int, passes: int) -> int:
    """Messages of ``size`` bytes in each of ``passes`` timed passes over ``budget`` bytes (3 at least)."""
    return max(3, min(20000, budget // size // max(passes, 1)))


def bandwidth(kind: str, size: int, budget: int, passes: int = 1) -> float:
    """Bytes per second of one-way transfer of ``size``-byte messages (a forked receiver): the median of
    ``passes`` timed passes, each acknowledged by the receiver (see ``PASSES`` in benchmarks/p2p.py)."""
    reps = pass_reps(size, budget, passes)
    a, b = _pair(kind)
    pid = os.fork()
    if pid == 0:
        try:
            a.close()
            buf = memoryview(bytearray(size))
            _recv_exact(b, buf)
            b.sendall(b"k")
            for _ in range(passes):
                for _ in range(reps):
                    _recv_exact(b, buf)
                b.sendall(b"k")
        finally:
            os._exit(0)
    b.close()
    data = _payload(size)
    a.sendall(data)
    a.recv(1)
    rates = []
    for _ in range(passes):
        t = time.perf_counter()
        for _ in range(reps):
            a.sendall(data)
        a.recv(1)
        rates.append(reps * size / (time.perf_counter() - t))
    a.close()
    os.waitpid(pid, 0)
    return statistics.median(rates)


def latency(kind: str, size: int) -> float:
    """One-way latency (half a round trip) of a ``size``-byte ping-pong."""
    reps = max(20, min(2000, (64 << 20) // max(size, 1)))
    a, b = _pair(kind)
    pid = os.fork()
    if pid == 0:
        try:
            a.close()
            buf = memoryview(bytearray(size))
            for _ in range(reps):
                _recv_exact(b, buf)
                b.sendall(buf)
        finally:
            os._exit(0)
    b.close()
    data = _payload(size)
    buf = memoryview(bytearray(size))
    t = time.perf_counter()
    for _ in range(reps):
        a.sendall(data)
        _recv_exact(a, buf)
    dt = time.perf_counter() - t
    a.close()
    os.waitpid(pid, 0)
    return dt / reps / 2
