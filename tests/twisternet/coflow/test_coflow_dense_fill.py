"""Max-min fairness on the dense port x port matrix (``fill_matrix``, used by ``_water_fill`` and by
``fair_share``) against the flow-list progressive filling it replaced: the same rates and the same
residual capacity, bit for bit, on random flow sets."""

from __future__ import annotations

import numpy as np
import pytest

from twisternet.coflow import Coflow, PortCapacities
from twisternet.coflow.policies.fair import fair_share
from twisternet.coflow.rate_allocation import (ResidualCapacity, _water_fill, _water_fill_flows,
                                               fill_matrix, max_min_fair)


def test_fill_matrix_hand_example() -> None:
    # Ingress 0 (cap 3) sends to egress 0 and 1; ingress 1 (cap 10) sends 2 flows to egress 1.
    # Egress 1 (cap 3) has 3 flows: it saturates first at level 1; then ingress 0's flow to egress 0
    # rises to 3 - 1 = 2 (egress 0 has capacity 10).
    W = np.array([[1.0, 1.0], [0.0, 2.0]])
    lev, sat_i, sat_o = fill_matrix(W, np.array([3.0, 10.0]), np.array([10.0, 3.0]),
                                    np.array([3e-9, 1e-8]), np.array([1e-8, 3e-9]))
    assert lev[0, 0] == pytest.approx(2.0) and lev[0, 1] == pytest.approx(1.0)
    assert lev[1, 1] == pytest.approx(1.0)
    assert sat_i.tolist() == [True, False] and sat_o.tolist() == [False, True]


@pytest.mark.parametrize("weighted", [False, True])
def test_dense_water_fill_equals_flow_list(weighted: bool) -> None:
    rng = np.random.default_rng(7 + weighted)
    for trial in range(150):
        P = int(rng.integers(2, 30))
        uniform = trial % 3 == 0
        caps = PortCapacities(np.full(P, 5.0) if uniform else rng.uniform(1, 10, P),
                              np.full(P, 5.0) if uniform else rng.uniform(1, 10, P))
        k = int(rng.integers(1, 250))
        s = rng.integers(0, P, k)
        d = rng.integers(0, P, k)
        w = rng.integers(1, 5, k).astype(np.float64) if weighted else None
        cut = rng.uniform(0.0, 1.0, P)
        cut[rng.random(P) < 0.2] = 0.0          # some ports already full
        dense, flows = ResidualCapacity(caps), ResidualCapacity(caps)
        dense.res_in *= cut
        flows.res_in *= cut
        a = _water_fill(s, d, w, dense, True)
        b = _water_fill_flows(s, d, w, flows, True)
        assert np.array_equal(a, b), trial
        assert np.array_equal(dense.res_in, flows.res_in), trial
        assert np.array_equal(dense.res_out, flows.res_out), trial


def test_fair_share_by_port_pairs_equals_flow_max_min() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        P = int(rng.integers(3, 12))
        caps = PortCapacities(rng.uniform(1, 10, P), rng.uniform(1, 10, P))
        coflows = []
        for i in range(int(rng.integers(1, 6))):
            n = int(rng.integers(20, 60))
            size = rng.uniform(1, 5, n)
            rem = size.copy()
            rem[rng.random(n) < 0.3] = 0.0
            rem[0] = size[0]
            coflows.append(Coflow(i, 0.0, src=rng.integers(0, P, n), dst=rng.integers(0, P, n),
                                  size=size, remaining=rem))
        got = np.concatenate(fair_share(coflows, caps))
        src = np.concatenate([c.src for c in coflows])
        dst = np.concatenate([c.dst for c in coflows])
        live = np.concatenate([c.remaining for c in coflows]) > 0
        want = max_min_fair(src, dst, ResidualCapacity(caps), mask=live, take=False)
        assert np.array_equal(got, want)
