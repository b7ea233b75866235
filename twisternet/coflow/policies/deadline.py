"""``deadline``: Varys-style deadline admission control with MADD reservations.

Admission (``on_arrival``): with R = the rates already reserved by admitted, unfinished coflows (each
admitted coflow ``a`` reserves ``remaining_f / (D_a - now)`` on every flow, D = arrival + deadline),
the newcomer's Γ is computed against the *remaining* capacity ``capacity - R`` at its ports. It is
admitted iff ``now + Γ <= D`` (within a relative 1e-9). A rejected coflow is reported at once (the call
returns False and its id is appended to ``self.rejected``).

Allocation: admitted coflows, earliest deadline first, get exactly their MADD reservation so that all
their flows finish together at the deadline; coflows without a deadline (and rejected ones when
``serve_rejected=True``) are best-effort and get MADD over what is left in SEBF order; finally the
leftover is handed out work-conservingly in that same order (admitted first, so they may finish early,
which only shrinks later reservations). By default (``serve_rejected=False``) rejected coflows are
*dropped*, as Varys does: the caller never passes them to ``allocate`` again. An admitted coflow that is
somehow past its deadline (e.g. it was given less than reserved by an outside caller) is served as
best-effort.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from ..model import Allocation, Coflow, PortCapacities
from ..rate_allocation import CoflowLoads, ResidualCapacity, effective_bottleneck, greedy_fill
from ..scheduler import Scheduler
from ._common import (available, build_allocation, clip_to_capacity, madd_in_order, take_rates,
                      zero_rates)

__all__ = ["DeadlineScheduler"]

_REL_TOL = 1e-9


class DeadlineScheduler(Scheduler):
    """Admit a coflow only if it can meet its deadline on the capacity not reserved by earlier admitted
    coflows; serve admitted ones at MADD rates that finish them exactly at the deadline."""

    def __init__(self, serve_rejected: bool = False, backfill: bool = True) -> None:
        super().__init__()
        self.serve_rejected = bool(serve_rejected)
        self.backfill = backfill
        self.admitted: dict[Hashable, Coflow] = {}

    @staticmethod
    def reservation(c: Coflow, now: float) -> np.ndarray | None:
        """Per-flow rates that finish ``c`` exactly at its deadline; None if already past it."""
        left = c.absolute_deadline - now  # type: ignore[operator]
        if left <= 0:
            return None
        return c.remaining / left

    def reserved_residual(self, now: float, capacities: PortCapacities) -> ResidualCapacity:
        """Capacity left after the reservations of all admitted, unfinished coflows."""
        res = ResidualCapacity(capacities)
        for a in self.admitted.values():
            r = self.reservation(a, now)
            if r is not None:
                res.take(a.src, a.dst, r)
        return res

    def on_arrival(self, coflow: Coflow, now: float, capacities: PortCapacities) -> bool:
        d = coflow.absolute_deadline
        if d is None:
            return True  # best-effort: nothing to guarantee
        res = self.reserved_residual(now, capacities)
        cin, cout = available(res)
        gamma = effective_bottleneck(coflow, cin, cout)
        if now + gamma <= d + _REL_TOL * max(1.0, abs(d)):
            self.admitted[coflow.id] = coflow
            return True
        return self.reject(coflow, f"needs {gamma:.6g}s on the unreserved capacity, "
                                   f"{d - now:.6g}s left to its deadline")

    def on_completion(self, coflow: Coflow, now: float) -> None:
        self.admitted.pop(coflow.id, None)

    def allocate(self, coflows: Sequence[Coflow], now: float, capacities: PortCapacities) -> Allocation:
        rates = zero_rates(coflows)
        guaranteed: list[int] = []
        best_effort: list[int] = []
        due: dict[int, float] = {}      # absolute deadline of each guaranteed coflow
        for i, c in enumerate(coflows):
            d = c.absolute_deadline
            if c.id in self.admitted and d is not None and d > now:
                guaranteed.append(i)
                due[i] = d
            else:
                best_effort.append(i)
        guaranteed.sort(key=lambda i: (due[i], coflows[i].arrival, i))
        loads = CoflowLoads(coflows, capacities.num_ingress, capacities.num_egress)
        res = ResidualCapacity(capacities)
        if guaranteed:
            # The reservations' port loads come from the per-coflow port loads (remaining / time left),
            # so no per-flow pass is needed unless rounding pushed a port over its capacity.
            left = np.array([due[i] - now for i in guaranteed])
            lin = (loads.load_in[guaranteed] / left[:, None]).sum(axis=0)
            lout = (loads.load_out[guaranteed] / left[:, None]).sum(axis=0)
            for k, i in enumerate(guaranteed):
                rates[i] = coflows[i].remaining / left[k]
            if (lin > capacities.ingress).any() or (lout > capacities.egress).any():
                # rounding only: admission keeps sums feasible
                sums = clip_to_capacity(coflows, rates, capacities)
                take_rates(res, coflows, guaranteed, rates, sums)
            else:
                res.take_loads(lin, lout, 1.0)
        gam = loads.gammas(capacities.ingress, capacities.egress)
        best_effort.sort(key=lambda i: (gam[i], coflows[i].arrival, i))
        madd_in_order(coflows, best_effort, loads, res, rates)
        order = guaranteed + best_effort
        if self.backfill:
            greedy_fill(coflows, order, res, rates, loads)
        return build_allocation(coflows, order, rates)
