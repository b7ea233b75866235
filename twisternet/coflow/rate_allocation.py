"""Vectorised rate-allocation primitives shared by the policies: port loads, Varys' effective bottleneck
Γ, MADD rates, per-coflow load rows and priority-ordered (greedy, work-conserving) filling. Max-min
fairness and the residual capacity live in :mod:`twisternet.coflow.max_min` (re-exported here).

All rates are bytes/s, all sizes bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from .max_min import (SATURATION_TOL, ResidualCapacity, _bipartite_fill, _merge_levels,  # noqa: F401 - re-exported
                      _water_fill, _water_fill_flows, fill_matrix, max_min_fair)
from .model import Coflow

__all__ = ["SATURATION_TOL", "port_loads", "effective_bottleneck", "madd_rates", "max_min_fair",
           "greedy_fill", "ResidualCapacity", "CoflowLoads"]


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


_FLAT_CACHE: list = [None]   # [([(coflow, src, dst)], src_all, dst_all, bounds)]


def flat_ports(coflows: Sequence[Coflow]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All flows' ingress and egress ports of ``coflows`` concatenated, and the split points between
    coflows. Cached for the last coflow list seen (the active set changes only on releases and
    completions, while policies ask at every event)."""
    hit = _FLAT_CACHE[0]
    if (hit is not None and len(hit[0]) == len(coflows)
            and all(a[0] is b and a[1] is b.src and a[2] is b.dst for a, b in zip(hit[0], coflows))):
        return hit[1], hit[2], hit[3]
    src = np.concatenate([c.src for c in coflows])
    dst = np.concatenate([c.dst for c in coflows])
    bounds = np.cumsum([len(c) for c in coflows])[:-1]
    _FLAT_CACHE[0] = ([(c, c.src, c.dst) for c in coflows], src, dst, bounds)
    return src, dst, bounds



def derived(c: Coflow) -> dict | None:
    """Per-coflow cache of what is derived from ``c.remaining``, valid while ``c.version`` stays the
    same (None when the coflow is not versioned: then nothing may be cached)."""
    v = c.version
    if v is None:
        return None
    d = c._derived
    if d is None or d[0] != v:
        d = c._derived = (v, {})
    return d[1]


def coflow_port_loads(c: Coflow, n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray,
                                                                   np.ndarray, np.ndarray]:
    """Ingress ports, their remaining bytes, egress ports and theirs, of coflow ``c`` (loads > 0
    only, ports ascending); cached per ``version`` for versioned coflows."""
    dd = derived(c)
    if dd is not None:
        hit = dd.get("loads")
        if hit is not None and hit[0] == n_in and hit[1] == n_out:
            return hit[2]
    li = np.bincount(c.src, weights=c.remaining, minlength=n_in)
    lo = np.bincount(c.dst, weights=c.remaining, minlength=n_out)
    pi = (li > 0).nonzero()[0]
    po = (lo > 0).nonzero()[0]
    out = (pi, li[pi], po, lo[po])
    if dd is not None:
        dd["loads"] = (n_in, n_out, out)
    return out


class CoflowLoads:
    """Remaining bytes of each of K coflows per ingress and per egress port, as dense K x P matrices.

    Built with one ``bincount`` over all flows, so Γ of every coflow (and MADD's per-port
    reservations) costs a few vector operations instead of per-flow work. The flat (coflow, port)
    keys depend only on which coflows are given, so they are cached for the last coflow list seen
    (a simulator or runtime asks again and again about the same active set between arrivals and
    completions); only the remaining bytes are gathered anew.
    """

    __slots__ = ("load_in", "load_out", "_touch")

    _key_cache: tuple | None = None   # ([(coflow, src, dst)], n_in, n_out, key_in, key_out)

    def __init__(self, coflows: Sequence[Coflow], n_in: int, n_out: int) -> None:
        K = len(coflows)
        self._touch: tuple | None = None
        if K == 0:
            self.load_in = np.zeros((0, n_in))
            self.load_out = np.zeros((0, n_out))
            return
        if all(c.version is not None for c in coflows):
            self._from_rows(coflows, n_in, n_out)
            return
        key_in, key_out = self._keys(coflows, n_in, n_out)
        rem = np.concatenate([c.remaining for c in coflows])
        # float64 (the weights'), which numpy's stubs do not know of a weighted bincount
        load_in = np.bincount(key_in, weights=rem, minlength=K * n_in)
        load_out = np.bincount(key_out, weights=rem, minlength=K * n_out)
        self.load_in = load_in.astype(np.float64, copy=False).reshape(K, n_in)
        self.load_out = load_out.astype(np.float64, copy=False).reshape(K, n_out)

    def _from_rows(self, coflows: Sequence[Coflow], n_in: int, n_out: int) -> None:
        """Incremental build for versioned coflows: every coflow's per-port loads come from its
        cache (recomputed only for the coflows that progressed since), so the cost is one step per
        coflow plus the ports they touch, not a pass over all their flows. The sums are the same
        as the one-bincount build (same flows, same order)."""
        K = len(coflows)
        rows = [coflow_port_loads(c, n_in, n_out) for c in coflows]
        ci = np.concatenate([r[0] for r in rows])
        li = np.concatenate([r[1] for r in rows])
        co = np.concatenate([r[2] for r in rows])
        lo = np.concatenate([r[3] for r in rows])
        bi = np.zeros(K + 1, dtype=np.int64)
        bo = np.zeros(K + 1, dtype=np.int64)
        np.cumsum([r[0].shape[0] for r in rows], out=bi[1:])
        np.cumsum([r[2].shape[0] for r in rows], out=bo[1:])
        self.load_in = np.zeros((K, n_in))
        self.load_out = np.zeros((K, n_out))
        self.load_in[np.repeat(np.arange(K), np.diff(bi)), ci] = li
        self.load_out[np.repeat(np.arange(K), np.diff(bo)), co] = lo
        self._touch = (ci, li, bi, co, lo, bo)

    @classmethod
    def _keys(cls, coflows: Sequence[Coflow], n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray]:
        hit = cls._key_cache
        if (hit is not None and hit[1] == n_in and hit[2] == n_out and len(hit[0]) == len(coflows)
                and all(a[0] is b and a[1] is b.src and a[2] is b.dst for a, b in zip(hit[0], coflows))):
            return hit[3], hit[4]
        K = len(coflows)
        src, dst, _ = flat_ports(coflows)
        cidx = np.repeat(np.arange(K), [len(c) for c in coflows])
        key_in = cidx * n_in + src
        key_out = cidx * n_out + dst
        CoflowLoads._key_cache = ([(c, c.src, c.dst) for c in coflows], n_in, n_out, key_in, key_out)
        return key_in, key_out

    def touched(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Ingress ports, their loads, egress ports and their loads of coflow ``k`` (loads > 0 only)."""
        if self._touch is None:
            ri, ci = np.nonzero(self.load_in > 0)
            ro, co = np.nonzero(self.load_out > 0)
            K = self.load_in.shape[0]
            bi = np.searchsorted(ri, np.arange(K + 1))
            bo = np.searchsorted(ro, np.arange(K + 1))
            self._touch = (ci, self.load_in[ri, ci], bi, co, self.load_out[ro, co], bo)
        ci, li, bi, co, lo, bo = self._touch
        return ci[bi[k]:bi[k + 1]], li[bi[k]:bi[k + 1]], co[bo[k]:bo[k + 1]], lo[bo[k]:bo[k + 1]]

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

    def may_use(self, k: int, res: ResidualCapacity) -> bool:
        """Cheap necessary condition for coflow ``k`` to use residual capacity."""
        pi, _, po, _ = self.touched(k)
        return bool((res.res_in[pi] > res.tol_in[pi]).any() and (res.res_out[po] > res.tol_out[po]).any())


def greedy_fill(coflows: Sequence[Coflow], order: Sequence[int], res: ResidualCapacity,
                rates: list[np.ndarray], loads: CoflowLoads | None = None) -> None:
    """Hand residual capacity out coflow by coflow in ``order`` (indices into ``coflows``): each coflow
    takes the max-min fair share of what is left among its own unfinished flows, added to ``rates[i]``.

    This is the work-conserving pass of every policy: when it ends, no unfinished flow has spare capacity
    at both of its ports. ``loads`` (optional) lets it skip coflows that cannot use what is left.
    """
    # Which ports still have capacity: recomputed only after a coflow took some (the residual
    # changes nowhere else), so skipping a coflow costs two small look-ups.
    ok_in = res.res_in > res.tol_in
    ok_out = res.res_out > res.tol_out
    if loads is not None and len(order):
        # Residual capacity only shrinks during the pass, so a coflow that cannot use it now never
        # will: test all coflows at once and visit only the candidates.
        cand = (((loads.load_in > 0) & ok_in).any(axis=1)
                & ((loads.load_out > 0) & ok_out).any(axis=1))
        order = [i for i in order if cand[i]]
    count = np.count_nonzero   # cheaper than ndarray.any on a few ports
    done = not count(ok_in) or not count(ok_out)
    for i in order:
        if done:
            return
        if loads is not None:
            pi, _, po, _ = loads.touched(i)
            if not (count(ok_in[pi]) and count(ok_out[po])):
                continue
        c = coflows[i]
        shape = _live_shape(c)
        if shape is not None:  # noqa: SIM102 - False ("no live shape") must still skip the generic path below
            if shape is not False:
                extra = _bipartite_ports_fill(c, shape[0], shape[1], res)
                if extra is not None:
                    rates[i] = rates[i] + extra
                    ok_in = res.res_in > res.tol_in
                    ok_out = res.res_out > res.tol_out
                    done = not count(ok_in) or not count(ok_out)
                continue
        live = c.remaining > 0
        if not count(live):
            continue
        mask = live & ok_in[c.src] & ok_out[c.dst]
        if not count(mask):
            continue
        extra = max_min_fair(c.src, c.dst, res, mask=mask, take=True, aggregate=False)
        rates[i] = rates[i] + extra
        ok_in = res.res_in > res.tol_in
        ok_out = res.res_out > res.tol_out
        done = not count(ok_in) or not count(ok_out)


def _live_shape(c: Coflow) -> tuple[np.ndarray, np.ndarray] | Literal[False] | None:
    """For a versioned coflow: (ingress ports, egress ports) if its live flows are exactly every
    pair of them, each once, and no finished flow joins two of them; False if it has no live flow;
    None otherwise or for an unversioned coflow (then the general path runs). Cached per version."""
    dd = derived(c)
    if dd is None:
        return None
    if "shape" in dd:
        return dd["shape"]
    # Remaining bytes are never negative, so the live flows are the non-zero ones.
    k = int(np.count_nonzero(c.remaining))
    # Flows of a versioned coflow never restart, so the same number of live flows means the same
    # live set: the shape survives progress that finishes no flow.
    hit = c._live_cache
    if hit is not None and hit[0] == k:
        dd["shape"] = hit[1]
        return hit[1]
    live = c.remaining > 0
    out: tuple[np.ndarray, np.ndarray] | Literal[False] | None
    if k == 0:
        out = False
    else:
        ls, ld = c.src[live], c.dst[live]
        S = np.bincount(ls).nonzero()[0]     # ascending, as np.unique, without a sort
        D = np.bincount(ld).nonzero()[0]
        a, b = S.shape[0], D.shape[0]
        out = None
        n_out = int(c.dst.max()) + 1
        # k == a * b live flows on a x b ports are every pair once only if no pair repeats: a coflow may
        # hold two flows between one pair of ports (then some other pair is missing).
        if k == a * b and (k == 1 or int(np.bincount(ls * n_out + ld).max()) == 1):
            n_in = int(c.src.max()) + 1
            in_s = np.zeros(n_in, dtype=bool)
            in_d = np.zeros(n_out, dtype=bool)
            in_s[S] = True
            in_d[D] = True
            # All flows (live or not) joining S and D: exactly the a x b live ones means the live
            # pairs are distinct (hence every pair) and no finished flow sits among them.
            if int(np.count_nonzero(in_s[c.src] & in_d[c.dst])) == k:
                out = (S, D)
    dd["shape"] = out
    c._live_cache = (k, out)
    return out


def _bipartite_ports_fill(c: Coflow, S: np.ndarray, D: np.ndarray,
                          res: ResidualCapacity) -> np.ndarray | None:
    """:func:`_bipartite_fill` (with ``take``) for a coflow whose live flows are exactly S x D: the
    usable flows are (usable ports of S) x (usable ports of D), so the fill is found from the ports
    alone; only the per-flow rates and the capacity they take are flow-sized passes. Gives the same
    numbers as ``max_min_fair(..., mask=live & usable)``; None when no flow can send."""
    ms = S[res.res_in[S] > res.tol_in[S]]
    md = D[res.res_out[D] > res.tol_out[D]]
    a, b = ms.shape[0], md.shape[0]
    if a == 0 or b == 0:
        return None
    n_in, n_out = res.res_in.shape[0], res.res_out.shape[0]
    cs = res.res_in[ms]
    cd = res.res_out[md]
    os_ = np.argsort(cs, kind="stable")
    od = np.argsort(cd, kind="stable")
    i, j, lev_s, lev_d = _merge_levels(cs[os_].tolist(), cd[od].tolist())
    Ls = np.zeros(n_in)
    Ld = np.zeros(n_out)
    Ls[ms] = np.inf
    Ld[md] = np.inf
    Ls[ms[os_[:i]]] = lev_s[:i]
    Ld[md[od[:j]]] = lev_d[:j]
    rate = np.minimum(Ls[c.src], Ld[c.dst])
    res.res_in -= np.bincount(c.src, weights=rate, minlength=n_in)
    res.res_out -= np.bincount(c.dst, weights=rate, minlength=n_out)
    res.res_in[ms[os_[:i]]] = 0.0
    res.res_out[md[od[:j]]] = 0.0
    np.maximum(res.res_in, 0.0, out=res.res_in)
    np.maximum(res.res_out, 0.0, out=res.res_out)
    return rate
