"""Helpers shared by the built-in policies (not public API)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..model import Allocation, Coflow, PortCapacities
from ..rate_allocation import CoflowLoads, ResidualCapacity


_ZEROS: list[np.ndarray] = [np.zeros(0)]


def shared_zeros(n: int) -> np.ndarray:
    """A read-only zero vector of length ``n``, a view of one shared buffer (no allocation per call);
    ``is_shared_zeros`` recognises it."""
    z = _ZEROS[0]
    if z.shape[0] < n:
        z = np.zeros(max(n, 2 * z.shape[0]))
        z.flags.writeable = False
        _ZEROS[0] = z
    return z[:n]


def is_shared_zeros(r: np.ndarray) -> bool:
    """True if ``r`` came from :func:`shared_zeros` (all zero, read-only)."""
    return r.base is _ZEROS[0]


def shared_zeros_base() -> np.ndarray:
    """The buffer that :func:`shared_zeros` hands out views of now: ``r.base is`` it is
    :func:`is_shared_zeros` without a call per vector."""
    return _ZEROS[0]


def zero_rates(coflows: Sequence[Coflow]) -> list[np.ndarray]:
    """One zero vector per coflow: for versioned coflows (the simulator's) read-only shared zeros
    that the policies replace, never write; fresh arrays otherwise."""
    return [np.zeros(len(c)) if c.version is None else shared_zeros(len(c)) for c in coflows]


def build_allocation(coflows: Sequence[Coflow], order: Sequence[int],
                     rates: list[np.ndarray], zeroed: bool = False) -> Allocation:
    """Package per-coflow rate vectors and a positional order; finished flows get rate 0.
    ``zeroed=True``: the rates are already exactly 0 on every finished flow (e.g.
    :func:`~twisternet.coflow.policies.fair.fair_share`'s), so they are used as they are."""
    if zeroed:
        return Allocation(rates={c.id: r for c, r in zip(coflows, rates)},
                          order=[coflows[i].id for i in order])
    out = {}
    for c, r in zip(coflows, rates):
        if not is_shared_zeros(r):
            r = np.where(c.remaining > 0, r, 0.0)
        out[c.id] = r
    return Allocation(rates=out, order=[coflows[i].id for i in order])


def clip_to_capacity(coflows: Sequence[Coflow], rates: list[np.ndarray],
                     caps: PortCapacities) -> dict[int, tuple[np.ndarray, np.ndarray]] | None:
    """Scale rates down (in place) at any port an LP or rounding pushed past its capacity. Shared
    zero vectors are skipped: they add exact zeros to the sums and stay zero when scaled.

    Returns None if it scaled anything; otherwise each summed coflow's per-port rate sums (ingress,
    egress), exactly what :meth:`ResidualCapacity.take` of its rates would subtract."""
    n_in, n_out = caps.num_ingress, caps.num_egress
    lin = np.zeros(n_in)
    lout = np.zeros(n_out)
    sums: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for i, (c, r) in enumerate(zip(coflows, rates)):
        if is_shared_zeros(r):
            continue
        si = np.bincount(c.src, weights=r, minlength=n_in)
        so = np.bincount(c.dst, weights=r, minlength=n_out)
        lin += si
        lout += so
        sums[i] = (si, so)
    with np.errstate(divide="ignore", invalid="ignore"):
        fin = np.where(lin > caps.ingress, caps.ingress / np.where(lin > 0, lin, 1.0), 1.0)
        fout = np.where(lout > caps.egress, caps.egress / np.where(lout > 0, lout, 1.0), 1.0)
    if (fin < 1).any() or (fout < 1).any():
        for i, c in enumerate(coflows):
            if not is_shared_zeros(rates[i]):
                rates[i] = rates[i] * np.minimum(fin[c.src], fout[c.dst])
        return None
    return sums


def take_rates(res: ResidualCapacity, coflows: Sequence[Coflow], which: Sequence[int],
               rates: list[np.ndarray], sums: dict[int, tuple[np.ndarray, np.ndarray]] | None) -> None:
    """``res.take`` of the rates of coflows ``which`` in that order, from the per-port sums of
    :func:`clip_to_capacity` where it kept them (the same subtractions, no second ``bincount``)."""
    for i in which:
        hit = None if sums is None else sums.get(i)
        if hit is None:
            res.take(coflows[i].src, coflows[i].dst, rates[i])
        else:
            res.take_sums(hit[0], hit[1])


def available(res: ResidualCapacity) -> tuple[np.ndarray, np.ndarray]:
    """Residual capacity with saturated (below tolerance) ports reported as exactly zero."""
    return (np.where(res.res_in > res.tol_in, res.res_in, 0.0),
            np.where(res.res_out > res.tol_out, res.res_out, 0.0))


def madd_in_order(coflows: Sequence[Coflow], order: Sequence[int], loads: CoflowLoads,
                  res: ResidualCapacity, rates: list[np.ndarray]) -> None:
    """Give each coflow in ``order`` MADD rates (remaining / Γ') over the capacity still in ``res``,
    where Γ' is its bottleneck time on that residual; coflows with a saturated needed port get none."""
    # Only the ports a coflow touches matter to its Γ' and reservation, so each step works on those
    # few entries instead of whole port vectors.
    res_in, res_out, tol_in, tol_out = res.res_in, res.res_out, res.tol_in, res.tol_out
    for i in order:
        pi, li, po, lo = loads.touched(i)
        if pi.size == 0 or po.size == 0:
            continue  # nothing left to send
        ri = res_in[pi]
        ro = res_out[po]
        if np.count_nonzero(ri <= tol_in[pi]) or np.count_nonzero(ro <= tol_out[po]):
            continue  # a needed port is saturated: Γ' is infinite
        g = max(float((li / ri).max()), float((lo / ro).max()))
        if not (g > 0) or not np.isfinite(g):
            continue
        rates[i] = coflows[i].remaining / g
        scale = 1.0 / g
        res_in[pi] = np.maximum(ri - li * scale, 0.0)
        res_out[po] = np.maximum(ro - lo * scale, 0.0)
