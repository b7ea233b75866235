"""``CoflowCoordinator``: the job-wide coflow scheduler, a coordinator service (twisternet.services).

Like the Varys master it runs in one place (the bootstrap master under TCP, rank 0 under MPI and the
local channel). Every rank's :class:`~twisternet.coflow.live.CoflowRuntime` sends it its coflow
registrations (id, flows, deadline, parents), the bytes it has sent per flow, and unregistrations. The
coordinator keeps one :class:`LiveCoflowTable` for the job (a coflow is registered by its first
announcement and ends when every rank that announced it has unregistered it), recomputes the schedule on
every change and at least every ``interval`` seconds, and pushes ``{"op": "schedule", "prio": {id: rank},
"seq": n}`` to every rank it has heard from. Coflow ids travel as strings.

Messages (dicts) from a rank::

    {"op": "hello", "policy": str, "world": int, "capacity": float, "interval": float}
    {"op": "register", "id": str, "flows": [[src, dst, bytes], ...], "deadline": float|None, "parents": [str]}
    {"op": "progress", "id": str, "sent": [[src, dst, bytes], ...]}
    {"op": "unregister", "id": str}
"""

from __future__ import annotations

import logging
import time

from .errors import CoflowError
from .live_table import LiveCoflowTable

__all__ = ["CoflowCoordinator", "SERVICE_NAME"]

log = logging.getLogger(__name__)

#: Name under which the coordinator is registered with twisternet.services.
SERVICE_NAME = "coflow"


class CoflowCoordinator:
    """Job-wide coflow table and schedule pusher (the service object; see module doc for the protocol)."""

    def __init__(self) -> None:
        self.table: LiveCoflowTable | None = None
        self.interval = 0.1
        self.ranks: set[int] = set()
        self._owners: dict[str, set[int]] = {}     # coflow id -> ranks that announced and not yet left
        self._dirty = False
        self._next: float | None = None
        self.seq = 0

    # ------------------------------------------------------------------ service interface
    def handle(self, src: int, msg: dict, now: float) -> list[tuple[int, dict]]:
        """Apply one rank's message; returns the schedule for every rank if it changed."""
        op = msg.get("op")
        self.ranks.add(int(src))
        try:
            if op == "hello":
                if self.table is None:
                    self.table = LiveCoflowTable(int(msg["world"]), str(msg["policy"]),
                                                 rank_capacity=float(msg["capacity"]))
                    self.interval = float(msg.get("interval", 0.1))
                self._dirty = True
            elif self.table is None:
                log.warning("coflow coordinator: %r from rank %d before any hello; ignored", op, src)
                return []
            elif op == "register":
                cid = str(msg["id"])
                owners = self._owners.setdefault(cid, set())
                if cid not in self.table:
                    self.table.register(cid, [tuple(f) for f in msg["flows"]], deadline=msg.get("deadline"),
                                        parents=[str(p) for p in msg.get("parents", ())])
                    self._dirty = True
                owners.add(int(src))
            elif op == "progress":
                cid = str(msg["id"])
                if cid in self.table:
                    for s, d, b in msg.get("sent", ()):
                        try:
                            self.table.report_progress(cid, (int(s), int(d)), float(b))
                        except CoflowError:
                            pass   # a flow the registration did not announce: nothing to account
                    self._dirty = True
            elif op == "unregister":
                cid = str(msg["id"])
                holders = self._owners.get(cid)
                if holders is not None:
                    holders.discard(int(src))
                    if not holders:
                        del self._owners[cid]
                        if cid in self.table:
                            self.table.unregister(cid)
                        self._dirty = True
            else:
                log.warning("coflow coordinator: unknown message %r from rank %d", op, src)
                return []
        except (CoflowError, KeyError, TypeError, ValueError) as e:
            log.error("coflow coordinator: bad %r message from rank %d: %s", op, src, e)
            return []
        if self._next is None:
            self._next = now
        return []   # the schedule goes out from tick(), batching a burst of registrations

    def tick(self, now: float) -> list[tuple[int, dict]]:
        """Push the schedule to every known rank (on change, and at least every ``interval``)."""
        if self.table is None or (not self._dirty and len(self.table) == 0):
            self._next = None     # idle: no periodic pushes until the next change
            return []
        self._next = now + self.interval
        self._dirty = False
        self.seq += 1
        prio = {str(k): int(v) for k, v in self.table.priorities().items()}
        rates = {str(k): [float(x) for x in v] for k, v in self.table.rates().items()}
        msg = {"op": "schedule", "prio": prio, "rates": rates, "seq": self.seq}
        return [(r, msg) for r in sorted(self.ranks)]

    def next_deadline(self) -> float | None:
        """When :meth:`tick` must run next (soon after a change)."""
        if self._next is None:
            return None
        return min(self._next, time.monotonic()) if self._dirty else self._next
