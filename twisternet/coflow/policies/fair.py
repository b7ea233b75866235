"""``fair``: per-flow max-min fair sharing of every port (TCP-like; the baseline policy)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..model import Allocation, Coflow, PortCapacities
from ..rate_allocation import ResidualCapacity, flat_ports, max_min_fair
from ..scheduler import Scheduler
from ._common import build_allocation

__all__ = ["FairScheduler", "fair_share"]


def fair_share(coflows: Sequence[Coflow], capacities: PortCapacities) -> list[np.ndarray]:
    """Per-flow max-min fair rates of all unfinished flows of ``coflows`` over full port capacities."""
    if not coflows:
        return []
    src, dst, bounds = flat_ports(coflows)
    live = np.concatenate([c.remaining for c in coflows]) > 0
    r = max_min_fair(src, dst, ResidualCapacity(capacities), mask=live, take=False)
    return list(np.split(r, bounds))


class FairScheduler(Scheduler):
    """Every unfinished flow gets its max-min fair share of the ingress and egress ports it crosses,
    ignoring which coflow it belongs to. The order reported is arrival order (informational only)."""

    def allocate(self, coflows: Sequence[Coflow], now: float, capacities: PortCapacities) -> Allocation:
        order = sorted(range(len(coflows)), key=lambda i: (coflows[i].arrival, i))
        return build_allocation(coflows, order, fair_share(coflows, capacities))
