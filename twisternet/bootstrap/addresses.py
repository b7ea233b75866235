"""Addresses in a job: this host's identity, ``HOST:PORT`` parsing, the route to the master, and how a
loss report names the host a rank ran on."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from twisternet.errors import OperationTimeout
from twisternet.topology import NO_BOOT_ID


def host_id() -> str:
    """A string naming this host *and* network namespace: hostname/boot_id/netns-inode.

    Two processes with equal host ids can reach each other over abstract Unix sockets.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = NO_BOOT_ID
    try:
        netns = str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        netns = "no-netns"
    return f"{socket.gethostname()}/{boot}/{netns}"


def parse_address(address: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[v6]:PORT`` allowed) into (host, port); ValueError names the problem."""
    if not isinstance(address, str):
        raise ValueError(f"master address must be a string HOST:PORT, got {address!r}")
    host, sep, port = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"master address must be HOST:PORT, got {address!r}")
    return host, int(port)


def route_to_master(master: str, timeout: float) -> str:
    """:func:`local_address_for` ``master``, retried until ``timeout`` while there is no route yet.

    A link that is down (ENETUNREACH, EHOSTUNREACH) may come up while the job assembles; past
    ``timeout`` an OperationTimeout names the master and this host.
    """
    deadline = time.monotonic() + timeout
    delay = 0.05
    while True:
        try:
            return local_address_for(master)
        except OSError as e:
            if time.monotonic() + delay >= deadline:
                raise OperationTimeout(f"could not reach the bootstrap master at {master} from "
                                       f"{socket.gethostname()}: {e}", operation="bootstrap join",
                                       timeout=timeout) from None
            time.sleep(delay)
            delay = min(2 * delay, 0.5)


def local_address_for(master: str) -> str:
    """The local IP address this host uses to reach ``master`` (HOST:PORT); no packet is sent."""
    host, port = parse_address(master)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        addr: str = s.getsockname()[0]
        return addr


def hostport(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def where(peer: str, hid: object) -> str:
    """``hostname (ADDRESS)`` of a peer ``ADDRESS:PORT`` whose host id (hostname/boot/netns) is ``hid``."""
    addr = peer.rpartition(":")[0] or peer
    name = hid.split("/", 1)[0] if isinstance(hid, str) and hid else ""
    return f"{name} ({addr})" if name else addr


def rank_list(ranks: list[int]) -> str:
    """``0-7, 9, 10``: runs of three or more consecutive ranks as ranges."""
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{ranks[i]}-{ranks[j]}")
        else:
            out.extend(str(r) for r in ranks[i:j + 1])
        i = j + 1
    return ", ".join(out)


def rank_places(hosts: list[tuple[object, str]]) -> list[str]:
    """For each rank, given (host id, address) per rank: ``rank R on HOSTNAME (ADDRESS; ranks on that
    host: ...)``, what a loss report says to name the host and every rank on it (the list is left out
    when all ranks share one host)."""
    by_host: dict[object, list[int]] = {}
    for r, (hid, _) in enumerate(hosts):
        by_host.setdefault(hid, []).append(r)
    out = []
    for r, (hid, addr) in enumerate(hosts):
        name = hid.split("/", 1)[0] if isinstance(hid, str) and hid else ""
        inside = [addr] if name and addr else []
        if len(by_host) > 1:
            inside.append(f"ranks on that host: {rank_list(by_host[hid])}")
        text = (name or addr or "an unknown host") + (f" ({'; '.join(inside)})" if inside else "")
        out.append(f"rank {r} on {text}")
    return out
