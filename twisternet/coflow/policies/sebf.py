"""``sebf``: Varys' Smallest-Effective-Bottleneck-First ordering with MADD rates.

For each active coflow ``c``, Γ(c) = max over ingress ports i and egress ports j it uses of
(remaining bytes of c at that port) / (port capacity): the time ``c`` would need alone. Coflows are
served in ascending Γ (ties: earlier arrival first). In that order each coflow gets MADD rates over the
capacity still unallocated: Γ' is recomputed against the *residual* capacity and every flow gets
``remaining / Γ'``, so all its flows finish together and it takes no more than its bottleneck lets it
use. A coflow with a saturated port gets nothing in this pass. Then the leftover capacity is handed out
work-conservingly, again in Γ order (each coflow takes the max-min share of what is left among its own
flows), so no port idles while some flow through it could send.

Starvation avoidance (Varys §5.3 style, a *time-sliced fair share*): every ``starvation_period``
seconds, for ``starvation_duration`` seconds, the policy switches to per-flow max-min fair sharing of
all active coflows, so a large coflow behind an endless stream of small ones still progresses by at
least its fair share in a fraction ``duration / period`` of the time. Windows start at
``k * starvation_period`` for k = 1, 2, ... (absolute time); ``next_timer`` reports window edges so the
simulator re-allocates there. Set ``starvation_period=None`` to disable (pure SEBF, which can starve).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..errors import CoflowError
from ..model import Allocation, Coflow, PortCapacities
from ..rate_allocation import CoflowLoads, ResidualCapacity, greedy_fill
from ..scheduler import Scheduler
from ._common import build_allocation, madd_in_order, zero_rates
from .fair import fair_share

__all__ = ["SebfScheduler", "StarvationWindows"]


class StarvationWindows:
    """Periodic fair-share windows ``[k*period, k*period + duration)``, k >= 1."""

    def __init__(self, period: float | None, duration: float) -> None:
        if period is not None:
            if not (period > 0) or not math.isfinite(period):
                raise CoflowError(f"starvation_period must be > 0 seconds (or None), got {period!r}")
            if not (0 < duration < period):
                raise CoflowError(f"starvation_duration must be in (0, period), got {duration!r}")
        self.period = period
        self.duration = duration

    def _phase(self, now: float) -> tuple[int, float, float]:
        assert self.period is not None
        eps = 1e-9 * max(1.0, self.period)
        k = int(math.floor((now + eps) / self.period))
        return k, k * self.period, eps

    def active(self, now: float) -> bool:
        """True inside a fair-share window."""
        if self.period is None:
            return False
        k, start, eps = self._phase(now)
        return k >= 1 and now + eps < start + self.duration

    def next_edge(self, now: float) -> float | None:
        """Next window start or end strictly after ``now``."""
        if self.period is None:
            return None
        k, start, _ = self._phase(now)
        if self.active(now):
            return start + self.duration
        return (k + 1) * self.period


class SebfScheduler(Scheduler):
    """Varys SEBF + MADD with work-conserving backfill and periodic fair-share windows.

    Options: ``starvation_period`` (seconds between fair windows, default 5.0; None disables) and
    ``starvation_duration`` (window length, default 0.25 s, i.e. 5% of the time).
    """

    def __init__(self, starvation_period: float | None = 5.0, starvation_duration: float = 0.25,
                 backfill: bool = True) -> None:
        super().__init__()
        self.windows = StarvationWindows(starvation_period, starvation_duration)
        self.backfill = backfill

    def next_timer(self, now: float) -> float | None:
        return self.windows.next_edge(now)

    def sebf_order(self, coflows: Sequence[Coflow], capacities: PortCapacities,
                   loads: CoflowLoads | None = None) -> list[int]:
        """Indices of ``coflows`` by ascending Γ over full capacities (ties by arrival)."""
        if loads is None:
            loads = CoflowLoads(coflows, capacities.num_ingress, capacities.num_egress)
        g = loads.gammas(capacities.ingress, capacities.egress)
        return sorted(range(len(coflows)), key=lambda i: (g[i], coflows[i].arrival, i))

    def allocate(self, coflows: Sequence[Coflow], now: float, capacities: PortCapacities) -> Allocation:
        loads = CoflowLoads(coflows, capacities.num_ingress, capacities.num_egress)
        order = self.sebf_order(coflows, capacities, loads)
        if self.windows.active(now):
            return build_allocation(coflows, order, fair_share(coflows, capacities), zeroed=True)
        rates = zero_rates(coflows)
        res = ResidualCapacity(capacities)
        madd_in_order(coflows, order, loads, res, rates)
        if self.backfill:
            greedy_fill(coflows, order, res, rates, loads)
        return build_allocation(coflows, order, rates)
