"""Liveness on the TCP mesh: which peers went silent past ``peer_timeout``, which need a heartbeat, and
how a loss report names where a rank ran."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .peer import Peer


class Liveness:
    """Heartbeat and silence rules for the links of one channel."""

    def __init__(self, heartbeat_interval: float, peer_timeout: float) -> None:
        self.heartbeat_interval = heartbeat_interval
        self.peer_timeout = peer_timeout

    def check(self, peers: Iterable[Peer], now: float) -> tuple[list[tuple[Peer, str]], list[Peer]]:
        """``(silent, idle)``: live peers silent past ``peer_timeout`` (with why), and those we sent
        nothing for a heartbeat interval and have nothing queued for (they get a heartbeat)."""
        silent: list[tuple[Peer, str]] = []
        idle: list[Peer] = []
        for p in peers:
            if p.lost or p.left:
                continue
            if now - p.last_recv > self.peer_timeout:
                silent.append((p, f"no data or heartbeat for {now - p.last_recv:.1f}s"))
            elif now - p.last_send > self.heartbeat_interval and not p.wq:
                idle.append(p)
        return silent, idle


def rank_places(world: int, table: Any) -> list[str]:
    """Per rank, where it runs (see :func:`twisternet.bootstrap.rank_places`); plain ``rank R`` when the
    table (from the bootstrap master) is missing or malformed."""
    from twisternet.bootstrap import rank_places as places
    if isinstance(table, list) and len(table) == world and all(isinstance(e, dict) for e in table):
        return places([(e.get("host_id"), str(e.get("tcp_host") or "")) for e in table])
    return [f"rank {r}" for r in range(world)]
