"""``fair``: per-flow max-min fair sharing of every port (TCP-like; the baseline policy)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..model import Allocation, Coflow, PortCapacities
from ..rate_allocation import SATURATION_TOL, ResidualCapacity, fill_matrix, flat_ports, max_min_fair
from ..scheduler import Scheduler
from ._common import build_allocation

__all__ = ["FairScheduler", "fair_share"]

_KEY_CACHE: list = [None]   # [(src, dst, n_out, key)] for the last flat port arrays seen


def _pair_keys(src: np.ndarray, dst: np.ndarray, n_out: int) -> np.ndarray:
    """``src * n_out + dst``, cached for the last (cached) flat port arrays of :func:`flat_ports`."""
    hit = _KEY_CACHE[0]
    if hit is not None and hit[0] is src and hit[1] is dst and hit[2] == n_out:
        return hit[3]
    key = src * n_out + dst
    _KEY_CACHE[0] = (src, dst, n_out, key)
    return key


def fair_share(coflows: Sequence[Coflow], capacities: PortCapacities) -> list[np.ndarray]:
    """Per-flow max-min fair rates of all unfinished flows of ``coflows`` over full port capacities.

    Flows between the same two ports get the same rate, so the fill runs on the port x port matrix
    of live flow counts (:func:`fill_matrix`) and each flow reads its pair's rate: the work per call
    is a few passes over the flows plus the fill over the ports, the same rates as
    :func:`max_min_fair` over the flows. Finished flows (remaining 0) get exactly 0."""
    if not coflows:
        return []
    src, dst, bounds = flat_ports(coflows)
    live = np.concatenate([c.remaining for c in coflows]) > 0
    n_in, n_out = capacities.num_ingress, capacities.num_egress
    n = src.shape[0]
    if n <= 64 or n_in * n_out > 4 * n + 65536:
        r = max_min_fair(src, dst, ResidualCapacity(capacities), mask=live, take=False)
        return list(np.split(r, bounds))
    key = _pair_keys(src, dst, n_out)
    cnt = np.bincount(key[live], minlength=n_in * n_out).reshape(n_in, n_out)
    ui = cnt.any(axis=1).nonzero()[0]
    uo = cnt.any(axis=0).nonzero()[0]
    if ui.size == 0:
        return list(np.split(np.zeros(n), bounds))
    W = cnt[np.ix_(ui, uo)].astype(np.float64)
    if (W == 1.0).all():
        # Every pair of a complete port set once: max_min_fair's closed-form merge (rare here).
        r = max_min_fair(src, dst, ResidualCapacity(capacities), mask=live, take=False)
        return list(np.split(r, bounds))
    cap_i, cap_o = capacities.ingress, capacities.egress
    lev, _, _ = fill_matrix(W, cap_i[ui].astype(np.float64), cap_o[uo].astype(np.float64),
                            cap_i[ui] * SATURATION_TOL, cap_o[uo] * SATURATION_TOL)
    full = np.zeros(n_in * n_out)
    full[(ui[:, None] * n_out + uo[None, :]).reshape(-1)] = lev.reshape(-1)
    r = full[key]
    r[~live] = 0.0
    return list(np.split(r, bounds))


class FairScheduler(Scheduler):
    """Every unfinished flow gets its max-min fair share of the ingress and egress ports it crosses,
    ignoring which coflow it belongs to. The order reported is arrival order (informational only)."""

    def allocate(self, coflows: Sequence[Coflow], now: float, capacities: PortCapacities) -> Allocation:
        order = sorted(range(len(coflows)), key=lambda i: (coflows[i].arrival, i))
        return build_allocation(coflows, order, fair_share(coflows, capacities), zeroed=True)
