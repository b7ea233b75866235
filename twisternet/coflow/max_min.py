"""Max-min fairness over the ports of a non-blocking switch: the residual capacity a policy hands out,
progressive filling (water-filling) of flows, and its dense port x port form.

All rates are bytes/s. A port whose residual capacity is at most ``SATURATION_TOL`` times its capacity
counts as saturated (floating point never reaches exact zero). Split from ``rate_allocation`` (which
re-exports these names), so each module holds one concept.
"""

from __future__ import annotations

import numpy as np

from .model import PortCapacities

__all__ = ["SATURATION_TOL", "ResidualCapacity", "max_min_fair", "fill_matrix"]

SATURATION_TOL = 1e-9

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

    def take_sums(self, sum_in: np.ndarray, sum_out: np.ndarray) -> None:
        """:meth:`take` given the rates' per-port sums (``bincount`` of the rates by port)."""
        self.res_in -= sum_in
        self.res_out -= sum_out
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

    Cost: O(flows + rounds x ports). Every unfrozen flow holds the same rate (the water level), so a
    round only updates per-port counters; a saturated port's flows are frozen once, through a
    port -> flows index built by one counting sort, and leave the counters of their other port.
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
    if not aggregate:
        s, d = s_all, d_all
        w = None
        inv = None
    else:
        key = s_all * n_out + d_all
        if key.shape[0] > 64 and n_in * n_out <= 4 * key.shape[0] + 65536:
            cnt_full = np.bincount(key, minlength=n_in * n_out)
            uk = np.flatnonzero(cnt_full)
            w = cnt_full[uk].astype(np.float64)
            pos = np.zeros(n_in * n_out, dtype=np.int64)
            pos[uk] = np.arange(uk.shape[0])
            inv = pos[key]
        else:
            uk, inv, cnt = np.unique(key, return_inverse=True, return_counts=True)
            w = cnt.astype(np.float64)
        s = uk // n_out
        d = uk % n_out
    rates = _bipartite_fill(s, d, w, res, take)
    if rates is None:
        rates = _water_fill(s, d, w, res, take)
    r_flow = rates if inv is None else rates[inv]
    if idx is None:
        out = r_flow
    else:
        out[idx] = r_flow
    return out


def _bipartite_fill(s: np.ndarray, d: np.ndarray, w: np.ndarray | None, res: ResidualCapacity,
                    take: bool) -> np.ndarray | None:
    """Max-min fair rates when the usable flows form a complete bipartite graph (every usable ingress
    to every usable egress exactly once, as a shuffle's mappers x reducers do); None otherwise.

    Then every unfrozen ingress port has the same number of unfrozen flows (one per unfrozen egress
    port) and the same frozen load (the sum of the levels at which egress ports froze), and vice
    versa, so ingress ports saturate in ascending capacity order, egress ports likewise, and the
    water level at which the next one saturates is a scalar formula: a merge of two sorted lists,
    O(ingress + egress) scalar steps instead of a vector pass per round. The result equals
    progressive filling up to rounding (ports tied within 1e-9 saturate one after the other at
    the same level instead of in one round).
    """
    if w is not None and (w != 1.0).any():
        return None
    n_in, n_out = res.res_in.shape[0], res.res_out.shape[0]
    use = (res.res_in[s] > res.tol_in[s]) & (res.res_out[d] > res.tol_out[d])
    us_ = s[use]
    ud_ = d[use]
    k = us_.shape[0]
    if k == 0:
        return None
    cnt_s = np.bincount(us_, minlength=n_in)
    cnt_d = np.bincount(ud_, minlength=n_out)
    ms = np.flatnonzero(cnt_s)
    md = np.flatnonzero(cnt_d)
    a, b = ms.shape[0], md.shape[0]
    # Complete and simple: a x b flows, every ingress port with b flows, every egress port with a.
    if k != a * b or (cnt_s[ms] != b).any() or (cnt_d[md] != a).any():
        return None
    if a * b > 1 and n_in * n_out <= 4 * k + 65536:
        if np.bincount(us_ * n_out + ud_, minlength=n_in * n_out).max() > 1:
            return None
    elif a * b > 1 and np.unique(us_ * n_out + ud_).shape[0] != k:
        return None
    cs = res.res_in[ms]
    cd = res.res_out[md]
    os_ = np.argsort(cs, kind="stable")
    od = np.argsort(cd, kind="stable")
    i, j, lev_s, lev_d = _merge_levels(cs[os_].tolist(), cd[od].tolist())
    # Ports never saturated keep an infinite level (their flows froze at the other end).
    Ls = np.full(n_in, np.inf)
    Ld = np.full(n_out, np.inf)
    Ls[ms[os_[:i]]] = lev_s[:i]
    Ld[md[od[:j]]] = lev_d[:j]
    rate = np.zeros(s.shape[0])
    rate[use] = np.minimum(Ls[us_], Ld[ud_])
    if take:
        res.res_in -= np.bincount(us_, weights=rate[use], minlength=n_in)
        res.res_out -= np.bincount(ud_, weights=rate[use], minlength=n_out)
        res.res_in[ms[os_[:i]]] = 0.0
        res.res_out[md[od[:j]]] = 0.0
        np.maximum(res.res_in, 0.0, out=res.res_in)
        np.maximum(res.res_out, 0.0, out=res.res_out)
    return rate


def _merge_levels(cs_l: list[float], cd_l: list[float]) -> tuple[int, int, list[float], list[float]]:
    """The saturation merge of :func:`_bipartite_fill`: ingress capacities ``cs_l`` and egress
    capacities ``cd_l`` ascending; returns how many ingress / egress ports saturate and their
    freeze levels in that order."""
    a, b = len(cs_l), len(cd_l)
    lev_s = [0.0] * a     # freeze level of the i-th smallest ingress port
    lev_d = [0.0] * b
    i = j = 0
    froz_s = froz_d = 0.0   # sum of freeze levels of frozen ingress / egress ports
    level = 0.0
    while i < a and j < b:
        na, nb = a - i, b - j
        ls_ = (cs_l[i] - froz_d) / nb
        ld_ = (cd_l[j] - froz_s) / na
        if ls_ <= ld_:
            level = max(level, ls_)
            lev_s[i] = level
            froz_s += level
            i += 1
        else:
            level = max(level, ld_)
            lev_d[j] = level
            froz_d += level
            j += 1
    return i, j, lev_s, lev_d


def fill_matrix(W: np.ndarray, cap_i: np.ndarray, cap_o: np.ndarray, t_i: np.ndarray,
                t_o: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Progressive filling on a dense matrix: ``W[i, j]`` flows (counts, as floats) from ingress row
    ``i`` (capacity ``cap_i[i]``, saturation tolerance ``t_i[i]``) to egress column ``j``; every
    row and column must have a flow. Returns the max-min fair rate of each cell's flows and which
    rows and columns saturated. ``W`` is used up (overwritten).

    Every unfrozen flow holds the same rate (the water level), so a round raises the level to the
    next port's saturation (the least residual / unfrozen flows), freezes the flows of every port
    within a relative 1e-9 of it (or left with at most its tolerance) at that level, and zeroes
    their rows and columns: a few operations on per-port vectors, at most one round per port.
    """
    a, b = W.shape
    # Rows and columns as one vector of a + b ports (rows first): one division, one min and one
    # saturation test per round. The element-wise arithmetic is the same as with separate row and
    # column vectors, and the counts are integer-valued, so every sum of them is exact.
    cap = np.concatenate((cap_i, cap_o))
    tol = np.concatenate((t_i, t_o))
    cnt = np.concatenate((W.sum(axis=1), W.sum(axis=0)))
    cnt_i = cnt[:a]
    cnt_o = cnt[a:]
    inf = np.inf
    # A cell's flows freeze at the level of the first of its row and column to saturate (the
    # level only rises), so the rates are min(row level, column level) with inf for never.
    lev_p = np.full(a + b, inf)
    level = 0.0
    amin = np.minimum.reduce
    add = np.add.reduce
    sh = np.empty(a + b)
    tmp = np.empty(a + b)
    m1 = np.empty(a + b, dtype=bool)
    m2 = np.empty(a + b, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        while True:
            np.divide(cap, cnt, out=sh)
            inc = float(amin(sh))
            if not inc < inf:
                break
            level += inc
            np.multiply(cnt, inc, out=tmp)
            cap -= tmp
            np.less_equal(sh, inc * (1.0 + 1e-9), out=m1)
            np.less_equal(cap, tol, out=m2)
            m1 |= m2
            sat = m1.nonzero()[0]
            n_sat = sat.shape[0]
            cut = int(sat.searchsorted(a))
            # Ingress ports first, then egress ports, so a flow with both ends saturated freezes once.
            # (A single row or column is a view: no gather, and its "sum" is itself.)
            if cut == 1:
                r = int(sat[0])
                cnt_o -= W[r]
                W[r] = 0.0
            elif cut:
                si = sat[:cut]
                cnt_o -= add(W[si], axis=0)
                W[si] = 0.0
            if n_sat - cut == 1:
                q = int(sat[cut]) - a
                cnt_i -= W[:, q]
                W[:, q] = 0.0
            elif n_sat > cut:
                so = sat[cut:] - a
                cnt_i -= add(W[:, so], axis=1)
                W[:, so] = 0.0
            lev_p[sat] = level
            cap[sat] = inf
            cnt[sat] = 0.0
    lev_i = lev_p[:a]
    lev_o = lev_p[a:]
    lev = np.minimum(lev_i[:, None], lev_o[None, :])
    sat_i = lev_i < inf
    sat_o = lev_o < inf
    return lev, sat_i, sat_o


def _water_fill(s: np.ndarray, d: np.ndarray, w: np.ndarray | None, res: ResidualCapacity,
                take: bool) -> np.ndarray:
    """Progressive filling of flow groups (ingress ``s``, egress ``d``, ``w`` flows each; None = 1).

    Works on the dense matrix of flow counts between the ingress and egress ports the usable flows
    touch (:func:`fill_matrix`; at most ports x ports entries, whatever the number of flows). The
    arithmetic is the per-port sequence of the
    flow-list formulation it replaced (integer-valued counts are exact), so the rates are the same
    to the bit.
    """
    n_in, n_out = res.res_in.shape[0], res.res_out.shape[0]
    m = s.shape[0]
    rate = np.zeros(m)
    res_in, res_out, tol_in, tol_out = res.res_in, res.res_out, res.tol_in, res.tol_out
    live = ((res_in[s] > tol_in[s]) & (res_out[d] > tol_out[d])).nonzero()[0]
    if live.size == 0:
        return rate
    ls, ld = s[live], d[live]
    lw = None if w is None else w[live]
    hi = np.bincount(ls, minlength=n_in)
    ho = np.bincount(ld, minlength=n_out)
    ui = hi.nonzero()[0]
    uo = ho.nonzero()[0]
    a, b = ui.shape[0], uo.shape[0]
    if a * b > 8 * live.shape[0] + 65536:
        return _water_fill_flows(s, d, w, res, take)
    # Compress to the ports the usable flows touch: ui[r] is row r's ingress port, uo[c] column c's.
    row = np.zeros(n_in, dtype=np.int64)
    col = np.zeros(n_out, dtype=np.int64)
    row[ui] = np.arange(a)
    col[uo] = np.arange(b)
    cell = row[ls] * b + col[ld]
    W = np.bincount(cell, weights=lw, minlength=a * b).reshape(a, b)
    lev, sat_i, sat_o = fill_matrix(W, res_in[ui], res_out[uo], tol_in[ui], tol_out[uo])
    lrate = lev.reshape(-1)[cell]
    rate[live] = lrate
    if take:
        used = lrate if lw is None else lrate * lw
        left_i = res_in - np.bincount(ls, weights=used, minlength=n_in)
        left_o = res_out - np.bincount(ld, weights=used, minlength=n_out)
        left_i[ui[sat_i]] = 0.0
        left_o[uo[sat_o]] = 0.0
        np.maximum(left_i, 0.0, out=left_i)
        np.maximum(left_o, 0.0, out=left_o)
        res_in[:] = left_i
        res_out[:] = left_o
    return rate


def _water_fill_flows(s: np.ndarray, d: np.ndarray, w: np.ndarray | None, res: ResidualCapacity,
                      take: bool) -> np.ndarray:
    """:func:`_water_fill` over the flow list, for fabrics where the dense port x port matrix would be
    much larger than the flows (the same rates)."""
    n_in, n_out = res.res_in.shape[0], res.res_out.shape[0]
    N = n_in + n_out
    m = s.shape[0]
    rate = np.zeros(m)
    cap = np.concatenate([res.res_in, res.res_out])
    tol = np.concatenate([res.tol_in, res.tol_out])
    b = d + n_in
    live = np.flatnonzero((cap[s] > tol[s]) & (cap[b] > tol[b]))
    if live.size == 0:
        return rate
    ls, lb = s[live], b[live]
    lw = None if w is None else w[live]
    cnt = np.bincount(ls, weights=lw, minlength=N) + np.bincount(lb, weights=lw, minlength=N)
    # port -> live flows (positions into ``live``), by a stable counting sort of the endpoints.
    k = live.shape[0]
    ends = np.concatenate([ls, lb])
    owner = np.concatenate([np.arange(k), np.arange(k)])
    if N < 32768:
        srt = np.argsort(ends.astype(np.int16), kind="stable")
    else:
        srt = np.argsort(ends, kind="stable")
    owner = owner[srt]
    starts = np.zeros(N + 1, dtype=np.int64)
    np.cumsum(np.bincount(ends, minlength=N), out=starts[1:])
    frozen = np.zeros(k, dtype=bool)
    lrate = np.zeros(k)
    level = 0.0
    cnt = cnt.astype(np.float64)
    # ``capx``: residual of the ports still limiting someone; +inf for the others, so that one
    # division gives every port's fair share (inf where it limits nobody) without masks.
    capx = cap.copy()
    capx[cnt == 0] = np.inf
    saturated = np.zeros(N, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        while True:
            share = capx / cnt
            inc = float(share.min())
            if not inc < np.inf:
                break
            level += inc
            capx -= inc * cnt
            # Every port whose fair share was (within 1e-9) the minimum is now saturated.
            sat = np.flatnonzero((share <= inc * (1.0 + 1e-9)) | (capx <= tol))
            # Ingress ports first, then egress ports: a flow appears once per port list, so freezing
            # between the two halves keeps a flow with both ends saturated from being counted twice.
            cut = int(np.searchsorted(sat, n_in))
            for part in (sat[:cut], sat[cut:]):
                if part.size == 0:
                    continue
                if part.size == 1:
                    p = int(part[0])
                    fl = owner[starts[p]:starts[p + 1]]
                else:
                    fl = np.concatenate([owner[starts[p]:starts[p + 1]] for p in part.tolist()])
                fl = fl[~frozen[fl]]
                if fl.size == 0:
                    continue
                frozen[fl] = True
                lrate[fl] = level
                fw = None if lw is None else lw[fl]
                cnt -= np.bincount(ls[fl], weights=fw, minlength=N)
                cnt -= np.bincount(lb[fl], weights=fw, minlength=N)
            saturated[sat] = True
            capx[sat] = np.inf
            cnt[sat] = 0.0
    rate[live] = lrate
    if take:
        used = lrate if lw is None else lrate * lw
        left = cap - np.bincount(ls, weights=used, minlength=N) - np.bincount(lb, weights=used, minlength=N)
        left[saturated] = 0.0
        np.maximum(left, 0.0, out=left)
        res.res_in[:] = left[:n_in]
        res.res_out[:] = left[n_in:]
    return rate
