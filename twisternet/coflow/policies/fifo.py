"""``fifo``: coflows served strictly in arrival order, each greedy at full port rate."""

from __future__ import annotations

from typing import Sequence

from ..model import Allocation, Coflow, PortCapacities
from ..rate_allocation import CoflowLoads, ResidualCapacity, greedy_fill
from ..scheduler import Scheduler
from ._common import build_allocation, zero_rates

__all__ = ["FifoScheduler"]


class FifoScheduler(Scheduler):
    """First-in first-out at the coflow level: the oldest coflow takes all it can use (max-min among its
    own flows), the next one takes what is left, and so on. Ties in arrival time keep the given order.
    Work-conserving, but a large early coflow blocks every later one that shares a port (head-of-line
    blocking, the baseline Varys improves on)."""

    def allocate(self, coflows: Sequence[Coflow], now: float, capacities: PortCapacities) -> Allocation:
        order = sorted(range(len(coflows)), key=lambda i: (coflows[i].arrival, i))
        rates = zero_rates(coflows)
        loads = CoflowLoads(coflows, capacities.num_ingress, capacities.num_egress)
        greedy_fill(coflows, order, ResidualCapacity(capacities), rates, loads)
        return build_allocation(coflows, order, rates)
