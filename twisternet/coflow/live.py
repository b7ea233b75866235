"""Live coflow scheduling inside a running :class:`~twisternet.context.Context` (docs/design.md section 6).

With ``coflow_policy`` set (anything but ``"none"``) every Context owns a :class:`CoflowRuntime`. Each
operation instance registers a coflow with it when it is created (:meth:`CoflowRuntime.attach`, called
from ``collectives.base.Operation``) and unregisters when it is closed (:meth:`CoflowRuntime.detach`).
Its flows are (source rank, destination rank, bytes) for every source rank x destination rank pair of
the operation; the bytes are the size the user announced (``ctx.coflow(..., size=...)`` or the
operation's ``coflow_size=``), else an estimate of :data:`DEFAULT_FLOW_BYTES` per flow. Bytes handed to
the channel are reported back, so size-based policies see what is left.

Users group operations into one coflow, with a deadline and parent coflows (a DAG of stages)::

    with ctx.coflow("stage2", size=8 << 20, deadline=2.0, parents=["stage1"]):
        g = Gather(ctx, ..., edge=3)
        p = Partition(ctx, ..., edge=4)

A streaming operation is one coflow until its code calls :meth:`CoflowRuntime.new_window` (``ctx.coflows
.new_window(op.edge)``), which ends the current window's coflow and starts the next.

With ``coflow_coordinator`` (the default) each rank also reports its coflows and progress to the job's
:class:`~twisternet.coflow.coordinator.CoflowCoordinator` and follows the order it pushes; if the coordinator
falls silent for ``stale_after`` seconds the rank goes back to its own (identical in input, so consistent)
local ordering. Every rank of a job creates the same operations, so every rank registers the same coflows and
ranks them the same way without talking to anyone. The Context asks :meth:`CoflowRuntime.edge_rank` for the
rank order of each channel edge when it hands queued messages to the channel (most urgent first) and, with
``coflow_pacing``, :meth:`CoflowRuntime.pace` for a token-bucket admission of each flow.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable, Hashable, Iterator, Sequence

from .errors import CoflowError
from .live_table import LiveCoflowTable

__all__ = ["CoflowRuntime", "CoflowGroup", "DEFAULT_FLOW_BYTES", "EDGES_PER_USER_EDGE"]

log = logging.getLogger(__name__)

#: Bytes assumed per flow of an operation whose size nobody announced.
DEFAULT_FLOW_BYTES = 1 << 20
#: Channel edges per user edge (user edge e owns channel edges [64e, 64e + 64); collectives.edges).
EDGES_PER_USER_EDGE = 64
#: Rank order reported for traffic of no registered coflow (control edges, unknown edges): first.
UNSCHEDULED_RANK = -1


@dataclass
class CoflowGroup:
    """A user-declared coflow: operations created inside ``ctx.coflow(...)`` join it."""

    name: Hashable
    size: float | None = None
    deadline: float | None = None
    parents: tuple[Hashable, ...] = ()
    edges: set[int] = field(default_factory=set)
    flows: dict[tuple[int, int], float] = field(default_factory=dict)
    registered: bool = False


class CoflowRuntime:
    """Per-Context coflow registry and priority cache; thread-safe.

    ``world`` ranks; ``rank`` this process; ``policy`` a registered policy name; ``rank_capacity`` bytes/s
    per rank port; ``interval`` seconds between periodic recomputations; ``clock`` for tests.
    """

    def __init__(self, world: int, rank: int, policy: str, *, rank_capacity: float = 125e6,
                 interval: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self.world, self.rank, self.policy_name = int(world), int(rank), policy
        self.interval = float(interval)
        self._clock = clock
        self._capacity = float(rank_capacity)
        self.table = LiveCoflowTable(world, policy, rank_capacity=rank_capacity, clock=clock)
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._groups: dict[Hashable, CoflowGroup] = {}
        self._edge_coflow: dict[int, Hashable] = {}        # user edge -> coflow id
        self._edge_rank: dict[int, int] = {}                # user edge -> rank order (cache)
        self._rates: dict[Hashable, list[float]] = {}
        self._remote_rates: dict[str, list[float]] = {}   # per-flow rates pushed by the coordinator
        self._progress: dict[tuple[Hashable, int], float] = {}   # (coflow, dst) -> bytes not yet reported
        self._buckets: dict[tuple[Hashable, int], list[float]] = {}  # (coflow, dst) -> [tokens, t]
        self._dirty = True
        self._next = 0.0
        self._remote: dict[str, int] | None = None           # priorities pushed by a coordinator
        self._remote_at = float("-inf")
        #: Seconds without a schedule from the coordinator after which local ordering takes over.
        self.stale_after = max(1.0, 5 * self.interval)
        self._send_fn: Callable[[dict], None] | None = None
        self._outbox: list[dict] = []
        self._pending_reg: dict[Hashable, dict] = {}           # registrations not yet sent (merged groups)

    # ------------------------------------------------------------------ user grouping
    @contextlib.contextmanager
    def group(self, name: Hashable, *, size: float | None = None, deadline: float | None = None,
              parents: Sequence[Hashable] = ()) -> Iterator[CoflowGroup]:
        """Operations created in this block (on this thread) form one coflow called ``name``."""
        if size is not None and not size > 0:
            raise CoflowError(f"coflow {name!r}: size must be > 0 bytes, got {size!r}")
        if deadline is not None and not deadline > 0:
            raise CoflowError(f"coflow {name!r}: deadline must be > 0 seconds, got {deadline!r}")
        with self._lock:
            if name in self._groups:
                raise CoflowError(f"coflow {name!r} already exists")
            g = self._groups[name] = CoflowGroup(name, None if size is None else float(size), deadline,
                                                 tuple(parents))
        prev = getattr(self._tls, "group", None)
        self._tls.group = g
        try:
            yield g
        finally:
            self._tls.group = prev
            with self._lock:
                if not g.edges:
                    self._groups.pop(name, None)   # nothing joined: nothing to schedule

    # ------------------------------------------------------------------ operation hook
    def attach(self, edge: int, name: str, source_ranks: Sequence[int], destination_ranks: Sequence[int],
               *, size: float | None = None) -> Hashable:
        """Register the operation on user edge ``edge`` (in the current group, else as its own coflow);
        returns the coflow id. ``size`` is the operation's total bytes, if known."""
        g = getattr(self._tls, "group", None)
        with self._lock:
            if edge in self._edge_coflow:
                raise CoflowError(f"edge {edge} is already attached to coflow {self._edge_coflow[edge]!r}")
            if g is None:
                cid: Hashable = f"{name}@{edge}"
                g = self._groups[cid] = CoflowGroup(cid, None if size is None else float(size))
            pairs = [(s, d) for s in sorted(set(source_ranks)) for d in sorted(set(destination_ranks)) if s != d]
            if not pairs:   # purely local operation: still tracked so its edge has a defined rank
                pairs = [(s, s) for s in sorted(set(source_ranks))[:1]] or [(self.rank, self.rank)]
            total = size if size is not None else g.size
            per = (float(total) / len(pairs)) if total else float(DEFAULT_FLOW_BYTES)
            for p in pairs:
                g.flows[p] = g.flows.get(p, 0.0) + per
            g.edges.add(edge)
            self._edge_coflow[edge] = g.name
            self._reregister(g)
            if self._send_fn is not None:
                self._pending_reg[g.name] = {
                    "op": "register", "id": str(g.name), "deadline": g.deadline,
                    "parents": [str(p) for p in g.parents],
                    "flows": [[s, d, max(b, 1.0)] for (s, d), b in g.flows.items()]}
            return g.name

    def new_window(self, edge: int, *, size: float | None = None) -> Hashable:
        """Start the next window of the streaming operation on user edge ``edge``: its current coflow
        ends and a new one (id ``<old id>#<n>``, same flows, ``size`` bytes if known) begins."""
        with self._lock:
            cid = self._edge_coflow.get(edge)
            if cid is None:
                raise CoflowError(f"edge {edge} has no coflow")
            g = self._groups[cid]
            pairs = list(g.flows)
            base, _, n = str(cid).rpartition("#") if "#" in str(cid) else (str(cid), "", "0")
            new_id = f"{base}#{int(n) + 1 if n.isdigit() else 1}"
            self.detach(edge)
            ng = self._groups[new_id] = CoflowGroup(new_id, None if size is None else float(size))
            per = float(size) / len(pairs) if size else float(DEFAULT_FLOW_BYTES)
            ng.flows = {p: per for p in pairs}
            ng.edges.add(edge)
            self._edge_coflow[edge] = new_id
            self._reregister(ng)
            if self._send_fn is not None:
                self._pending_reg[new_id] = {"op": "register", "id": new_id, "deadline": None, "parents": [],
                                             "flows": [[s, d, b] for (s, d), b in ng.flows.items()]}
            return new_id

    def detach(self, edge: int) -> None:
        """The operation on user edge ``edge`` is done; the coflow ends with its last operation."""
        with self._lock:
            cid = self._edge_coflow.pop(edge, None)
            self._edge_rank.pop(edge, None)
            if cid is None:
                return
            g = self._groups.get(cid)
            if g is None:
                return
            g.edges.discard(edge)
            if not g.edges:
                del self._groups[cid]
                if g.registered and cid in self.table:
                    self.table.unregister(cid)
                if self._send_fn is not None and self._pending_reg.pop(cid, None) is None:
                    self._outbox.append({"op": "unregister", "id": str(cid)})
                for k in [k for k in self._progress if k[0] == cid]:
                    del self._progress[k]
                for k in [k for k in self._buckets if k[0] == cid]:
                    del self._buckets[k]
                self._dirty = True

    def _reregister(self, g: CoflowGroup) -> None:
        remaining = None
        if g.registered and g.name in self.table:
            remaining = self.table.remaining(g.name)
            self.table.unregister(g.name)
        flows = [(s, d, max(b, 1.0)) for (s, d), b in g.flows.items()]
        self.table.register(g.name, flows, deadline=g.deadline, parents=g.parents)
        if remaining is not None:
            for i, (left, (_, _, b)) in enumerate(zip(remaining, flows)):
                done = max(0.0, b - left)
                if done:
                    self.table.report_progress(g.name, i, done)
        g.registered = True
        self._dirty = True

    # ------------------------------------------------------------------ queries from the engine
    def coflow_of(self, channel_edge: int) -> Hashable | None:
        """The coflow id a channel edge's traffic belongs to (None: unscheduled)."""
        return self._edge_coflow.get(channel_edge // EDGES_PER_USER_EDGE)

    def edge_rank(self, channel_edge: int) -> int:
        """Rank order of a channel edge's coflow (0 = most urgent; unscheduled traffic first)."""
        return self._edge_rank.get(channel_edge // EDGES_PER_USER_EDGE, UNSCHEDULED_RANK)

    def refresh(self, force: bool = False) -> bool:
        """Recompute priorities and rates if something changed or ``interval`` passed; True if done."""
        now = self._clock()
        with self._lock:
            if not (force or self._dirty or now >= self._next):
                return False
            self._flush_progress()
            try:
                prio = self.table.priorities()
                if self._remote is not None and now - self._remote_at <= self.stale_after:
                    # the coordinator's job-wide order; coflows it does not know yet rank after its own
                    known = len(self._remote)
                    prio = {cid: self._remote.get(str(cid), known + r) for cid, r in prio.items()}
                rates = self.table.rates()
                if self._remote is not None and now - self._remote_at <= self.stale_after:
                    # the coordinator's job-wide rates where it has them (same flow order everywhere)
                    for cid in rates:
                        theirs = self._remote_rates.get(str(cid))
                        if theirs is not None and len(theirs) == len(rates[cid]):
                            rates[cid] = theirs
                self._rates = rates
            except Exception:  # a failing policy must not stop the data; keep old order
                log.exception("rank %d: coflow policy %s failed; keeping the previous order",
                              self.rank, self.policy_name)
                self._dirty, self._next = False, now + self.interval
                return False
            worst = max(prio.values(), default=-1) + 1
            self._edge_rank = {e: prio.get(cid, worst) for e, cid in self._edge_coflow.items()}
            self._dirty, self._next = False, now + self.interval
            return True

    def report_sent(self, channel_edge: int, dst: int, nbytes: int) -> None:
        """The engine handed ``nbytes`` of a channel edge's traffic for ``dst`` to the channel."""
        cid = self._edge_coflow.get(channel_edge // EDGES_PER_USER_EDGE)
        if cid is not None:
            k = (cid, dst)
            self._progress[k] = self._progress.get(k, 0.0) + nbytes

    def _flush_progress(self) -> None:
        for (cid, dst), n in list(self._progress.items()):
            g = self._groups.get(cid)
            if g is None or not g.registered:
                continue
            flow = (self.rank, dst)
            if flow in g.flows:
                try:
                    self.table.report_progress(cid, flow, n)
                except CoflowError:
                    pass
                if self._send_fn is not None and n:
                    self._outbox.append({"op": "progress", "id": str(cid), "sent": [[self.rank, dst, n]]})
            self._progress[(cid, dst)] = 0.0
        self._progress = {k: v for k, v in self._progress.items() if v}

    def pace(self, channel_edge: int, dst: int, nbytes: int) -> float:
        """Token bucket for pacing: 0.0 if ``nbytes`` may go to ``dst`` now (and takes the tokens),
        else seconds until enough tokens accrue. Unpaced traffic (no coflow, no rate) always goes."""
        cid = self._edge_coflow.get(channel_edge // EDGES_PER_USER_EDGE)
        if cid is None:
            return 0.0
        g = self._groups.get(cid)
        rates = self._rates.get(cid)
        if g is None or not rates:
            return 0.0
        try:
            idx = list(g.flows).index((self.rank, dst))
        except ValueError:
            return 0.0
        rate = rates[idx] if idx < len(rates) else 0.0
        if not rate > 0:
            return 0.0      # the policy gives it no share now: priority order alone decides
        now = self._clock()
        b = self._buckets.get((cid, dst))
        burst = max(float(nbytes), rate * 0.01)
        if b is None:
            b = self._buckets[(cid, dst)] = [burst, now]
        b[0] = min(burst, b[0] + (now - b[1]) * rate)
        b[1] = now
        if b[0] >= nbytes or b[0] >= burst:
            b[0] -= nbytes
            return 0.0
        return (nbytes - b[0]) / rate

    # ------------------------------------------------------------------ coordinator
    def connect(self, send: Callable[[dict], None]) -> None:
        """Report to a coordinator through ``send(msg)`` (twisternet.coflow.coordinator protocol)."""
        with self._lock:
            self._send_fn = send
            self._outbox.append({"op": "hello", "policy": self.policy_name, "world": self.world,
                                 "capacity": self._capacity, "interval": self.interval})

    def on_schedule(self, msg: dict) -> None:
        """A schedule pushed by the coordinator (``ctx.services`` subscription callback)."""
        if msg.get("op") != "schedule" or not isinstance(msg.get("prio"), dict):
            log.warning("rank %d: unexpected coflow coordinator message %r", self.rank, msg)
            return
        self.set_remote_priorities(msg["prio"], msg.get("rates") if isinstance(msg.get("rates"), dict) else None)

    def set_remote_priorities(self, prio: dict[str, int] | None,
                              rates: dict[str, list[float]] | None = None) -> None:
        """Use priorities (and per-flow pacing rates, in each coflow's flow order) computed by a
        coordinator (None: back to local ordering and rates)."""
        with self._lock:
            self._remote = None if prio is None else {str(k): int(v) for k, v in prio.items()}
            self._remote_rates = ({} if prio is None or rates is None else
                                  {str(k): [float(x) for x in v] for k, v in rates.items()})
            self._remote_at = self._clock()
            self._dirty = True

    @property
    def using_coordinator(self) -> bool:
        """Whether the current order comes from a live coordinator (else: local ordering)."""
        with self._lock:
            return self._remote is not None and self._clock() - self._remote_at <= self.stale_after

    def flush_outbox(self) -> None:
        """Send queued coordinator messages (call without the Context lock held). A coordinator that is
        gone only costs the messages: ordering falls back to local once its schedule goes stale."""
        with self._lock:
            if self._send_fn is None or not (self._outbox or self._pending_reg):
                return
            hello = [m for m in self._outbox if m["op"] == "hello"]
            rest = [m for m in self._outbox if m["op"] != "hello"]
            msgs = hello + list(self._pending_reg.values()) + rest
            self._pending_reg.clear()
            self._outbox = []
            send = self._send_fn
        for m in msgs:
            try:
                send(m)
            except Exception as e:  # noqa: BLE001 - the coordinator is best effort
                log.debug("rank %d: coflow coordinator unreachable: %r", self.rank, e)
                return

    def coflows(self) -> dict[Hashable, dict[str, Any]]:
        """Snapshot of the registered coflows (id -> flows, deadline, parents, edges)."""
        with self._lock:
            return {cid: {"flows": [(s, d, b) for (s, d), b in g.flows.items()], "deadline": g.deadline,
                          "parents": list(g.parents), "edges": sorted(g.edges)}
                    for cid, g in self._groups.items() if g.registered}

    def __len__(self) -> int:
        with self._lock:
            return sum(1 for g in self._groups.values() if g.registered)
