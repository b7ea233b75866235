r"""``dag``: JIT-style DAG-aware scheduling by latest arrival time (LAT) with an LP over port capacities.

Each active coflow c has a LAT L_c: from :meth:`DagScheduler.add_job` (a :class:`JobDag`, see
``job_dag.py``) or :meth:`set_lat`; otherwise ``arrival + deadline`` if it has a deadline; otherwise
``arrival + default_slack * Γ_isolated(c)`` (as soon as it could finish alone, times a slack).

Rates are MADD-shaped per coflow: flow f of c gets r_f = x_c * rem_f, where x_c (1/s) is the coflow's
progress rate (it would finish in 1/x_c at that rate). To finish by its LAT a coflow needs
x_c >= n_c := 1 / (L_c - now). With load_{c,p} = remaining bytes of c at port p, the ILP "meet as many
LATs as possible" (binary y_c) is relaxed to the LP solved with HiGHS
(``scipy.optimize.linprog(method="highs")``), over the coflows with L_c > now::

    maximize    sum_c  w_c * y_c
    subject to  sum_c  n_c * load_{c,p} * y_c  <=  cap_p      for every ingress and egress port p
                0 <= y_c <= 1

with w_c = weight_c * (1 + eps * (K - rank_c) / K), rank_c = position of c in ascending-LAT order,
K = number of such coflows, eps = ``tie_epsilon`` (default 0.01): the number of LATs met dominates, and
among equally good solutions earlier LATs win. Coflow c then gets x_c = y_c * n_c (y_c = 1: it meets
its LAT exactly; fractional: it gets that fraction of its need). Coflows already past their LAT are not
in the LP. Finally the capacity the LP left free is handed out work-conservingly (per-flow max-min
among each coflow's own flows) in priority order: overdue coflows first (earliest LAT first), then the
rest by ascending LAT - so freed bandwidth goes to the transfers with the earliest LATs.

The LP is re-solved whenever the set of coflows in it changes (a release, a completion, a LAT passing);
between such events the solved y_c are kept (x_c = y_c * n_c at the current time, clipped to the port
capacities) and only the work-conserving pass is recomputed, which keeps simulations fast. If HiGHS fails
the policy logs a warning and falls back to y = 0 (pure LAT-ordered greedy filling).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from ..errors import CoflowError
from ..job_dag import JobDag
from ..model import Allocation, Coflow, PortCapacities
from ..rate_allocation import CoflowLoads, ResidualCapacity, effective_bottleneck, greedy_fill
from ..scheduler import Scheduler
from ._common import build_allocation, clip_to_capacity, take_rates, zero_rates

__all__ = ["DagScheduler", "solve_lat_lp"]

log = logging.getLogger(__name__)


def solve_lat_lp(need: np.ndarray, load_in: np.ndarray, load_out: np.ndarray, caps: PortCapacities,
                 weights: np.ndarray) -> np.ndarray:
    """Solve the LAT LP of the module docstring with HiGHS; returns y (one value in [0, 1] per coflow).

    ``load_in`` / ``load_out`` are K x P matrices of each coflow's remaining bytes per ingress / egress
    port; ``need[k]`` = 1 / (LAT_k - now); ``weights`` the objective coefficients w_k.
    """
    from scipy.optimize import linprog

    K = need.shape[0]
    if K == 0:
        return np.zeros(0)
    # One row per port that any coflow uses, scaled so every right-hand side is 1.
    A = np.vstack([(load_in * need[:, None]).T / caps.ingress[:, None],
                   (load_out * need[:, None]).T / caps.egress[:, None]])
    A = A[(A > 0).any(axis=1)]
    res = linprog(-weights, A_ub=A, b_ub=np.ones(A.shape[0]), bounds=(0.0, 1.0), method="highs")
    if res.status != 0 or res.x is None:
        log.warning("dag policy: HiGHS did not solve the LAT LP (%s); serving by LAT order only",
                    res.message)
        return np.zeros(K)
    return np.clip(res.x, 0.0, 1.0)


class DagScheduler(Scheduler):
    """Meet as many latest arrival times as the port capacities allow (LP relaxation via HiGHS), then give
    the remaining bandwidth to the coflows with the earliest LATs.

    Options: ``lats`` (coflow id -> absolute LAT seconds), ``jobs`` (iterable of ``(JobDag, start)``;
    their LATs are computed at first use with the fabric's capacities), ``default_slack`` (LAT of a coflow
    without DAG or deadline = arrival + slack * isolated Γ; default 1.0), ``tie_epsilon`` (default 0.01).
    """

    def __init__(self, lats: Mapping[Hashable, float] | None = None,
                 jobs: Sequence[tuple[JobDag, float]] = (), default_slack: float = 1.0,
                 tie_epsilon: float = 0.01) -> None:
        super().__init__()
        if not (default_slack > 0):
            raise CoflowError(f"default_slack must be > 0, got {default_slack!r}")
        if not (0 <= tie_epsilon < 1):
            raise CoflowError(f"tie_epsilon must be in [0, 1), got {tie_epsilon!r}")
        self.default_slack = float(default_slack)
        self.tie_epsilon = float(tie_epsilon)
        self._lat: dict[Hashable, float] = dict(lats or {})
        self._pending_jobs = list(jobs)
        self._fallback: dict[Hashable, float] = {}
        self._lp_key: frozenset | None = None
        self._lp_y: dict[Hashable, float] = {}

    def set_lat(self, coflow_id: Hashable, lat: float) -> None:
        """Fix the absolute latest arrival time of a coflow."""
        self._lat[coflow_id] = float(lat)

    def add_job(self, dag: JobDag, start: float, capacities: PortCapacities) -> dict[Hashable, float]:
        """Compute the LATs of a job's transfers (job started at ``start``) and use them; returns them."""
        lats = dag.timing(start, capacities).latest_arrival
        self._lat.update(lats)
        return dict(lats)

    def lat(self, c: Coflow, capacities: PortCapacities) -> float:
        """The LAT used for coflow ``c`` (see the class docstring for the fallbacks)."""
        if c.id in self._lat:
            return self._lat[c.id]
        if c.absolute_deadline is not None:
            return c.absolute_deadline
        v = self._fallback.get(c.id)
        if v is None:
            g = effective_bottleneck(c.reset(), capacities.ingress, capacities.egress)
            v = self._fallback[c.id] = c.arrival + self.default_slack * g
        return v

    def on_completion(self, coflow: Coflow, now: float) -> None:
        self._fallback.pop(coflow.id, None)

    def allocate(self, coflows: Sequence[Coflow], now: float, capacities: PortCapacities) -> Allocation:
        while self._pending_jobs:
            dag, start = self._pending_jobs.pop()
            self.add_job(dag, start, capacities)
        lats = [self.lat(c, capacities) for c in coflows]
        by_lat = sorted(range(len(coflows)), key=lambda i: (lats[i], coflows[i].arrival, i))
        overdue = [i for i in by_lat if lats[i] <= now]
        timely = [i for i in by_lat if lats[i] > now and np.count_nonzero(coflows[i].remaining)]
        rates = zero_rates(coflows)
        loads = CoflowLoads(coflows, capacities.num_ingress, capacities.num_egress)
        sums = None
        if timely:
            K = len(timely)
            need = np.array([1.0 / (lats[i] - now) for i in timely])
            key = frozenset(coflows[i].id for i in timely)
            if key == self._lp_key:
                y = np.array([self._lp_y.get(coflows[i].id, 0.0) for i in timely])
            else:
                w = np.array([coflows[i].weight * (1.0 + self.tie_epsilon * (K - k) / K)
                              for k, i in enumerate(timely)])
                y = solve_lat_lp(need, loads.load_in[timely], loads.load_out[timely], capacities, w)
                self._lp_key = key
                self._lp_y = {coflows[i].id: float(y[k]) for k, i in enumerate(timely)}
            x = y * need
            for k, i in enumerate(timely):
                rates[i] = coflows[i].remaining * x[k]
            # The per-port sums from the per-coflow loads equal the per-flow ones up to rounding
            # (~1e-13 relative), so a port clearly below capacity here needs no per-flow check.
            lin = (loads.load_in[timely] * x[:, None]).sum(axis=0)
            lout = (loads.load_out[timely] * x[:, None]).sum(axis=0)
            if ((lin > capacities.ingress * (1 - 1e-9)).any()
                    or (lout > capacities.egress * (1 - 1e-9)).any()):
                sums = clip_to_capacity(coflows, rates, capacities)
        res = ResidualCapacity(capacities)
        take_rates(res, coflows, timely, rates, sums)
        late = set(overdue)
        order = overdue + [i for i in by_lat if i not in late]
        greedy_fill(coflows, order, res, rates, loads)
        return build_allocation(coflows, order, rates)
