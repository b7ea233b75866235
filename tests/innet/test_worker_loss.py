"""Exactness under injected packet loss (gradient, aggregate and parameter packets, seeded)."""

from __future__ import annotations

import numpy as np
import pytest

from innet.quantize import error_bound
from innet.service import InnetCluster, JobSpec
from innet.transport import LossConfig

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("fraction", [0.01, 0.05])
@pytest.mark.parametrize("world", [2, 4])
def test_exact_and_complete_under_loss(fraction: float, world: int) -> None:
    rng = np.random.default_rng(int(fraction * 1000) + world)
    loss = LossConfig.uniform(fraction, seed=world)
    opts = (("rto_initial", 0.05),)
    with InnetCluster([JobSpec(1, world, options=opts)], loss=loss) as c:
        for n in (12_000, 777):
            inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
            out = c.allreduce(1, inputs)
            ref = np.sum([a.astype(np.float64) for a in inputs], axis=0)
            for r in out:
                assert np.all(np.abs(r - ref) <= error_bound(ref, c.specs[1].scale, world))
                assert np.array_equal(r, out[0])
        dropped = (c.switch.server.transport.dropped + c.ps.server.transport.dropped
                   + sum(h.worker.transport.dropped for h in c.jobs[1]))
        assert dropped > 0                                  # the loss really happened
        assert sum(h.last_stats.retransmits for h in c.jobs[1]) >= 0
        ps = c.ps.server.stats(1)
        assert ps.resends > 0 and ps.completed > 0
        assert not any(h.last_stats.fallback for h in c.jobs[1])
