"""Several jobs share one switch with fewer aggregators than they want: exact results, collisions at the PS."""

from __future__ import annotations

import numpy as np
import pytest

from innet.quantize import error_bound
from innet.service import InnetCluster, JobSpec

from tests.innet.rank_threads import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_three_jobs_on_a_small_switch() -> None:
    specs = [JobSpec(1, 2, max_window=32), JobSpec(2, 3, max_window=32, scale=2.0**16),
             JobSpec(3, 4, max_window=32)]
    rng = np.random.default_rng(5)
    # 3 jobs x 32 wanted aggregators, only 24 on the switch
    with InnetCluster(specs, num_aggregators=24) as c:
        inputs = {s.job_id: [rng.standard_normal(25_000 + 100 * s.job_id).astype(np.float32)
                             for _ in range(s.world)] for s in specs}
        out = run_ranks([lambda j=s.job_id: c.allreduce(j, inputs[j]) for s in specs])
        for s, res in zip(specs, out):
            ref = np.sum([a.astype(np.float64) for a in inputs[s.job_id]], axis=0)
            for r in res:
                assert np.all(np.abs(r - ref) <= error_bound(ref, s.scale, s.world))
        assert c.control.counters()["collisions"] > 0
        ps_collisions = sum(c.ps.server.stats(s.job_id).collisions for s in specs)
        assert ps_collisions > 0
        assert sum(c.ps.server.stats(s.job_id).switch_aggregates for s in specs) > 0
