"""End-to-end allreduce on loopback: workers -> software switch -> PS -> switch -> workers."""

from __future__ import annotations

import numpy as np
import pytest

from innet.control import JobEntry, MulticastGroup
from innet.ps import PSJobConfig, PSThread
from innet.quantize import error_bound
from innet.service import InnetCluster, InnetJob, JobSpec
from innet.switch_server import SwitchThread

from tests.innet.rank_threads import run_ranks

pytestmark = pytest.mark.timeout(120)


def _check(results, inputs, scale: float) -> None:
    ref = np.sum([np.asarray(a, np.float64) for a in inputs], axis=0)
    bound = error_bound(ref, scale, len(inputs))
    for r in results:
        assert r.dtype == np.float32 and r.shape == np.shape(inputs[0])
        assert np.all(np.abs(r.astype(np.float64) - ref) <= bound)
        assert np.array_equal(r.view(np.int32), results[0].view(np.int32))   # every rank, same bits


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_allreduce_sizes(world: int) -> None:
    rng = np.random.default_rng(world)
    with InnetCluster([JobSpec(1, world)]) as c:
        for n in (1, 61, 62, 63, 1000, 40_000):     # successive calls share the sequence space
            inputs = [rng.standard_normal(n).astype(np.float32) * 10 for _ in range(world)]
            _check(c.allreduce(1, inputs), inputs, c.specs[1].scale)
        st = c.control.counters()
        assert st["aggregated"] > 0 and st["acks"] > 0
        assert not any(h.last_stats.fallback for h in c.jobs[1])


def test_allreduce_few_megabytes_default_packet() -> None:
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(1 << 19).astype(np.float32) for _ in range(2)]   # 2 MB per rank
    with InnetCluster([JobSpec(1, 2)]) as c:
        _check(c.allreduce(1, inputs), inputs, c.specs[1].scale)


def test_allreduce_megabytes_eight_workers_jumbo_packets() -> None:
    rng = np.random.default_rng(8)
    inputs = [rng.standard_normal(1 << 19).astype(np.float32) for _ in range(8)]   # 2 MB per rank
    with InnetCluster([JobSpec(1, 8)], value_count=1024) as c:
        _check(c.allreduce(1, inputs), inputs, c.specs[1].scale)


@pytest.mark.slow
def test_allreduce_64_megabytes() -> None:
    rng = np.random.default_rng(9)
    inputs = [rng.standard_normal(1 << 24).astype(np.float32) for _ in range(2)]   # 64 MB per rank
    with InnetCluster([JobSpec(1, 2, max_window=256)], value_count=2048) as c:
        _check(c.allreduce(1, inputs, timeout=600), inputs, c.specs[1].scale)


def test_mean_shapes_dtypes_and_empty() -> None:
    with InnetCluster([JobSpec(1, 3, scale=2.0**16)]) as c:
        inputs = [np.full((4, 5), r + 1, np.float64) for r in range(3)]
        out = c.allreduce(1, inputs, op="mean")
        assert out[0].shape == (4, 5) and out[0].dtype == np.float32
        assert np.allclose(out[0], 2.0)
        ints = [np.arange(10) * (r + 1) for r in range(3)]
        assert np.array_equal(c.allreduce(1, ints)[1], np.arange(10, dtype=np.float32) * 6)
        empty = c.allreduce(1, [np.zeros(0, np.float32)] * 3)
        assert empty[0].shape == (0,)
        job = c.jobs[1][0]
        with pytest.raises(ValueError, match="op"):
            job.allreduce(np.ones(3, np.float32), op="max")
        with pytest.raises(TypeError, match="numeric"):
            job.allreduce(np.array(["a"]))


def test_overflowing_and_non_finite_values_take_the_float_path() -> None:
    scale = 2.0**20
    with InnetCluster([JobSpec(1, 4, scale=scale)]) as c:
        rng = np.random.default_rng(3)
        inputs = [rng.standard_normal(500).astype(np.float32) for _ in range(4)]
        inputs[1][7] = 3e9          # far beyond int32 / scale
        inputs[2][300] = -1e30
        out = c.allreduce(1, inputs)
        _check(out, inputs, scale)
        stats = c.ps.server.stats(1)
        assert stats.overflow >= 2
        assert c.jobs[1][1].last_stats.overflow_fragments == 1
        nan_in = [np.zeros(10, np.float32) for _ in range(4)]
        nan_in[0][3] = np.nan
        nan_in[3][4] = np.inf
        out = c.allreduce(1, nan_in)[0]
        assert np.isnan(out[3]) and np.isposinf(out[4]) and np.all(out[[0, 1, 2, 5, 6, 7, 8, 9]] == 0)


def test_two_level_topology_end_to_end() -> None:
    """Two worker racks (level-0 ToRs) under a PS-rack ToR (level 1): each gradient aggregated once."""
    V, world, rack = 62, 5, 2            # racks of 2, 2 and 1 workers
    ps = PSThread(value_count=V).start()
    l1 = SwitchThread(256, V).start()
    tors = [SwitchThread(256, V).start() for _ in range(3)]
    jobs = [InnetJob(4, r, world, tors[r // rack].address, ps.address, rack_size=rack,
                     num_aggregators=256, value_count=V) for r in range(world)]
    try:
        for t, tor in enumerate(tors):
            sw = tor.switch
            members = [r for r in range(world) if r // rack == t]
            for r in members:
                sw.set_port(r % rack + 1, jobs[r].address)
            sw.set_port(100, l1.address)
            sw.insert_mcast_group(MulticastGroup(1, tuple(r % rack + 1 for r in members)))
            sw.insert_job(JobEntry(4, len(members), 100, 1, level=0))
            for r in members:
                sw.insert_member(4, r % rack + 1)
            l1.switch.set_port(t + 1, tor.address)
            l1.switch.insert_member(4, t + 1)
        l1.switch.set_port(100, ps.address)
        l1.switch.insert_mcast_group(MulticastGroup(1, (1, 2, 3)))
        l1.switch.insert_job(JobEntry(4, 3, 100, 1, level=1))
        ps.server.add_job(PSJobConfig(4, world, jobs[0].scale, l1.address, rack_size=rack))
        rng = np.random.default_rng(11)
        inputs = [rng.standard_normal(20_000).astype(np.float32) for _ in range(world)]
        out = run_ranks([lambda j=j, a=a: j.allreduce(a) for j, a in zip(jobs, inputs)])
        _check(out, inputs, jobs[0].scale)
        assert l1.switch.counters()["aggregated"] > 0
        assert all(t.switch.counters()["aggregated"] > 0 for t in tors)
        s = ps.server.stats(4)
        assert s.switch_aggregates > s.raw                  # most fragments came aggregated by level 1
    finally:
        for j in jobs:
            j.close()
        for t in (*tors, l1):
            t.stop()
        ps.stop()


def test_ecn_marks_halve_the_window() -> None:
    world = 4
    rng = np.random.default_rng(12)
    inputs = [rng.standard_normal(30_000).astype(np.float32) for _ in range(world)]
    with InnetCluster([JobSpec(1, world)], ecn_threshold=0) as c:   # mark whenever anything is queued
        _check(c.allreduce(1, inputs), inputs, c.specs[1].scale)
        assert c.control.counters()["ecn_marked"] > 0
        stats = [h.last_stats for h in c.jobs[1]]
        assert all(s.ecn_signals > 0 for s in stats)
        assert all(s.min_window < 8 for s in stats)                 # below the initial window


def test_sequence_numbers_wrap_around() -> None:
    """Fragments crossing seq 2**24 - 1 -> 0 (the 24-bit wrap) are reduced correctly."""
    world = 3
    with InnetCluster([JobSpec(1, world)]) as c:
        for h in c.jobs[1]:
            h.worker._next_seq = 2**24 - 40
        rng = np.random.default_rng(13)
        for _ in range(2):
            inputs = [rng.standard_normal(62 * 50 + 7).astype(np.float32) for _ in range(world)]
            _check(c.allreduce(1, inputs), inputs, c.specs[1].scale)
        assert all(h.worker._next_seq > 2**24 for h in c.jobs[1])
