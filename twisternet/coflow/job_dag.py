"""Job DAGs of compute stages and transfers, and their latest arrival times (LAT), as in JIT.

A job is a DAG whose nodes are compute stages (each with an estimated compute time) and whose edges are
transfers (coflows) from a producing stage to a consuming stage. Timing model:

* a stage starts when every transfer into it has arrived (a stage without inputs starts at ``start``)
  and finishes ``compute`` seconds later;
* a transfer starts when its producing stage finishes and takes ``d_e`` seconds: its isolated minimum
  completion time (Varys' Γ over full port capacities), or a duration given directly.

Forward pass: EST(v) = max(start, max over in-edges (u, v) of EFT(u) + d_e), EFT(v) = EST(v) + compute(v);
the job's critical-path finish time is F = max EFT. Backward pass: LFT(v) = F for sinks, LST(v) =
LFT(v) - compute(v); the *latest arrival time* of a transfer e = (u, v) is LAT(e) = LST(v) (the latest
moment its data may arrive without delaying the job), and LFT(u) = min over out-edges e of LAT(e) - d_e.
Delaying any single transfer's arrival up to its LAT leaves F unchanged; its slack is LAT - EFT(u) - d_e.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Hashable

from .errors import CoflowError
from .model import Coflow, PortCapacities
from .rate_allocation import effective_bottleneck

__all__ = ["JobDag", "DagTiming"]


@dataclass(frozen=True)
class DagTiming:
    """Result of :meth:`JobDag.timing`: per-stage earliest/latest times and per-transfer LAT."""

    finish: float
    earliest_start: dict[str, float]
    earliest_finish: dict[str, float]
    latest_start: dict[str, float]
    latest_finish: dict[str, float]
    transfer_duration: dict[Hashable, float]
    earliest_arrival: dict[Hashable, float]
    latest_arrival: dict[Hashable, float]

    def slack(self, coflow_id: Hashable) -> float:
        """How long the transfer's arrival may slip past its earliest arrival without delaying the job."""
        return self.latest_arrival[coflow_id] - self.earliest_arrival[coflow_id]


class JobDag:
    """A job: compute stages (name -> estimated compute seconds) linked by transfers (coflows)."""

    def __init__(self) -> None:
        self.stages: dict[str, float] = {}
        self.transfers: dict[Hashable, tuple[str, str, Coflow | float]] = {}

    def add_stage(self, name: str, compute: float) -> JobDag:
        """Add a stage with an estimated compute time in seconds (>= 0)."""
        if name in self.stages:
            raise CoflowError(f"stage {name!r} already exists")
        if not (compute >= 0):
            raise CoflowError(f"stage {name!r}: compute time must be >= 0, got {compute!r}")
        self.stages[name] = float(compute)
        return self

    def add_transfer(self, coflow: Coflow | tuple[Hashable, float], src_stage: str,
                     dst_stage: str) -> JobDag:
        """Add a transfer from ``src_stage`` to ``dst_stage``: a :class:`Coflow` (duration = its isolated
        Γ; its ``dag_node`` is set to ``dst_stage``) or ``(coflow_id, duration_seconds)``."""
        for s in (src_stage, dst_stage):
            if s not in self.stages:
                raise CoflowError(f"transfer into/out of unknown stage {s!r}")
        if isinstance(coflow, Coflow):
            cid: Hashable = coflow.id
            what: Coflow | float = coflow
            if coflow.dag_node is None:
                coflow.dag_node = dst_stage  # the stage that consumes this coflow
            elif coflow.dag_node != dst_stage:
                raise CoflowError(f"transfer {cid!r}: coflow.dag_node is {coflow.dag_node!r} but the "
                                  f"transfer feeds stage {dst_stage!r}")
        else:
            cid, dur = coflow
            if not (dur >= 0):
                raise CoflowError(f"transfer {cid!r}: duration must be >= 0, got {dur!r}")
            what = float(dur)
        if cid in self.transfers:
            raise CoflowError(f"transfer {cid!r} already exists")
        self.transfers[cid] = (src_stage, dst_stage, what)
        return self

    def _topo_order(self) -> list[str]:
        indeg = {s: 0 for s in self.stages}
        out: dict[str, list[str]] = {s: [] for s in self.stages}
        for u, v, _ in self.transfers.values():
            indeg[v] += 1
            out[u].append(v)
        ready = [s for s in self.stages if indeg[s] == 0]
        order: list[str] = []
        while ready:
            s = ready.pop()
            order.append(s)
            for v in out[s]:
                indeg[v] -= 1
                if indeg[v] == 0:
                    ready.append(v)
        if len(order) != len(self.stages):
            cyc = sorted(s for s, d in indeg.items() if d > 0)
            raise CoflowError(f"job DAG has a cycle through stages {cyc}")
        return order

    def timing(self, start: float = 0.0, capacities: PortCapacities | None = None) -> DagTiming:
        """Critical-path times and every transfer's LAT for a job started at ``start`` (absolute seconds).
        ``capacities`` is needed when transfers are given as coflows (their duration is Γ over it)."""
        dur: dict[Hashable, float] = {}
        for cid, (_, _, what) in self.transfers.items():
            if isinstance(what, Coflow):
                if capacities is None:
                    raise CoflowError("JobDag.timing needs capacities to size coflow transfers")
                dur[cid] = effective_bottleneck(what.reset(), capacities.ingress, capacities.egress)
            else:
                dur[cid] = what
        order = self._topo_order()
        ins: dict[str, list[Hashable]] = {s: [] for s in self.stages}
        outs: dict[str, list[Hashable]] = {s: [] for s in self.stages}
        for cid, (u, v, _) in self.transfers.items():
            outs[u].append(cid)
            ins[v].append(cid)
        est: dict[str, float] = {}
        eft: dict[str, float] = {}
        arr: dict[Hashable, float] = {}
        for s in order:
            t = start
            for cid in ins[s]:
                t = max(t, arr[cid])
            est[s] = t
            eft[s] = t + self.stages[s]
            for cid in outs[s]:
                arr[cid] = eft[s] + dur[cid]
        finish = max(eft.values()) if eft else start
        lft: dict[str, float] = {}
        lst: dict[str, float] = {}
        lat: dict[Hashable, float] = {}
        for s in reversed(order):
            f = finish
            for cid in outs[s]:
                f = min(f, lat[cid] - dur[cid])
            lft[s] = f
            lst[s] = f - self.stages[s]
            for cid in ins[s]:
                lat[cid] = lst[s]
        return DagTiming(finish, est, eft, lst, lft, dur, arr, lat)
