"""Seeded synthetic coflow traces with the Facebook trace's kind of mix, in the benchmark text format.

The published FB2010 trace (as characterised in the Varys paper) is dominated in *number* by short and
narrow coflows while a few long and wide ones carry almost all the bytes. The generator draws each
coflow's class with these probabilities (width = number of flows, narrow <= 50 flows; short = small
per-reducer MB):

    short-narrow 52%, long-narrow 16%, short-wide 15%, long-wide 17%

Narrow coflows get 1-7 mappers and reducers (geometric-like); wide ones draw mappers and reducers
log-uniformly from [4, num_ports] until they have more than 50 flows. Per-reducer MB is log-normal for
short coflows (median ``short_mb``) and Pareto(``pareto_alpha``)-tailed for long ones (scale
``long_mb``), so sizes are heavy-tailed. Ports are chosen uniformly without replacement (widths are
capped at ``num_ports``). Arrivals form a Poisson process conditioned on ``num_coflows`` arrivals in
``duration_s`` (sorted uniform times, in whole milliseconds as in the published trace; the first at 0).
"""

from __future__ import annotations

import math

import numpy as np

from .errors import CoflowError
from .trace import Trace, TraceCoflow

__all__ = ["generate_trace", "generate_like", "CLASS_MIX"]

#: (name, probability, wide, long)
CLASS_MIX: tuple[tuple[str, float, bool, bool], ...] = (
    ("short-narrow", 0.52, False, False),
    ("long-narrow", 0.16, False, True),
    ("short-wide", 0.15, True, False),
    ("long-wide", 0.17, True, True),
)


def _narrow_width(rng: np.random.Generator, num_ports: int) -> int:
    return int(min(num_ports, 1 + min(rng.geometric(0.45) - 1, 6)))


def _wide_width(rng: np.random.Generator, num_ports: int) -> int:
    lo = min(4, num_ports)
    return int(min(num_ports, round(math.exp(rng.uniform(math.log(lo), math.log(num_ports))))))


def generate_trace(num_ports: int = 150, num_coflows: int = 500, seed: int = 0,
                   duration_s: float = 3600.0, short_mb: float = 1.0, long_mb: float = 200.0,
                   pareto_alpha: float = 1.3, max_reducer_mb: float = 1e5) -> Trace:
    """A synthetic trace of ``num_coflows`` coflows on ``num_ports`` ports (see the module docstring)."""
    if num_ports < 1 or num_coflows < 0:
        raise CoflowError("need num_ports >= 1 and num_coflows >= 0")
    if not (duration_s > 0) or not (short_mb > 0) or not (long_mb > 0) or not (pareto_alpha > 0):
        raise CoflowError("duration_s, short_mb, long_mb and pareto_alpha must be > 0")
    rng = np.random.default_rng(seed)
    probs = np.array([p for _, p, _, _ in CLASS_MIX])
    # A Poisson process conditioned on num_coflows arrivals in the window: sorted uniform times.
    arrivals = np.sort(np.floor(rng.uniform(0.0, duration_s * 1000.0, size=num_coflows)))
    if num_coflows:
        arrivals -= arrivals[0]
    coflows: list[TraceCoflow] = []
    for k in range(num_coflows):
        _, _, wide, long_ = CLASS_MIX[int(rng.choice(len(CLASS_MIX), p=probs))]
        if wide and num_ports > 1:
            for _ in range(100):
                m, r = _wide_width(rng, num_ports), _wide_width(rng, num_ports)
                if m * r > 50 or m * r >= num_ports * num_ports:
                    break
        else:
            m, r = _narrow_width(rng, num_ports), _narrow_width(rng, num_ports)
        mappers = rng.choice(num_ports, size=m, replace=False)
        reducers = rng.choice(num_ports, size=r, replace=False)
        mb: np.ndarray
        if long_:
            mb = long_mb * (1.0 + rng.pareto(pareto_alpha, size=r))
        else:
            mb = rng.lognormal(math.log(short_mb), 1.0, size=r)
        mb = np.round(np.minimum(mb, max_reducer_mb), 3)
        mb = np.maximum(mb, 0.001)
        coflows.append(TraceCoflow(k + 1, float(arrivals[k]), tuple(int(p) for p in mappers),
                                   tuple((int(p), float(b)) for p, b in zip(reducers, mb))))
    return Trace(num_ports, coflows)


def generate_like(template: Trace, num_coflows: int, seed: int = 0,
                  duration_s: float | None = None) -> Trace:
    """A trace of ``num_coflows`` coflows with the mix of ``template`` (e.g. the published FB2010 trace).

    Each new coflow copies the shape of a template coflow drawn uniformly with replacement: its number
    of mappers and its list of per-reducer MB (so widths, sizes and skew keep the template's joint
    distribution). Mapper and reducer ports are drawn uniformly without replacement on the template's
    ports, so placements are fresh. Arrivals are a Poisson process conditioned on ``num_coflows``
    arrivals in ``duration_s``, whole milliseconds, the first at 0; by default ``duration_s`` keeps the
    template's arrival rate (its span x num_coflows / its size), so 10x the coflows is 10x the hours
    at the same load rather than 10x the load.
    """
    if num_coflows < 0:
        raise CoflowError(f"need num_coflows >= 0, got {num_coflows}")
    src = [c for c in template.coflows if c.total_mb > 0]
    if not src:
        raise CoflowError("the template trace has no coflow with bytes")
    if duration_s is None:
        span_s = (max(c.arrival_ms for c in src) - min(c.arrival_ms for c in src)) / 1000.0
        duration_s = max(span_s, 1.0) * num_coflows / len(src)
    if not (duration_s > 0) or not math.isfinite(duration_s):
        raise CoflowError(f"duration_s must be > 0, got {duration_s!r}")
    rng = np.random.default_rng(seed)
    P = template.num_ports
    arrivals = np.sort(np.floor(rng.uniform(0.0, duration_s * 1000.0, size=num_coflows)))
    if num_coflows:
        arrivals -= arrivals[0]
    picks = rng.integers(0, len(src), size=num_coflows)
    coflows: list[TraceCoflow] = []
    for k in range(num_coflows):
        tc = src[int(picks[k])]
        m = min(len(tc.mappers), P)
        r = min(len(tc.reducers), P)
        mappers = rng.choice(P, size=m, replace=False)
        reducers = rng.choice(P, size=r, replace=False)
        mbs = [mb for _, mb in tc.reducers][:r]
        coflows.append(TraceCoflow(k + 1, float(arrivals[k]), tuple(int(p) for p in mappers),
                                   tuple((int(p), float(b)) for p, b in zip(reducers, mbs))))
    return Trace(P, coflows)
