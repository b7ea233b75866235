"""The incremental engine (only moving coflows advance; per-coflow loads and live-flow shapes cached
per ``Coflow.version``) against the engine it replaced (coflow_reference_engine.py, which leaves the
coflows unversioned so every policy takes its uncached path): the same finish time for every coflow,
under every built-in policy, on synthetic traces and on the first coflows of the published trace."""

from __future__ import annotations

import os

import numpy as np
import pytest
from coflow_reference_engine import simulate_reference

from twisternet.coflow import (GBIT, Allocation, Coflow, PortCapacities, Scheduler, generate_trace,
                               read_trace, simulate)
from twisternet.coflow.policies.fair import fair_share
from twisternet.coflow.rate_allocation import CoflowLoads, ResidualCapacity, greedy_fill
from twisternet.coflow.trace import published_trace_path

POLICIES = ("fifo", "fair", "sebf", "deadline", "dag")


def _same_finishes(coflows: list[Coflow], caps: PortCapacities, policy: str, gap: float,
                   **opts) -> None:
    old = simulate_reference(coflows, policy, caps, realloc_gap=gap, **opts)
    new = simulate(coflows, policy, caps, realloc_gap=gap, **opts)
    assert new.events == old.events
    for a, b in zip(old.coflows, new.coflows):
        assert a.id == b.id and a.admitted == b.admitted
        assert (a.finish is None) == (b.finish is None), a.id
        if a.finish is not None:
            assert b.finish == pytest.approx(a.finish, rel=1e-12, abs=1e-12), a.id


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("gap", [0.0, 1.0])
def test_synthetic_trace_same_finish_times(policy: str, gap: float) -> None:
    tr = generate_trace(num_ports=12, num_coflows=40, seed=3, duration_s=60.0, long_mb=50.0)
    caps = tr.capacities(GBIT)
    _same_finishes(tr.to_coflows(caps, deadline_slack=2.0), caps, policy, gap)


def test_fifo_share_skipped_same_finish_times() -> None:
    tr = generate_trace(num_ports=10, num_coflows=30, seed=5, duration_s=30.0, long_mb=50.0)
    caps = tr.capacities(GBIT)
    _same_finishes(tr.to_coflows(caps), caps, "fifo", 0.0, share_skipped=True)


@pytest.mark.parametrize("policy", POLICIES)
def test_published_trace_prefix_same_finish_times(policy: str) -> None:
    path = published_trace_path()
    if not os.path.exists(path):
        pytest.skip(f"published trace not found at {path}")
    tr = read_trace(path)
    caps = tr.capacities(GBIT)
    _same_finishes(tr.to_coflows(caps, deadline_slack=2.0)[:80], caps, policy, 1.0)


class FairOnFinishedToo(Scheduler):
    """Max-min fair rates, and a positive rate on every finished flow too (no zeroing, as a
    custom policy may do): the simulator must ignore those flows when it looks for the next
    completion."""

    def allocate(self, coflows, now, capacities) -> Allocation:
        rates = fair_share(coflows, capacities)
        out = {c.id: np.where(c.remaining > 0, r, 0.5) for c, r in zip(coflows, rates)}
        return Allocation(out, [c.id for c in coflows])


@pytest.mark.parametrize("gap", [0.0, 1.0])
def test_rates_on_finished_flows_same_finish_times(gap: float) -> None:
    tr = generate_trace(num_ports=8, num_coflows=25, seed=9, duration_s=30.0, long_mb=50.0)
    caps = tr.capacities(GBIT)
    coflows = tr.to_coflows(caps)
    old = simulate_reference(coflows, FairOnFinishedToo(), caps, realloc_gap=gap)
    new = simulate(coflows, FairOnFinishedToo(), caps, realloc_gap=gap, max_events=10 * old.events)
    assert new.events == old.events
    assert [r.finish for r in new.coflows] == [r.finish for r in old.coflows]
    assert all(r.finish is not None for r in new.coflows)


def _random_coflows(rng: np.random.Generator, n_ports: int, k: int) -> list[Coflow]:
    out = []
    for i in range(k):
        m = int(rng.integers(1, 5))
        r = int(rng.integers(1, 5))
        src = np.repeat(rng.choice(n_ports, m, replace=False), r)
        dst = np.tile(rng.choice(n_ports, r, replace=False), m)
        size = rng.uniform(1.0, 10.0, src.shape[0])
        rem = size.copy()
        if i % 2:   # some flows finished: the live set is no longer a complete mapper x reducer set
            rem[rng.random(src.shape[0]) < 0.4] = 0.0
            if not rem.any():
                rem[0] = size[0]
        out.append(Coflow(i, 0.0, src=src, dst=dst, size=size, remaining=rem))
    return out


def test_versioned_greedy_fill_and_loads_match_unversioned() -> None:
    rng = np.random.default_rng(11)
    caps = PortCapacities.uniform(6, 10.0)
    for _ in range(30):
        plain = _random_coflows(rng, 6, 5)
        versioned = [c.copy() for c in plain]
        for c in versioned:
            c.version = 0
        order = list(rng.permutation(len(plain)))
        res_p, res_v = ResidualCapacity(caps), ResidualCapacity(caps)
        cut = rng.uniform(0.0, 1.0, 6)
        res_p.res_in *= cut
        res_v.res_in *= cut
        lp = CoflowLoads(plain, 6, 6)
        lv = CoflowLoads(versioned, 6, 6)
        assert np.array_equal(lp.load_in, lv.load_in) and np.array_equal(lp.load_out, lv.load_out)
        rp = [np.zeros(len(c)) for c in plain]
        rv = [np.zeros(len(c)) for c in versioned]
        greedy_fill(plain, order, res_p, rp, lp)
        greedy_fill(versioned, order, res_v, rv, lv)
        for a, b in zip(rp, rv):
            assert np.array_equal(a, b)
        assert np.array_equal(res_p.res_in, res_v.res_in)
        assert np.array_equal(res_p.res_out, res_v.res_out)


def test_version_bump_invalidates_cached_loads() -> None:
    c = Coflow("x", 0.0, [(0, 1, 4.0), (1, 1, 2.0)])
    c.version = 0
    assert CoflowLoads([c], 2, 2).load_out[0, 1] == 6.0
    c.remaining[0] = 1.0
    c.version += 1
    assert CoflowLoads([c], 2, 2).load_out[0, 1] == 3.0
    c.remaining[1] = 0.0
    c.version = None   # unversioned: never cached
    assert CoflowLoads([c], 2, 2).load_out[0, 1] == 1.0
