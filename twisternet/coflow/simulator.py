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

import heapq
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

from .errors import CoflowError, SimulationError
from .model import Coflow, PortCapacities
from .policies._common import shared_zeros_base
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


# The event loop, kept flat for speed (complexity accepted).
def simulate(coflows: Iterable[Coflow], policy: Scheduler | str, capacities: PortCapacities, *,  # noqa: C901
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
    for c in work:
        c.version = 0   # lets the policies cache what they derive from ``remaining`` (model.py)
    view = _MovingFlows(offs, size_all)
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
        while ready and ready[0][0] <= t:
            _, _, k = heapq.heappop(ready)
            c = work[k]
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
            if not ready:
                break
            t = max(t, ready[0][0])
            continue
        events += 1
        if max_events is not None and events > max_events:
            raise SimulationError(f"policy {name!r}: more than {max_events} events")
        alloc = sched.allocate(active, t, capacities)
        # Only the coflows given some rate move; every other flow keeps its bytes and cannot finish
        # (all flows are unfinished at release, and only moving flows finish), so the vector work
        # below is over the moving coflows' flows alone.
        moving, rates = view.gather_rates(alloc, active, name, pos)
        if moving:
            rem = rem_all[view.idx]
            dt_flow, dt_coflow = _next_completions(rem, rates, view.starts)
        else:
            dt_flow = dt_coflow = math.inf
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
        if not moving:
            continue
        if dt > 0:
            rem -= rates * dt
        # Finished: within a relative 1e-12 of the size, or within 1 ns at the flow's rate.
        thr = rates * _TIME_RES
        np.maximum(thr, view.size_tol, out=thr)
        done = rem <= thr
        rem[done] = 0.0
        rem_all[view.idx] = rem
        for j in moving:
            c = active[j]
            c.version += 1  # type: ignore[operator]
        alive = np.maximum.reduceat(rem, view.starts) > 0.0     # remaining bytes are never negative
        if not alive.all():
            gone = {moving[q] for q in np.flatnonzero(~alive).tolist()}
            still: list[Coflow] = []
            for j, c in enumerate(active):
                if j not in gone:
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


def _next_completions(rem: np.ndarray, rates: np.ndarray, starts: np.ndarray) -> tuple[float, float]:
    """Time to the first flow completion (over live flows with rate) and to the first coflow
    completion (a coflow completes when its last live flow does; a live flow without rate never
    does) of the moving flows: ``rem`` >= 0 remaining bytes, ``rates`` >= 0 (validated), ``starts``
    each coflow's first flow; every moving coflow has a live flow.

    One division over all flows: live flows give ``rem / rate`` (inf without rate), finished ones
    0 (with rate) or NaN (without), which ``fmax`` skips, so the per-coflow maximum is the exact
    maximum over live flows. The flow minimum skips NaN too; a finished flow with rate would give
    0 there, so a minimum of 0 is recomputed over the live flows with rate alone."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ft = rem / rates
    dt_coflow = float(np.fmax.reduceat(ft, starts).min())
    dt_flow = float(np.fmin.reduce(ft))
    if not dt_flow > 0.0:
        m = rates > 0
        m &= rem > 0
        dt_flow = float(ft[m].min()) if m.any() else math.inf
    return dt_flow, dt_coflow


class _MovingFlows:
    """Index of the moving coflows' flows (those the policy gave some rate) in the flat arrays:
    ``idx`` (flow positions, coflow after coflow in active order), ``starts`` (each coflow's first
    position in ``idx``), and ``size_tol`` (the flows' sizes times 1e-12, the "finished" threshold).
    Rebuilt only when the set of moving coflows changes (between releases and completions it rarely
    does), so an event costs one gather of the rate vectors."""

    __slots__ = ("offs", "size_all", "idx", "starts", "size_tol", "key")

    def __init__(self, offs: np.ndarray, size_all: np.ndarray) -> None:
        self.offs = offs
        self.size_all = size_all
        self.idx = np.zeros(0, dtype=np.int64)
        self.starts = np.zeros(0, dtype=np.int64)
        self.size_tol = np.zeros(0)
        self.key: list[int] = []

    def gather_rates(self, alloc: Any, active: Sequence[Coflow], name: str,
                     pos: dict[Hashable, int]) -> tuple[list[int], np.ndarray]:
        """Positions in ``active`` of the coflows with some positive rate, and their rates as one
        vector aligned with ``idx`` (rebuilt if the moving set changed); missing coflows send nothing."""
        got = alloc.rates
        cand: list[int] = []
        parts = []
        zeros = shared_zeros_base()
        for j, c in enumerate(active):
            r = got.get(c.id)
            if r is None or r.base is zeros:
                continue
            if getattr(r, "shape", None) != c.size.shape:    # flows: at least one, 1-d
                raise SimulationError(f"policy {name!r} returned invalid rates for coflow {c.id!r}")
            cand.append(j)
            parts.append(r)
        if not cand:
            return cand, np.zeros(0)
        rates = np.asarray(np.concatenate(parts) if len(parts) > 1 else parts[0], dtype=np.float64)
        lens = [p.shape[0] for p in parts]
        bounds = np.zeros(len(parts), dtype=np.int64)
        np.cumsum(lens[:-1], out=bounds[1:])
        lo_r, hi_r = float(rates.min()), float(rates.max())
        if not (lo_r >= 0 and hi_r < math.inf):     # NaN fails the first test
            bad = np.flatnonzero(~np.isfinite(rates) | (rates < 0))[0]
            k = int(np.searchsorted(bounds, bad, side="right")) - 1
            raise SimulationError(f"policy {name!r} returned invalid rates for coflow "
                                  f"{active[cand[k]].id!r}")
        # A coflow moves if any of its rates is positive: one pass over all candidates.
        nz = np.maximum.reduceat(rates, bounds) > 0.0
        if nz.all():
            moving = cand
        else:
            moving = [j for j, keep in zip(cand, nz.tolist()) if keep]
            if not moving:
                return moving, np.zeros(0)
            rates = rates[np.repeat(nz, lens)]
        ks = [pos[active[j].id] for j in moving]
        if ks != self.key:
            self.key = ks
            kk = np.asarray(ks, dtype=np.int64)
            lo = self.offs[kk]
            n = self.offs[kk + 1] - lo
            self.starts = np.zeros(len(ks), dtype=np.int64)
            np.cumsum(n[:-1], out=self.starts[1:])
            # idx = lo[k] + (0 .. n[k]-1) for every moving coflow k, without a Python loop over flows.
            self.idx = np.arange(rates.shape[0], dtype=np.int64) + np.repeat(lo - self.starts, n)
            self.size_tol = self.size_all[self.idx] * 1e-12
        return moving, rates


def simulate_many(coflows: Sequence[Coflow], policies: Sequence[str], capacities: PortCapacities,
                  **opts: Any) -> list[SimulationResult]:
    """Run several registered policies on the same coflows."""
    return [simulate(coflows, p, capacities, **opts) for p in policies]
