"""``fifo``: coflows served strictly in arrival order, each at MADD rates, with work-conserving backfill.

The coflow-level FIFO baseline of Varys and of its simulator: in arrival order, each coflow gets MADD
rates (every flow ``remaining / Γ'``, Γ' its bottleneck time on the capacity its elders left), so a
coflow takes only what lets it finish at its bottleneck; then the leftover is handed out
work-conservingly in the same order (max-min among each coflow's own flows). A large early coflow
still blocks later ones at its bottleneck ports (head-of-line blocking, what Varys improves on), but
not at ports where it would only finish flows early without finishing sooner.

``share_skipped=True`` adds coflowsim's middle step: the coflows MADD skipped (a port they need was
already full) first share what is left max-min fairly among all their flows, as one pool, before the
refill in arrival order. See docs/coflow-simulator.md, "FIFO", for what it changes on the published
trace.

``madd=False`` gives the older greedy variant: the oldest coflow takes the max-min share of every port
it crosses before the next one gets anything. That over-serves non-bottleneck flows of wide coflows
and, on the published FB2010 trace, makes FIFO's average CCT about 4x coflowsim's FIFO (see
docs/coflow-simulator.md, "FIFO").
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..model import Allocation, Coflow, PortCapacities
from ..rate_allocation import CoflowLoads, ResidualCapacity, greedy_fill, max_min_fair
from ..scheduler import Scheduler
from ._common import build_allocation, madd_in_order, zero_rates

__all__ = ["FifoScheduler"]


class FifoScheduler(Scheduler):
    """First-in first-out at the coflow level (ties in arrival time keep the given order): MADD in
    arrival order, then work-conserving backfill in arrival order. ``madd=False``: greedy max-min per
    coflow in arrival order instead of MADD (the pre-FB2010 behaviour). ``share_skipped=True``: the
    coflows MADD skipped share the leftover max-min fairly, as one pool, before the refill (the
    middle step of coflowsim's FIFO)."""

    def __init__(self, madd: bool = True, share_skipped: bool = False) -> None:
        super().__init__()
        self.madd = bool(madd)
        self.share_skipped = bool(share_skipped)

    def allocate(self, coflows: Sequence[Coflow], now: float, capacities: PortCapacities) -> Allocation:
        order = sorted(range(len(coflows)), key=lambda i: (coflows[i].arrival, i))
        rates = zero_rates(coflows)
        loads = CoflowLoads(coflows, capacities.num_ingress, capacities.num_egress)
        res = ResidualCapacity(capacities)
        if self.madd:
            before = list(rates)
            madd_in_order(coflows, order, loads, res, rates)
            if self.share_skipped:
                skipped = [i for i in order if rates[i] is before[i]]
                self._share(coflows, skipped, res, rates)
        greedy_fill(coflows, order, res, rates, loads)
        return build_allocation(coflows, order, rates)

    @staticmethod
    def _share(coflows: Sequence[Coflow], skipped: list[int], res: ResidualCapacity,
               rates: list[np.ndarray]) -> None:
        """Max-min fair rates over ``res`` for all live flows of the ``skipped`` coflows together."""
        if not skipped:
            return
        src = np.concatenate([coflows[i].src for i in skipped])
        dst = np.concatenate([coflows[i].dst for i in skipped])
        live = np.concatenate([coflows[i].remaining for i in skipped]) > 0
        mask = live & res.usable(src, dst)
        if not mask.any():
            return
        r = max_min_fair(src, dst, res, mask=mask, take=True)
        bounds = np.cumsum([len(coflows[i]) for i in skipped])[:-1]
        for i, part in zip(skipped, np.split(r, bounds)):
            rates[i] = rates[i] + part
