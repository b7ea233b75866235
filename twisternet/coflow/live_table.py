"""``LiveCoflowTable``: the runtime's view of its coflows, ranked by a scheduling policy.

The channels (or the coordinator, like the Varys master) register each coflow with its flows as
``(src_rank, dst_rank, bytes)``, report bytes sent as they go, and unregister it when done. Ranks play
the role of fabric ports: each rank has an ingress ("send") and an egress ("receive") port of
``rank_capacity`` bytes/s. :meth:`priorities` runs the chosen policy (the same classes the simulator
uses) and returns coflow id -> rank order (0 = most urgent); :meth:`rates` gives per-flow rates for
pacing. The table is pure bookkeeping (no I/O, no threads of its own) and every method is thread-safe.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from collections.abc import Callable, Hashable, Iterable, Sequence

import numpy as np

from .errors import CoflowError
from .model import GBIT, Allocation, Coflow, PortCapacities
from .scheduler import Scheduler, get_policy

__all__ = ["LiveCoflowTable"]


class LiveCoflowTable:
    """Thread-safe registry of live coflows with policy-computed priorities and rates.

    ``world`` is the number of ranks; ``policy`` a registered policy name (``policy_opts`` are passed
    to it) or a :class:`Scheduler` instance; ``clock`` returns seconds (``time.monotonic`` by default;
    inject one for tests). Coflows whose parents are still registered wait (they are not ranked until
    every parent is unregistered). Coflows the policy rejects (admission control) keep being tracked and
    are ranked after all admitted ones, because the runtime still has to deliver their data.
    """

    def __init__(self, world: int, policy: str | Scheduler = "sebf", rank_capacity: float = GBIT,
                 clock: Callable[[], float] = time.monotonic, **policy_opts: Any) -> None:
        if world < 1:
            raise CoflowError(f"world must be >= 1, got {world}")
        self.world = int(world)
        self.capacities = PortCapacities.uniform(self.world, rank_capacity)
        if isinstance(policy, str):
            self.policy = get_policy(policy, **policy_opts)
        else:
            if policy_opts:
                raise CoflowError("policy options are only accepted with a policy name")
            self.policy = policy
        self._clock = clock
        self._t0 = clock()
        self._lock = threading.RLock()
        self._coflows: dict[Hashable, Coflow] = {}
        self._rejected: set[Hashable] = set()
        self._alloc: Allocation | None = None
        self._alloc_timer: float | None = None

    def _now(self) -> float:
        return max(0.0, self._clock() - self._t0)

    # ---------------------------------------------------------------- updates
    def register(self, coflow_id: Hashable, flows: Iterable[tuple[int, int, float]],
                 deadline: float | None = None, parents: Sequence[Hashable] = ()) -> bool:
        """Add a coflow; returns False if the policy rejected it (it is still tracked, ranked last).

        ``deadline`` is seconds from now; ``parents`` are ids of coflows that must finish first.
        """
        fl = list(flows)
        if not fl:
            raise CoflowError(f"coflow {coflow_id!r}: needs at least one flow")
        for f in fl:
            if len(f) != 3:
                raise CoflowError(f"coflow {coflow_id!r}: flows are (src_rank, dst_rank, bytes), got {f!r}")
            s, d, b = f
            if not (0 <= int(s) < self.world and 0 <= int(d) < self.world):
                raise CoflowError(f"coflow {coflow_id!r}: flow {f!r} names a rank outside 0..{self.world - 1}")
            if not (float(b) > 0):
                raise CoflowError(f"coflow {coflow_id!r}: flow {f!r} must carry > 0 bytes")
        with self._lock:
            if coflow_id in self._coflows:
                raise CoflowError(f"coflow {coflow_id!r} is already registered")
            now = self._now()
            c = Coflow(coflow_id, now, deadline=deadline, parents=tuple(parents),
                       src=np.array([int(f[0]) for f in fl]), dst=np.array([int(f[1]) for f in fl]),
                       size=np.array([float(f[2]) for f in fl]))
            self._coflows[coflow_id] = c
            admitted = self.policy.on_arrival(c, now, self.capacities)
            if not admitted:
                self._rejected.add(coflow_id)
            self._alloc = None
            return bool(admitted)

    def report_progress(self, coflow_id: Hashable, flow: int | tuple[int, int], bytes_sent: float) -> None:
        """Record ``bytes_sent`` more bytes (an increment) on a flow, given by its index in registration
        order or as ``(src_rank, dst_rank)`` (the first such flow with bytes left)."""
        if not (bytes_sent >= 0):
            raise CoflowError(f"bytes_sent must be >= 0, got {bytes_sent!r}")
        with self._lock:
            c = self._get(coflow_id)
            if isinstance(flow, tuple):
                idx = np.flatnonzero((c.src == flow[0]) & (c.dst == flow[1]))
                if idx.size == 0:
                    raise CoflowError(f"coflow {coflow_id!r} has no flow {flow!r}")
                left = idx[c.remaining[idx] > 0]
                i = int(left[0]) if left.size else int(idx[0])
            else:
                i = int(flow)
                if not 0 <= i < len(c):
                    raise CoflowError(f"coflow {coflow_id!r} has no flow index {i}")
            c.remaining[i] = max(0.0, c.remaining[i] - float(bytes_sent))
            self._alloc = None

    def unregister(self, coflow_id: Hashable) -> None:
        """Remove a finished (or abandoned) coflow; releases coflows waiting on it."""
        with self._lock:
            c = self._get(coflow_id)
            del self._coflows[coflow_id]
            self._rejected.discard(coflow_id)
            self.policy.on_completion(c, self._now())
            self._alloc = None

    def _get(self, coflow_id: Hashable) -> Coflow:
        try:
            return self._coflows[coflow_id]
        except KeyError:
            raise CoflowError(f"coflow {coflow_id!r} is not registered") from None

    # ---------------------------------------------------------------- queries
    def _allocation(self) -> Allocation:
        now = self._now()
        if self._alloc is not None and (self._alloc_timer is None or now < self._alloc_timer):
            return self._alloc
        ready = [c for c in self._coflows.values()
                 if c.remaining.any() and not any(p in self._coflows for p in c.parents)]
        served = [c for c in ready if c.id not in self._rejected or self.policy.serve_rejected]
        alloc = self.policy.allocate(served, now, self.capacities) if served else Allocation()
        late = [c.id for c in ready if c.id not in alloc.rates]
        alloc.order = list(alloc.order) + sorted(late, key=lambda cid: self._coflows[cid].arrival)
        for cid in late:
            alloc.rates[cid] = np.zeros(len(self._coflows[cid]))
        self._alloc = alloc
        self._alloc_timer = self.policy.next_timer(now)
        return alloc

    def priorities(self) -> dict[Hashable, int]:
        """Coflow id -> rank order (0 = most urgent) over the coflows ready to send."""
        with self._lock:
            return self._allocation().priorities()

    def rates(self) -> dict[Hashable, list[float]]:
        """Coflow id -> per-flow rate in bytes/s (registration order) for pacing."""
        with self._lock:
            return {cid: [float(x) for x in r] for cid, r in self._allocation().rates.items()}

    def rejected(self) -> list[Hashable]:
        """Ids of registered coflows the policy rejected."""
        with self._lock:
            return sorted(self._rejected, key=lambda cid: self._coflows[cid].arrival)

    def remaining(self, coflow_id: Hashable) -> list[float]:
        """Bytes left per flow of a registered coflow."""
        with self._lock:
            return [float(x) for x in self._get(coflow_id).remaining]

    def __len__(self) -> int:
        with self._lock:
            return len(self._coflows)

    def __contains__(self, coflow_id: object) -> bool:
        with self._lock:
            return coflow_id in self._coflows
