"""The simulator's event loop as it was before the incremental engine: the reference that
test_coflow_engine_equivalence.py compares the new engine with, coflow by coflow.

Every event rebuilds the rates of all active flows from the policy's allocation and advances every
active flow; its coflows keep ``version`` None, so the policies take their uncached paths (the
allocator as it was). Not used by the library.
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Any
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from twisternet.coflow.errors import CoflowError, SimulationError
from twisternet.coflow.model import Coflow, PortCapacities
from twisternet.coflow.rate_allocation import effective_bottleneck
from twisternet.coflow.scheduler import Scheduler, get_policy
from twisternet.coflow.simulator import CoflowResult, SimulationResult

_TIME_RES = 1e-9


# The old engine, kept as it was (complexity accepted).
def simulate_reference(coflows: Iterable[Coflow], policy: Scheduler | str, capacities: PortCapacities, *,  # noqa: C901
             realloc_gap: float = 0.0, max_events: int | None = None,
             **policy_opts: Any) -> SimulationResult:
    """Simulate ``coflows`` (copied; inputs are not mutated) under ``policy`` (an instance or a registered
    name plus ``policy_opts``) on a fabric with ``capacities``.

    ``realloc_gap`` (seconds, default 0 = exact): a flow completing while the rest of its coflow still
    runs triggers a re-allocation no sooner than ``realloc_gap`` after the previous one (its freed
    capacity idles meanwhile). Coflow releases, coflow completions and policy timers always re-allocate
    at once, so CCTs stay exact given the rates; only the hand-out of capacity freed by single flows is
    delayed by at most the gap. ``max_events`` bounds the run (an error if exceeded) so a misbehaving
    custom policy cannot loop forever.

    Engine: every flow's remaining bytes live in one flat array (each coflow's ``remaining`` is a view
    into it), the flows of the active coflows are indexed by one integer array rebuilt only when a
    coflow is released or completes, and releases wait in a heap. An event therefore costs the policy's
    ``allocate`` plus a fixed number of vector operations over the active flows (next completion time
    per coflow by ``maximum.reduceat``, progress, completion test), never a Python loop over flows."""
    if not (realloc_gap >= 0) or not math.isfinite(realloc_gap):
        raise CoflowError(f"realloc_gap must be a finite number of seconds >= 0, got {realloc_gap!r}")
    sched = get_policy(policy, **policy_opts) if isinstance(policy, str) else policy
    if policy_opts and not isinstance(policy, str):
        raise CoflowError("policy options are only accepted with a policy name")
    work = [c.reset() for c in coflows]
    ids: dict[Hashable, Coflow] = {}
    for c in work:
        if c.id in ids:
            raise CoflowError(f"duplicate coflow id {c.id!r}")
        capacities.check(c)
        ids[c.id] = c
    for c in work:
        for p in c.parents:
            if p not in ids:
                raise CoflowError(f"coflow {c.id!r} has unknown parent {p!r}")
    results = {c.id: CoflowResult(c.id, c.arrival, None, None, c.deadline, True, c.total_bytes, len(c),
                                  effective_bottleneck(c, capacities.ingress, capacities.egress))
               for c in work}
    # One flat array of remaining bytes; every coflow's ``remaining`` becomes a view into it.
    lens = [len(c) for c in work]
    offs = np.zeros(len(work) + 1, dtype=np.int64)
    np.cumsum(lens, out=offs[1:])
    rem_all = np.concatenate([c.remaining for c in work]) if work else np.zeros(0)
    size_all = np.concatenate([c.size for c in work]) if work else np.zeros(0)
    pos: dict[Hashable, int] = {}
    for k, c in enumerate(work):
        c.remaining = rem_all[offs[k]:offs[k + 1]]
        pos[c.id] = k
    children: dict[Hashable, list[Coflow]] = {}
    blocked: dict[Hashable, int] = {}
    for c in work:
        blocked[c.id] = len(set(c.parents))
        for p in set(c.parents):
            children.setdefault(p, []).append(c)
    # Coflows become "ready" (released) at max(arrival, last parent done); ties keep input order.
    ready: list[tuple[float, int, int]] = []
    seq = 0
    for k, c in sorted(enumerate(work), key=lambda kc: (kc[1].arrival, kc[0])):
        if blocked[c.id] == 0:
            ready.append((c.arrival, seq, k))
            seq += 1
    heapq.heapify(ready)
    active: list[Coflow] = []
    view = _ActiveFlows(offs, size_all)
    t = 0.0
    events = 0
    started = time.perf_counter()
    name = getattr(sched, "name", type(sched).__name__)

    def finish_parent(cid: Hashable, now: float) -> None:
        nonlocal seq
        for ch in children.get(cid, ()):
            blocked[ch.id] -= 1
            if blocked[ch.id] == 0:
                heapq.heappush(ready, (max(ch.arrival, now), seq, pos[ch.id]))
                seq += 1

    while True:
        # Release every coflow due by now (never before its time: a coflow may not send before it
        # exists, so no tolerance here; the loop below lands exactly on release times).
        changed = False
        while ready and ready[0][0] <= t:
            _, _, k = heapq.heappop(ready)
            c = work[k]
            res = results[c.id]
            res.release = t
            if sched.on_arrival(c, t, capacities):
                active.append(c)
                changed = True
            else:
                res.admitted = False
                if sched.serve_rejected:
                    active.append(c)
                    changed = True
                else:
                    finish_parent(c.id, t)
        if not active:
            if not ready:
                break
            t = max(t, ready[0][0])
            continue
        if changed:
            view.rebuild([pos[c.id] for c in active])
        events += 1
        if max_events is not None and events > max_events:
            raise SimulationError(f"policy {name!r}: more than {max_events} events")
        alloc = sched.allocate(active, t, capacities)
        rates = view.gather_rates(alloc, active, name)
        rem = rem_all[view.idx]
        live = rem > 0
        m = live & (rates > 0)
        with np.errstate(divide="ignore", invalid="ignore"):
            ft = np.where(m, rem / np.where(m, rates, 1.0), math.inf)
        dt_flow = float(ft.min()) if ft.size else math.inf          # earliest completion of any flow
        # A coflow completes when its last live flow does; a live flow without rate never completes.
        per_cf = np.maximum.reduceat(np.where(live, ft, 0.0), view.starts)
        dt_coflow = float(per_cf.min()) if per_cf.size else math.inf  # earliest whole-coflow completion
        t_next = t + min(dt_coflow, max(dt_flow, realloc_gap))
        if ready:
            t_next = min(t_next, ready[0][0])
        timer = sched.next_timer(t)
        if timer is not None and timer > t:
            t_next = min(t_next, timer)
        if not math.isfinite(t_next):
            raise SimulationError(f"policy {name!r} gives no rate to any of {len(active)} active coflows "
                                  f"at t={t:.6f}s and nothing else will happen")
        dt = max(0.0, t_next - t)
        t = t_next
        if dt > 0:
            rem -= rates * dt
        done = (rem <= view.size * 1e-12) | (rem <= rates * _TIME_RES)
        rem[done] = 0.0
        rem_all[view.idx] = rem
        alive = np.logical_or.reduceat(rem > 0, view.starts)
        if not alive.all():
            still: list[Coflow] = []
            for c, a in zip(active, alive.tolist()):
                if a:
                    still.append(c)
                else:
                    results[c.id].finish = t
                    sched.on_completion(c, t)
                    finish_parent(c.id, t)
            active = still
            if active:
                view.rebuild([pos[c.id] for c in active])
    out = SimulationResult(name, [results[c.id] for c in work], events,
                           time.perf_counter() - started)
    return out


class _ActiveFlows:
    """Index of the active coflows' flows in the flat arrays: ``idx`` (flow positions, coflow after
    coflow in active order), ``starts`` (each coflow's first position in ``idx``) and their sizes."""

    __slots__ = ("offs", "size_all", "idx", "starts", "size", "lens")

    def __init__(self, offs: np.ndarray, size_all: np.ndarray) -> None:
        self.offs = offs
        self.size_all = size_all
        self.idx = np.zeros(0, dtype=np.int64)
        self.starts = np.zeros(0, dtype=np.int64)
        self.size = np.zeros(0)
        self.lens: list[int] = []

    def rebuild(self, ks: Sequence[int]) -> None:
        """Index the flows of coflows ``ks`` (positions into the flat arrays), in that order."""
        lo = self.offs[ks]
        n = self.offs[np.asarray(ks, dtype=np.int64) + 1] - lo
        self.lens = n.tolist()
        self.starts = np.zeros(len(ks), dtype=np.int64)
        np.cumsum(n[:-1], out=self.starts[1:])
        total = int(n.sum())
        # idx = lo[k] + (0 .. n[k]-1) for every coflow k, without a Python loop over flows.
        self.idx = np.arange(total, dtype=np.int64) + np.repeat(lo - self.starts, n)
        self.size = self.size_all[self.idx]

    def gather_rates(self, alloc: Any, active: Sequence[Coflow], name: str) -> np.ndarray:
        """The allocation's rates as one vector aligned with ``idx`` (missing coflows send nothing)."""
        got = alloc.rates
        parts = []
        for c, n in zip(active, self.lens):
            r = got.get(c.id)
            if r is None:
                r = np.zeros(n)
            elif getattr(r, "shape", None) != (n,):
                raise SimulationError(f"policy {name!r} returned invalid rates for coflow {c.id!r}")
            parts.append(r)
        rates = np.concatenate(parts).astype(np.float64, copy=False)
        if not np.isfinite(rates).all() or (rates < 0).any():
            bad = np.flatnonzero(~np.isfinite(rates) | (rates < 0))[0]
            k = int(np.searchsorted(self.starts, bad, side="right")) - 1
            raise SimulationError(f"policy {name!r} returned invalid rates for coflow {active[k].id!r}")
        return rates


class _ActiveFlows:
    """Index of the active coflows' flows in the flat arrays: ``idx`` (flow positions, coflow after
    coflow in active order), ``starts`` (each coflow's first position in ``idx``) and their sizes."""

    __slots__ = ("offs", "size_all", "idx", "starts", "size", "lens")

    def __init__(self, offs: np.ndarray, size_all: np.ndarray) -> None:
        self.offs = offs
        self.size_all = size_all
        self.idx = np.zeros(0, dtype=np.int64)
        self.starts = np.zeros(0, dtype=np.int64)
        self.size = np.zeros(0)
        self.lens: list[int] = []

    def rebuild(self, ks: Sequence[int]) -> None:
        """Index the flows of coflows ``ks`` (positions into the flat arrays), in that order."""
        lo = self.offs[ks]
        n = self.offs[np.asarray(ks, dtype=np.int64) + 1] - lo
        self.lens = n.tolist()
        self.starts = np.zeros(len(ks), dtype=np.int64)
        np.cumsum(n[:-1], out=self.starts[1:])
        total = int(n.sum())
        # idx = lo[k] + (0 .. n[k]-1) for every coflow k, without a Python loop over flows.
        self.idx = np.arange(total, dtype=np.int64) + np.repeat(lo - self.starts, n)
        self.size = self.size_all[self.idx]

    def gather_rates(self, alloc: Any, active: Sequence[Coflow], name: str) -> np.ndarray:
        """The allocation's rates as one vector aligned with ``idx`` (missing coflows send nothing)."""
        got = alloc.rates
        parts = []
        for c, n in zip(active, self.lens):
            r = got.get(c.id)
            if r is None:
                r = np.zeros(n)
            elif getattr(r, "shape", None) != (n,):
                raise SimulationError(f"policy {name!r} returned invalid rates for coflow {c.id!r}")
            parts.append(r)
        rates = np.concatenate(parts).astype(np.float64, copy=False)
        if not np.isfinite(rates).all() or (rates < 0).any():
            bad = np.flatnonzero(~np.isfinite(rates) | (rates < 0))[0]
            k = int(np.searchsorted(self.starts, bad, side="right")) - 1
            raise SimulationError(f"policy {name!r} returned invalid rates for coflow {active[k].id!r}")
        return rates
