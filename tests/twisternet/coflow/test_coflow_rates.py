"""Γ, MADD and max-min primitives on hand-computed examples, plus feasibility and work conservation of
every built-in policy on random instances (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twisternet.coflow import (Coflow, PortCapacities, effective_bottleneck, get_policy, madd_rates,
                               policy_names)
from twisternet.coflow.rate_allocation import ResidualCapacity, max_min_fair


def test_gamma_is_max_port_load_over_capacity() -> None:
    # Ingress 0 sends 3+1 = 4 bytes, ingress 1 sends 2; egress 0 receives 3+2 = 5, egress 1 receives 1.
    # Capacities: ingress (2, 1), egress (4, 1): times 4/2=2, 2/1=2, 5/4=1.25, 1/1=1  ->  Γ = 2.
    c = Coflow("c", 0.0, [(0, 0, 3.0), (0, 1, 1.0), (1, 0, 2.0)])
    caps = PortCapacities(np.array([2.0, 1.0]), np.array([4.0, 1.0]))
    assert effective_bottleneck(c, caps.ingress, caps.egress) == pytest.approx(2.0)
    # Halve egress 0 -> 5/2 = 2.5 becomes the bottleneck.
    assert effective_bottleneck(c, caps.ingress, np.array([2.0, 1.0])) == pytest.approx(2.5)
    # A needed port with no capacity left -> infinite Γ, and MADD gives nothing.
    assert effective_bottleneck(c, np.array([0.0, 1.0]), caps.egress) == np.inf
    assert not madd_rates(c, np.array([0.0, 1.0]), caps.egress).any()


def test_madd_rates_finish_all_flows_together() -> None:
    # Γ = 2 (above): rates = remaining / 2 = (1.5, 0.5, 1.0); each flow needs exactly 2 s.
    c = Coflow("c", 0.0, [(0, 0, 3.0), (0, 1, 1.0), (1, 0, 2.0)])
    caps = PortCapacities(np.array([2.0, 1.0]), np.array([4.0, 1.0]))
    r = madd_rates(c, caps.ingress, caps.egress)
    assert r == pytest.approx([1.5, 0.5, 1.0])
    assert c.remaining / r == pytest.approx([2.0, 2.0, 2.0])
    # Only the bottleneck ports are full: ingress 0 carries 2.0 of 2, ingress 1 carries 1.0 of 1.
    assert np.bincount(c.src, weights=r) == pytest.approx([2.0, 1.0])


def test_max_min_fair_hand_example() -> None:
    # Unit ports. Flows: a 0->0, b 0->1, c 1->1, d 2->1.
    # Egress 1 has b, c, d -> 1/3 each; then ingress 0 has 1 - 1/3 left for a -> a = 2/3.
    src = np.array([0, 0, 1, 2])
    dst = np.array([0, 1, 1, 1])
    res = ResidualCapacity(PortCapacities.uniform(3, 1.0))
    r = max_min_fair(src, dst, res)
    assert r == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert res.res_in == pytest.approx([0.0, 2 / 3, 2 / 3])
    assert res.res_out == pytest.approx([1 / 3, 0.0, 1.0])


# ----------------------------------------------------------------- properties
def _instances():
    flow = st.tuples(st.integers(0, 3), st.integers(0, 3), st.floats(0.5, 50.0))
    coflow = st.tuples(st.floats(0.0, 5.0), st.lists(flow, min_size=1, max_size=6),
                       st.one_of(st.none(), st.floats(0.5, 30.0)))
    return st.lists(coflow, min_size=1, max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_instances(), st.sampled_from(["fifo", "fair", "sebf", "deadline", "dag"]),
       st.lists(st.floats(0.5, 4.0), min_size=8, max_size=8))
def test_policies_feasible_and_work_conserving(spec, policy, capv) -> None:
    caps = PortCapacities(np.array(capv[:4]), np.array(capv[4:]))
    coflows = [Coflow(i, a, fl, deadline=d) for i, (a, fl, d) in enumerate(spec)]
    now = max(c.arrival for c in coflows)
    sched = get_policy(policy)
    served = [c for c in coflows if sched.on_arrival(c, now, caps) or sched.serve_rejected]
    alloc = sched.allocate(served, now, caps)
    lin, lout = alloc.port_loads(served, caps)
    # Feasible: no port over its capacity.
    assert (lin <= caps.ingress * (1 + 1e-7)).all()
    assert (lout <= caps.egress * (1 + 1e-7)).all()
    # Work conserving: every flow still to send crosses at least one saturated port.
    for c in served:
        r = alloc.rates[c.id]
        assert (r >= 0).all()
        for s, d in zip(c.src, c.dst):
            full_in = lin[s] >= caps.ingress[s] * (1 - 1e-6)
            full_out = lout[d] >= caps.egress[d] * (1 - 1e-6)
            assert full_in or full_out, (policy, c.id, s, d)
    assert sorted(alloc.order, key=str) == sorted((c.id for c in served), key=str)


def test_all_builtin_policies_registered() -> None:
    assert {"fifo", "fair", "sebf", "deadline", "dag"} <= set(policy_names())
