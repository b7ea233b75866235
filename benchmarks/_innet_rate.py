"""Packet-rate measurements of the ATP software switch (used by benchmarks/innet.py).

* ``bare_receive``: the ceiling — a receive loop that does nothing but ``recvfrom_into`` preallocated
  memory (the fastest per-datagram receive Python offers with the sender's address, which the switch
  needs for its source check; CPython has no recvmmsg).
* ``bare_receive_mmsg``: the compiled ceiling — the C core's ``drain`` (recvmmsg batches, nothing else).
* ``switch_rate``: the switch server (per-packet, or batched with the Python or the compiled dataplane
  engine) on the same kind of prefilled
  socket: ``world`` workers' gradients of ``fragments`` fragments plus the PS's ACKs, so aggregators are
  reserved, completed, emitted, freed and reused as in a real allreduce.
* ``dataplane_rate``: the packet function alone (no sockets): per-packet, Python batched, or the C core.

The socket is filled before the timed loop starts (its buffer is raised with SO_RCVBUFFORCE when the
process may, so the kernel keeps every packet), then drained: the sender's speed does not matter. Rates
are given per wall second and per CPU second of the receiving thread; on a loaded machine the CPU
figure is the one-core rate.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)


def _big_buffer(sock: socket.socket, nbytes: int) -> bool:
    """Raise the receive buffer to ``nbytes`` (forced past rmem_max if permitted); True if forced."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_RCVBUFFORCE, nbytes)
        return True
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)
        return False


def _trace(world: int, fragments: int, V: int, window: int, n_agg: int, job: int = 1) -> list[tuple[int, bytes]]:
    """(sender, packet) pairs: sender r < world is worker r, sender world is the PS. ACKs of fragment
    s - window follow the gradients of fragment s, so slots are reused as in a steady allreduce."""
    from innet.wire import Packet, encode
    rng = np.random.default_rng(0)
    vals = rng.integers(-1000, 1000, (world, V), dtype=np.int32)
    full = (1 << world) - 1
    out: list[tuple[int, bytes]] = []
    for s in range(fragments + window):
        if s < fragments:
            for r in range(world):
                out.append((r, encode(Packet(job_id=job, seq=s, values=vals[r], bitmap0=1 << r, bitmap1=1,
                                             fan_in0=world, agg_index=s % n_agg))))
        a = s - window
        if a >= 0:
            out.append((world, encode(Packet(job_id=job, seq=a, values=vals[0], bitmap0=full, bitmap1=1,
                                             fan_in0=world, agg_index=a % n_agg, is_ack=True))))
    return out


def _senders(n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    return socks


def _fill(target: tuple[str, int], senders: list[socket.socket], trace: list[tuple[int, bytes]]) -> None:
    for who, data in trace:
        while True:
            try:
                senders[who].sendto(data, target)
                break
            except BlockingIOError:   # pragma: no cover - our own send buffer is full for a moment
                time.sleep(0.0005)


def _queued(sock: socket.socket) -> int:
    import fcntl
    import struct
    import termios
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def _udp_drops(sock: socket.socket) -> int:
    """Datagrams the kernel dropped at ``sock`` for lack of receive buffer (``drops`` of /proc/net/udp)."""
    inode = str(os.fstat(sock.fileno()).st_ino)
    with open("/proc/net/udp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if cols[9] == inode:
                return int(cols[-1])
    raise RuntimeError(f"socket inode {inode} not in /proc/net/udp")


def _drain_rate(packets: int, size: int, drain: Callable[[socket.socket], int]) -> dict[str, Any]:
    """Prefill a socket with ``packets`` datagrams of ``size`` bytes, time ``drain(sock)`` (it returns
    how many it received), and report packets/s wall and CPU."""
    r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    forced = _big_buffer(r, max(64 << 20, packets * 2048))
    r.bind(("127.0.0.1", 0))
    r.setblocking(False)
    senders = _senders(1)
    _fill(r.getsockname(), senders, [(0, b"x" * size)] * packets)
    t0, c0 = time.perf_counter(), time.thread_time()
    got = drain(r)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    r.close()
    for s in senders:
        s.close()
    return {"packets": got, "sent": packets, "forced_buffer": forced, "wall_pps": got / wall,
            "cpu_pps": got / cpu}


def bare_receive(packets: int = 200_000, size: int = 264) -> dict[str, Any]:
    """The ceiling: drain ``packets`` prefilled datagrams with recvfrom_into; packets/s wall and CPU."""
    rows = np.zeros((512, size + 1), np.uint8)
    flat = memoryview(rows.reshape(-1))
    views = [flat[i * (size + 1):(i + 1) * (size + 1)] for i in range(512)]

    def drain(r: socket.socket) -> int:
        recv = r.recvfrom_into
        got = 0
        while True:
            k0 = got
            for v in views:
                try:
                    recv(v)
                except BlockingIOError:
                    break
                got += 1
            if got == k0:
                return got
    return _drain_rate(packets, size, drain)


def bare_receive_mmsg(packets: int = 200_000, size: int = 264) -> dict[str, Any]:
    """The compiled ceiling: drain ``packets`` prefilled datagrams with the C core's recvmmsg loop."""
    from innet.fastpath import CDataplane
    from innet.switch import SoftwareSwitch
    core = CDataplane(SoftwareSwitch(1, (size - 16) // 4))

    def drain(r: socket.socket) -> int:
        fd = r.fileno()
        got = 0
        while True:
            k = core.drain(fd, 512)
            if not k:
                return got
            got += k
    return _drain_rate(packets, size, drain)


def switch_rate(batched: bool, world: int = 2, fragments: int = 50_000, V: int = 62,
                n_agg: int = 4096, window: int = 128, dataplane: str = "python") -> dict[str, Any]:
    """The switch server draining a prefilled socket of ``world`` workers' fragments and the PS's ACKs:
    gradient packets aggregated per second (wall, and CPU of the switch thread) and all packets/s.
    ``dataplane`` is the batched loop's engine (``python`` or ``c``)."""
    from innet.control import JobEntry, MulticastGroup
    from innet.switch import SoftwareSwitch
    from innet.switch_server import SwitchServer
    trace = _trace(world, fragments, V, window, n_agg)
    sw = SoftwareSwitch(n_agg, V)
    server = SwitchServer(sw, ("127.0.0.1", 0), batched=batched, dataplane=dataplane)
    forced = _big_buffer(server.transport.sock, max(64 << 20, len(trace) * 2048))
    senders = _senders(world + 1)
    sinks = _senders(world + 1)      # where outputs go (never read: they just land in a buffer)
    for r, (s, _k) in enumerate(zip(senders, sinks)):
        sw.set_port(r + 1, s.getsockname())
    sw.insert_mcast_group(MulticastGroup(1, tuple(range(1, world + 1))))
    sw.insert_job(JobEntry(1, world, world + 1, 1, 0))
    for r in range(world):
        sw.insert_member(1, r + 1)
    _fill(server.address, senders, trace)
    queued = _queued(server.transport.sock)
    # What the server will receive: the trace less what the kernel dropped for lack of buffer (counted
    # now, before the server reads: nothing more arrives). Waiting for exactly that many, not for a
    # quiet socket, keeps a loaded machine from ending the measurement before the server has run.
    expected = len(trace) - _udp_drops(server.transport.sock)
    t = threading.Thread(target=server.run, daemon=True)
    t0 = time.perf_counter()
    t.start()
    clock = time.pthread_getcpuclockid(t.ident)
    deadline = time.monotonic() + 600
    while server.packets_in < expected and t.is_alive():
        if time.monotonic() > deadline:
            raise RuntimeError(f"switch server took {server.packets_in} of {expected} packets in 600 s")
        time.sleep(0.002)
    wall = time.perf_counter() - t0
    cpu = time.clock_gettime(clock)      # the thread's clock starts at zero
    if server.packets_in < expected:
        raise RuntimeError(f"switch server stopped after {server.packets_in} of {expected} packets")
    server.stop()
    t.join(10)
    for s in senders + sinks:
        s.close()
    agg = sw.counters()["aggregated"]
    return {"batched": batched, "dataplane": server.dataplane,
            "packets": server.packets_in, "sent": len(trace), "queued_bytes": queued,
            "forced_buffer": forced, "aggregated": agg, "emitted": sw.extra["emitted"],
            "wall_agg_pps": agg / wall, "cpu_agg_pps": agg / cpu, "wall_pps": server.packets_in / wall,
            "cpu_pps": server.packets_in / cpu}


def dataplane_rate(batched: bool, world: int = 2, fragments: int = 20_000, V: int = 62, n_agg: int = 4096,
                   window: int = 128, batch: int = 512, dataplane: str = "python") -> dict[str, Any]:
    """The packet function alone on the same trace: aggregated gradient packets per CPU second
    (``dataplane="c"``: the C core's ``process`` on the same batches, lists in and out included)."""
    from innet.control import JobEntry, MulticastGroup
    from innet.switch import SoftwareSwitch
    trace = _trace(world, fragments, V, window, n_agg)
    sw = SoftwareSwitch(n_agg, V)
    for r in range(world + 1):
        sw.set_port(r + 1, ("127.0.0.1", 50000 + r))
    sw.insert_mcast_group(MulticastGroup(1, tuple(range(1, world + 1))))
    sw.insert_job(JobEntry(1, world, world + 1, 1, 0))
    for r in range(world):
        sw.insert_member(1, r + 1)
    size = sw.packet_size
    ports = [who + 1 for who, _ in trace]
    if batched:
        rows = np.frombuffer(b"".join(d for _, d in trace), np.uint8).reshape(len(trace), size)
        process = sw.process_batch
        if dataplane == "c":
            from innet.fastpath import CDataplane
            process = CDataplane(sw).process_batch
        c0 = time.thread_time()
        for i in range(0, len(trace), batch):
            k = min(batch, len(trace) - i)
            process(rows[i:i + k], [size] * k, ports[i:i + k], 0.0, range(k - 1, -1, -1))
    else:
        c0 = time.thread_time()
        for (_who, data), port in zip(trace, ports):
            sw.process(data, port, 0.0)
    cpu = time.thread_time() - c0
    agg = sw.counters()["aggregated"]
    return {"batched": batched, "dataplane": dataplane, "aggregated": agg, "cpu_agg_pps": agg / cpu,
            "cpu_pps": len(trace) / cpu}
