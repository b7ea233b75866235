"""Flow-level, event-driven simulator of coflow scheduling on a non-blocking switch fabric.

Only ingress and egress ports constrain (the fabric core is non-blocking). Between two events every flow
sends at the constant rate the policy allocated, so the simulator jumps straight from event to event:
the next coflow release, the next flow completion under the current rates, or the policy's own timer
(``Scheduler.next_timer``, e.g. a starvation window edge). At every event the policy is asked for a new
allocation. A coflow is released at its arrival time once all its ``parents`` have completed (or been
dropped); its CCT is measured from its arrival. Rejected coflows are dropped unless the policy sets
``serve_rejected``. The policy objects are exactly the ones the live runtime uses.

Time resolution: a flow within 1 ns (at its current rate) of finishing counts as finished, which keeps
floating-point residue from creating spurious events.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Hashable, Iterable, Sequence

import numpy as np

from .errors import CoflowError, SimulationError
from .model import Coflow, PortCapacities
from .rate_allocation import effective_bottleneck
from .scheduler import Scheduler, get_policy

__all__ = ["CoflowResult", "SimulationResult", "simulate", "simulate_many"]

log = logging.getLogger(__name__)

_TIME_RES = 1e-9


@dataclass
class CoflowResult:
    """Outcome of one coflow: times in seconds; ``cct``/``finish`` are None if it was dropped."""

    id: Hashable
    arrival: float
    release: float | None
    finish: float | None
    deadline: float | None
    admitted: bool
    bytes: float
    width: int
    isolated: float = math.nan

    @property
    def slowdown(self) -> float | None:
        """CCT / isolated minimum CCT (Γ on an idle fabric): 1.0 is the best any policy can do."""
        if self.cct is None or not self.isolated > 0:
            return None
        return self.cct / self.isolated

    @property
    def cct(self) -> float | None:
        """Coflow completion time (finish - arrival), None if dropped."""
        return None if self.finish is None else self.finish - self.arrival

    @property
    def met_deadline(self) -> bool | None:
        """None without a deadline; False if dropped or late."""
        if self.deadline is None:
            return None
        if self.finish is None:
            return False
        return self.finish - self.arrival <= self.deadline * (1 + 1e-6) + _TIME_RES


@dataclass
class SimulationResult:
    """Per-coflow results and summary figures of one simulated policy."""

    policy: str
    coflows: list[CoflowResult] = field(default_factory=list)
    events: int = 0
    wall_seconds: float = 0.0

    def ccts(self) -> np.ndarray:
        """CCTs (seconds) of the completed coflows, in input order."""
        return np.array([r.cct for r in self.coflows if r.cct is not None], dtype=np.float64)

    @property
    def completed(self) -> int:
        """Number of coflows that finished."""
        return sum(1 for r in self.coflows if r.finish is not None)

    @property
    def rejected(self) -> int:
        """Number of coflows the policy rejected (admission control)."""
        return sum(1 for r in self.coflows if not r.admitted)

    @property
    def avg_cct(self) -> float:
        """Mean CCT in seconds over completed coflows (nan if none)."""
        c = self.ccts()
        return float(c.mean()) if c.size else math.nan

    @property
    def p95_cct(self) -> float:
        """95th-percentile CCT in seconds over completed coflows (linear interpolation)."""
        c = self.ccts()
        return float(np.percentile(c, 95)) if c.size else math.nan

    @property
    def avg_slowdown(self) -> float:
        """Mean over completed coflows of CCT / isolated minimum CCT (>= 1; nan if none completed)."""
        v = [r.slowdown for r in self.coflows if r.slowdown is not None]
        return float(np.mean(v)) if v else math.nan

    @property
    def deadlines_met(self) -> float | None:
        """Fraction of coflows with a deadline that completed within it (dropped = missed)."""
        flags = [r.met_deadline for r in self.coflows if r.deadline is not None]
        return None if not flags else sum(bool(f) for f in flags) / len(flags)

    def summary(self) -> dict[str, Any]:
        """The summary figures as a JSON-friendly dict (times in ms)."""
        out: dict[str, Any] = {"policy": self.policy, "coflows": len(self.coflows),
                               "completed": self.completed, "avg_cct_ms": self.avg_cct * 1e3,
                               "p95_cct_ms": self.p95_cct * 1e3, "avg_slowdown": self.avg_slowdown,
                               "events": self.events,
                               "wall_seconds": self.wall_seconds}
        if self.deadlines_met is not None:
            out["deadlines_met"] = self.deadlines_met
            out["rejected"] = self.rejected
        return out

    def per_coflow(self) -> list[dict[str, Any]]:
        """Per-coflow rows (JSON-friendly; CCT in ms)."""
        rows = []
        for r in self.coflows:
            d = asdict(r)
            d["cct_ms"] = None if r.cct is None else r.cct * 1e3
            d["met_deadline"] = r.met_deadline
            d["slowdown"] = r.slowdown
            rows.append(d)
        return rows


def simulate(coflows: Iterable[Coflow], policy: Scheduler | str, capacities: PortCapacities, *,
             realloc_gap: float = 0.0, max_events: int | None = None,
             **policy_opts: Any) -> SimulationResult:
    """Simulate ``coflows`` (copied; inputs are not mutated) under ``policy`` (an instance or a registered
    name plus ``policy_opts``) on a fabric with ``capacities``.

    ``realloc_gap`` (seconds, default 0 = exact): a flow completing while the rest of its coflow still
    runs triggers a re-allocation no sooner than ``realloc_gap`` after the previous one (its freed
    capacity idles meanwhile). Coflow releases, coflow completions and policy timers always re-allocate
    at once, so CCTs stay exact given the rates; only the hand-out of capacity freed by single flows is
    delayed by at most the gap. ``max_events`` bounds the run (an error if exceeded) so a misbehaving
    custom policy cannot loop forever."""
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
    children: dict[Hashable, list[Coflow]] = {}
    blocked: dict[Hashable, int] = {}
    for c in work:
        blocked[c.id] = len(set(c.parents))
        for p in set(c.parents):
            children.setdefault(p, []).append(c)
    # Coflows become "ready" (released) at max(arrival, last parent done).
    pending = sorted((c for c in work if blocked[c.id] == 0), key=lambda c: c.arrival)
    ready_at: list[tuple[float, int, Coflow]] = [(c.arrival, i, c) for i, c in enumerate(pending)]
    ready_at.reverse()  # pop() from the end = earliest
    seq = len(ready_at)
    active: list[Coflow] = []
    t = 0.0
    events = 0
    started = time.perf_counter()
    name = getattr(sched, "name", type(sched).__name__)

    def finish_parent(cid: Hashable, now: float) -> None:
        nonlocal seq
        for ch in children.get(cid, ()):
            blocked[ch.id] -= 1
            if blocked[ch.id] == 0:
                seq += 1
                ready_at.append((max(ch.arrival, now), seq, ch))
                ready_at.sort(key=lambda e: (e[0], e[1]), reverse=True)

    while True:
        # Release every coflow due by now.
        while ready_at and ready_at[-1][0] <= t + _TIME_RES:
            _, _, c = ready_at.pop()
            res = results[c.id]
            res.release = t
            if sched.on_arrival(c, t, capacities):
                active.append(c)
            else:
                res.admitted = False
                if sched.serve_rejected:
                    active.append(c)
                else:
                    finish_parent(c.id, t)
        if not active:
            if not ready_at:
                break
            t = max(t, ready_at[-1][0])
            continue
        events += 1
        if max_events is not None and events > max_events:
            raise SimulationError(f"policy {name!r}: more than {max_events} events")
        alloc = sched.allocate(active, t, capacities)
        dt_flow = math.inf      # earliest completion of any flow
        dt_coflow = math.inf    # earliest completion of a whole coflow
        rates: list[np.ndarray] = []
        for c in active:
            r = alloc.rates.get(c.id)
            if r is None:
                r = np.zeros(len(c))
            elif r.shape != c.remaining.shape or not np.isfinite(r).all() or (r < 0).any():
                raise SimulationError(f"policy {name!r} returned invalid rates for coflow {c.id!r}")
            rates.append(r)
            live = c.remaining > 0
            m = (r > 0) & live
            if m.any():
                ft = c.remaining[m] / r[m]
                dt_flow = min(dt_flow, float(ft.min()))
                if m.sum() == live.sum():
                    dt_coflow = min(dt_coflow, float(ft.max()))
        t_next = t + min(dt_coflow, max(dt_flow, realloc_gap))
        if ready_at:
            t_next = min(t_next, ready_at[-1][0])
        timer = sched.next_timer(t)
        if timer is not None and timer > t:
            t_next = min(t_next, timer)
        if not math.isfinite(t_next):
            raise SimulationError(f"policy {name!r} gives no rate to any of {len(active)} active coflows "
                                  f"at t={t:.6f}s and nothing else will happen")
        dt = max(0.0, t_next - t)
        t = t_next
        still: list[Coflow] = []
        for c, r in zip(active, rates):
            if dt > 0:
                c.remaining -= r * dt
            done = (c.remaining <= c.size * 1e-12) | (c.remaining <= r * _TIME_RES)
            c.remaining[done] = 0.0
            if c.remaining.any():
                still.append(c)
            else:
                results[c.id].finish = t
                sched.on_completion(c, t)
                finish_parent(c.id, t)
        active = still
    out = SimulationResult(name, [results[c.id] for c in work], events,
                           time.perf_counter() - started)
    log.info("simulated %d coflows under %s: %d events in %.2fs", len(work), name, events,
             out.wall_seconds)
    return out


def simulate_many(coflows: Sequence[Coflow], policies: Sequence[str], capacities: PortCapacities,
                  **opts: Any) -> list[SimulationResult]:
    """Run several registered policies on the same coflows."""
    return [simulate(coflows, p, capacities, **opts) for p in policies]
