"""The master's roster while a job assembles: who joined, who was refused and why, and the rank table.

The master answers nobody until ``world`` workers joined; then ranks a worker asked for are honoured
(a second claim is refused) and workers that asked for none fill the free ranks in arrival order.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, Protocol, TypeVar

from .addresses import hostport, rank_places, where

log = logging.getLogger(__name__)

#: Refused connections the join-failure message names at most (the latest ones).
MAX_REFUSED = 8


class Joiner(Protocol):
    """What the roster reads of a joined worker's connection."""

    peer: str
    hello: dict[str, Any]
    rank: int | None


C = TypeVar("C", bound=Joiner)


class Roster(Generic[C]):
    """Workers that joined a job still assembling (in arrival order) and the connections refused."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.joining: list[C] = []
        #: (peer address, host id if known, why), newest last, at most MAX_REFUSED.
        self.refused: list[tuple[str, str, str]] = []

    def refusal(self, hello: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """Why a worker with this (authenticated) ``hello`` cannot join, and the extra ``error`` keys;
        None if it may."""
        if hello.get("kind") != "worker":
            return f"expected a worker hello, got kind {hello.get('kind')!r}", {}
        world, rank, listen, hid = (hello.get("world"), hello.get("rank"), hello.get("listen"),
                                    hello.get("host_id"))
        if world is not None and world != self.world:
            return f"worker expects world={world!r} but the master runs world={self.world}", {"key": "world"}
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
                return f"requested rank {rank!r} is not in [0, {self.world})", {"key": "rank"}
            holder = next((c for c in self.joining if c.rank == rank), None)
            if holder is not None:
                return (f"rank {rank} is already taken by the worker from {holder.peer} "
                        f"(pid {holder.hello.get('pid')})"), {"key": "rank"}
        if not isinstance(listen, dict):
            return "worker hello lacks a 'listen' map", {}
        if not isinstance(hid, str):
            return "worker hello lacks a 'host_id' string", {}
        if len(self.joining) >= self.world:  # defensive: the table goes out as soon as it is full
            return f"the job is full ({self.world} workers)", {}
        return None

    def note_refused(self, peer: str, host: str, why: str) -> None:
        """Remember a connection refused while the job assembles, for the join-failure message."""
        self.refused.append((peer, host, why))
        del self.refused[:-MAX_REFUSED]

    def timeout_message(self, address: tuple[str, int], join_timeout: float) -> str:
        """Why the job did not start in time: who joined (from which hosts) and who was refused."""
        joined: dict[str, int] = {}
        for c in self.joining:
            w = where(c.peer, c.hello.get("host_id"))
            joined[w] = joined.get(w, 0) + 1
        text = (f"only {len(self.joining)} of {self.world} workers joined the master at "
                f"{hostport(address)} within {join_timeout:g}s")
        if joined:
            text += " (joined: " + ", ".join(f"{n} from {w}" for w, n in sorted(joined.items())) + ")"
        if self.refused:
            text += "; refused: " + "; ".join(f"{where(p, h)}: {why}" for p, h, why in self.refused)
        else:
            text += "; no other worker reached it"
        return text

    def assign(self) -> tuple[list[C], list[dict[str, Any]], list[str]]:
        """Give every joined worker a rank: ``(workers by rank, address table, place of each rank)``."""
        from ..topology import number_workers
        number_workers(self.joining, self.world)   # host-contiguous, deterministic (twisternet.topology)
        ordered = sorted(self.joining, key=lambda c: c.rank)  # type: ignore[arg-type,return-value]
        table = []
        for conn in ordered:
            entry = dict(conn.hello["listen"])
            if "host_id" in entry:
                log.warning("bootstrap master: rank %d's listen map has a 'host_id' key; replaced",
                            conn.rank)
            entry["host_id"] = conn.hello["host_id"]
            table.append(entry)
        places = rank_places([(c.hello.get("host_id"), c.peer.rpartition(":")[0] or c.peer)
                              for c in ordered])
        return ordered, table, places
