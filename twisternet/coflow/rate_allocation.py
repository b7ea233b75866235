"""Vectorised rate-allocation primitives shared by the policies: port loads, Varys' effective bottleneck
Γ, MADD rates, per-flow max-min fairness and priority-ordered (greedy, work-conserving) filling.

All rates are bytes/s, all sizes bytes. A port whose residual capacity is at most ``SATURATION_TOL``
times its capacity counts as saturated (floating point never reaches exact zero).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .model import Coflow, PortCapacities

__all__ = ["SATURATION_TOL", "port_loads", "effective_bottleneck", "madd_rates", "max_min_fair",
           "greedy_fill", "ResidualCapacity", "CoflowLoads"]

SATURATION_TOL = 1e-9


def port_loads(src: np.ndarray, dst: np.ndarray, amount: np.ndarray, n_in: int,
               n_out: int) -> tuple[np.ndarray, np.ndarray]:
    """Sum ``amount`` (bytes or rates) per ingress port and per egress port."""
    return (np.bincount(src, weights=amount, minlength=n_in),
            np.bincount(dst, weights=amount, minlength=n_out))


def effective_bottleneck(coflow: Coflow, cap_in: np.ndarray, cap_out: np.ndarray) -> float:
    """Varys' Γ: max over the coflow's ingress and egress ports of remaining bytes at the port / the rate
    available there. ``inf`` if a port with bytes to move has no capacity left; 0 if nothing remains."""
    rem = coflow.remaining
    live = rem > 0
    if not live.any():
        return 0.0
    s, d, r = coflow.src[live], coflow.dst[live], rem[live]
    # Per-port sums only over ports this coflow touches (cheap for narrow coflows on wide fabrics).
    us, inv_s = np.unique(s, return_inverse=True)
    ud, inv_d = np.unique(d, return_inverse=True)
    load_s = np.bincount(inv_s, weights=r)
    load_d = np.bincount(inv_d, weights=r)
    cs = cap_in[us]
    cd = cap_out[ud]
    with np.errstate(divide="ignore", invalid="ignore"):
        ts = np.where(cs > 0, load_s / np.where(cs > 0, cs, 1.0), np.inf)
        td = np.where(cd > 0, load_d / np.where(cd > 0, cd, 1.0), np.inf)
    return float(max(ts.max(), td.max()))


def madd_rates(coflow: Coflow, cap_in: np.ndarray, cap_out: np.ndarray,
               gamma: float | None = None) -> np.ndarray:
    """MADD (Minimum Allocation for Desired Duration): each flow gets ``remaining / Γ`` so that all of the
    coflow's flows finish together at Γ, using no more than the coflow's bottleneck needs elsewhere.
    Returns zeros when Γ is infinite (a needed port has no capacity left)."""
    if gamma is None:
        gamma = effective_bottleneck(coflow, cap_in, cap_out)
    if not np.isfinite(gamma) or gamma <= 0:
        return np.zeros(len(coflow))
    return coflow.remaining / gamma


class ResidualCapacity:
    """Mutable per-port capacity left over while a policy hands out rates."""

    __slots__ = ("cap_in", "cap_out", "res_in", "res_out", "tol_in", "tol_out")

    def __init__(self, caps: PortCapacities) -> None:
        self.cap_in = caps.ingress
        self.cap_out = caps.egress
        self.res_in = caps.ingress.astype(np.float64).copy()
        self.res_out = caps.egress.astype(np.float64).copy()
        self.tol_in = caps.ingress * SATURATION_TOL
        self.tol_out = caps.egress * SATURATION_TOL

    def take(self, src: np.ndarray, dst: np.ndarray, rates: np.ndarray) -> None:
        """Subtract ``rates`` of flows (src -> dst) from the residual; clamps tiny negatives to zero."""
        self.res_in -= np.bincount(src, weights=rates, minlength=self.res_in.shape[0])
        self.res_out -= np.bincount(dst, weights=rates, minlength=self.res_out.shape[0])
        np.maximum(self.res_in, 0.0, out=self.res_in)
        np.maximum(self.res_out, 0.0, out=self.res_out)

    def take_loads(self, load_in: np.ndarray, load_out: np.ndarray, scale: float) -> None:
        """Subtract per-port loads times ``scale`` (MADD: bytes per port / Γ)."""
        self.res_in -= load_in * scale
        self.res_out -= load_out * scale
        np.maximum(self.res_in, 0.0, out=self.res_in)
        np.maximum(self.res_out, 0.0, out=self.res_out)

    def exhausted(self) -> bool:
        """True when every ingress or every egress port is saturated (nothing more can be sent)."""
        return not (self.res_in > self.tol_in).any() or not (self.res_out > self.tol_out).any()

    def usable(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Mask of flows whose ingress and egress port both have capacity left."""
        return (self.res_in[src] > self.tol_in[src]) & (self.res_out[dst] > self.tol_out[dst])


class CoflowLoads:
    """Remaining bytes of each of K coflows per ingress and per egress port, as dense K x P matrices.

    Built with one ``bincount`` over all flows, so Γ of every coflow (and MADD's per-port
    reservations) costs a few vector operations instead of per-flow work.
    """

    __slots__ = ("load_in", "load_out")

    def __init__(self, coflows: Sequence[Coflow], n_in: int, n_out: int) -> None:
        K = len(coflows)
        if K == 0:
            self.load_in = np.zeros((0, n_in))
            self.load_out = np.zeros((0, n_out))
            return
        cidx = np.repeat(np.arange(K), [len(c) for c in coflows])
        src = np.concatenate([c.src for c in coflows])
        dst = np.concatenate([c.dst for c in coflows])
        rem = np.concatenate([c.remaining for c in coflows])
        self.load_in = np.bincount(cidx * n_in + src, weights=rem, minlength=K * n_in).reshape(K, n_in)
        self.load_out = np.bincount(cidx * n_out + dst, weights=rem, minlength=K * n_out).reshape(K, n_out)

    @staticmethod
    def _times(load: np.ndarray, cap: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            t = np.where(cap > 0, load / np.where(cap > 0, cap, 1.0), np.inf)
        return np.where(load > 0, t, 0.0)

    def gammas(self, cap_in: np.ndarray, cap_out: np.ndarray) -> np.ndarray:
        """Γ of every coflow against the given per-port capacities."""
        if self.load_in.shape[0] == 0:
            return np.zeros(0)
        return np.maximum(self._times(self.load_in, cap_in).max(axis=1),
                          self._times(self.load_out, cap_out).max(axis=1))

    def gamma(self, k: int, cap_in: np.ndarray, cap_out: np.ndarray) -> float:
        """Γ of coflow ``k`` against the given per-port capacities."""
        return float(max(self._times(self.load_in[k], cap_in).max(),
                         self._times(self.load_out[k], cap_out).max()))

    def may_use(self, k: int, res: "ResidualCapacity") -> bool:
        """Cheap necessary condition for coflow ``k`` to use residual capacity."""
        return bool(((self.load_in[k] > 0) & (res.res_in > res.tol_in)).any()
                    and ((self.load_out[k] > 0) & (res.res_out > res.tol_out)).any())


def max_min_fair(src: np.ndarray, dst: np.ndarray, res: ResidualCapacity,
                 mask: np.ndarray | None = None, take: bool = True,
                 aggregate: bool = True) -> np.ndarray:
    """Per-flow max-min fair rates over the residual capacity in ``res`` (progressive filling).

    Flows with the same (ingress, egress) pair get equal rates, so they are aggregated first; each round
    raises all unfrozen flows equally until some port saturates, then freezes the flows on every port
    saturated (within a relative 1e-9). At most one round per port. ``mask`` restricts which flows may
    receive capacity. If ``take``, the rates are subtracted from ``res``. ``aggregate=False`` skips
    the pair aggregation (faster when pairs are known to be mostly distinct, e.g. within one coflow;
    the result is the same). The result is work-conserving: every flow with a positive-capacity path
    ends on at least one saturated port.
    """
    n = src.shape[0]
    out = np.zeros(n)
    if n == 0:
        return out
    idx = None if mask is None else np.flatnonzero(mask)
    if idx is not None and idx.size == 0:
        return out
    n_in, n_out = res.res_in.shape[0], res.res_out.shape[0]
    s_all = src if idx is None else src[idx]
    d_all = dst if idx is None else dst[idx]
    key = s_all * n_out + d_all
    if not aggregate:
        s, d = s_all, d_all
        w = np.ones(s.shape[0])
        inv = np.arange(s.shape[0])
    elif key.shape[0] > 64 and n_in * n_out <= 4 * key.shape[0] + 65536:
        cnt_full = np.bincount(key, minlength=n_in * n_out)
        uk = np.flatnonzero(cnt_full)
        w = cnt_full[uk].astype(np.float64)
        pos = np.zeros(n_in * n_out, dtype=np.int64)
        pos[uk] = np.arange(uk.shape[0])
        inv = pos[key]
    else:
        uk, inv, cnt = np.unique(key, return_inverse=True, return_counts=True)
        w = cnt.astype(np.float64)
    if aggregate:
        s = uk // n_out
        d = uk % n_out
    rin, rout = res.res_in.copy(), res.res_out.copy()
    tin, tout = res.tol_in, res.tol_out
    r = np.zeros(s.shape[0])
    live_idx = np.flatnonzero((rin[s] > tin[s]) & (rout[d] > tout[d]))
    ls, ld, lw = s[live_idx], d[live_idx], w[live_idx]
    while live_idx.size:
        li = np.bincount(ls, weights=lw, minlength=n_in)
        lo = np.bincount(ld, weights=lw, minlength=n_out)
        with np.errstate(divide="ignore", invalid="ignore"):
            sh_in = np.where(li > 0, rin / np.where(li > 0, li, 1.0), np.inf)
            sh_out = np.where(lo > 0, rout / np.where(lo > 0, lo, 1.0), np.inf)
        inc = min(sh_in.min(), sh_out.min())
        r[live_idx] += inc
        rin -= inc * li
        rout -= inc * lo
        # Every port whose fair share was (within 1e-9) the minimum is now saturated.
        lim = inc * (1.0 + 1e-9)
        rin[sh_in <= lim] = 0.0
        rout[sh_out <= lim] = 0.0
        np.maximum(rin, 0.0, out=rin)
        np.maximum(rout, 0.0, out=rout)
        keep = (rin[ls] > tin[ls]) & (rout[ld] > tout[ld])
        live_idx, ls, ld, lw = live_idx[keep], ls[keep], ld[keep], lw[keep]
    if idx is None:
        out = r[inv]
    else:
        out[idx] = r[inv]
    if take:
        res.res_in[:] = rin
        res.res_out[:] = rout
    return out


def greedy_fill(coflows: Sequence[Coflow], order: Sequence[int], res: ResidualCapacity,
                rates: list[np.ndarray], loads: CoflowLoads | None = None) -> None:
    """Hand residual capacity out coflow by coflow in ``order`` (indices into ``coflows``): each coflow
    takes the max-min fair share of what is left among its own unfinished flows, added to ``rates[i]``.

    This is the work-conserving pass of every policy: when it ends, no unfinished flow has spare capacity
    at both of its ports. ``loads`` (optional) lets it skip coflows that cannot use what is left.
    """
    for i in order:
        if res.exhausted():
            return
        if loads is not None and not loads.may_use(i, res):
            continue
        c = coflows[i]
        live = c.remaining > 0
        if not live.any():
            continue
        mask = live & res.usable(c.src, c.dst)
        if not mask.any():
            continue
        extra = max_min_fair(c.src, c.dst, res, mask=mask, take=True, aggregate=False)
        rates[i] = rates[i] + extra
