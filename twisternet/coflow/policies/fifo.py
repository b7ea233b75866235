"""``fifo``: coflows served strictly in arrival order, each at MADD rates, with work-conserving backfill.

The coflow-level FIFO baseline of Varys and of its simulator: in arrival order, each coflow gets MADD
rates (every flow ``remaining / Γ'``, Γ' its bottleneck time on the capacity its elders left), so a
coflow takes only what lets it finish at its bottleneck; then the leftover is handed out
work-conservingly in the same order (max-min among each coflow's own flows). A large early coflow
still blocks later ones at its bottleneck ports (head-of-line blocking, what Varys improves on), but
not at ports where it would only finish flows early without finishing sooner.

``madd=False`` gives the older greedy variant: the oldest coflow takes the max-min share of every port
it crosses before the next one gets anything. That over-serves non-bottleneck flows of wide coflows
and, on the published FB2010 trace, makes FIFO's average CCT about 4x coflowsim's FIFO (see
docs/coflow-simulator.md, "FIFO").
"""

from __future__ import annotations

from typing import Sequence

from ..model import Allocation, Coflow, PortCapacities
from ..rate_allocation import CoflowLoads, ResidualCapacity, greedy_fill
from ..scheduler import Scheduler
from ._common import build_allocation, madd_in_order, zero_rates

__all__ = ["FifoScheduler"]


class FifoScheduler(Scheduler):
    """First-in first-out at the coflow level (ties in arrival time keep the given order): MADD in
    arrival order, then work-conserving backfill in arrival order. ``madd=False``: greedy max-min per
    coflow in arrival order instead of MADD (the pre-FB2010 behaviour)."""

    def __init__(self, madd: bool = True) -> None:
        super().__init__()
        self.madd = bool(madd)

    def allocate(self, coflows: Sequence[Coflow], now: float, capacities: PortCapacities) -> Allocation:
        order = sorted(range(len(coflows)), key=lambda i: (coflows[i].arrival, i))
        rates = zero_rates(coflows)
        loads = CoflowLoads(coflows, capacities.num_ingress, capacities.num_egress)
        res = ResidualCapacity(capacities)
        if self.madd:
            madd_in_order(coflows, order, loads, res, rates)
        greedy_fill(coflows, order, res, rates, loads)
        return build_allocation(coflows, order, rates)
