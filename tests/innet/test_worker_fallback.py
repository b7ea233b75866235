"""Fate sharing: the switch dies mid-job; workers fall back to the PS and the job completes exactly."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from innet.ps import PSJobConfig, PSThread
from innet.quantize import error_bound
from innet.service import InnetCluster, InnetJob, InnetService, JobSpec, free_udp_port

from tests.innet.rank_threads import run_ranks

pytestmark = pytest.mark.timeout(120)


def _ref_check(out, inputs, scale) -> None:
    ref = np.sum([a.astype(np.float64) for a in inputs], axis=0)
    for r in out:
        assert np.all(np.abs(r - ref) <= error_bound(ref, scale, len(inputs)))


def _kill_when_started(completed, kill, min_done: int = 50) -> threading.Thread:
    def watch() -> None:
        deadline = time.monotonic() + 30
        while completed() < min_done and time.monotonic() < deadline:
            time.sleep(0.005)
        kill()

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_switch_thread_dies_mid_job() -> None:
    world = 3
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(120_000).astype(np.float32) for _ in range(world)]
    with InnetCluster([JobSpec(1, world)]) as c:
        watcher = _kill_when_started(lambda: c.ps.server.stats(1).completed, c.kill_switch)
        out = c.allreduce(1, inputs)
        watcher.join(5)
        _ref_check(out, inputs, c.specs[1].scale)
        for h in c.jobs[1]:
            assert h.last_stats.fallback and "ICMP" in h.last_stats.fallback_reason
        assert c.ps.server.stats(1).direct_workers == set(range(world))
        # the next call goes straight to the PS (the switch is known dead)
        out = c.allreduce(1, [a[:1000] for a in inputs])
        _ref_check(out, [a[:1000] for a in inputs], c.specs[1].scale)
        assert all(h.last_stats.fallback for h in c.jobs[1])


def test_switch_process_killed_mid_job() -> None:
    world, scale = 2, 2.0**20
    sw_port, ps_port = free_udp_port(), free_udp_port()
    jobs = [InnetJob(2, r, world, ("127.0.0.1", sw_port), ("127.0.0.1", ps_port), scale=scale)
            for r in range(world)]
    svc = InnetService.launch(2, [j.address for j in jobs], switch_port=sw_port, ps_port=ps_port,
                              scale=scale, direct_addrs=[j.direct_address for j in jobs])
    try:
        rng = np.random.default_rng(2)
        inputs = [rng.standard_normal(150_000).astype(np.float32) for _ in range(world)]
        watcher = _kill_when_started(lambda: min(j.worker.acked_fragments for j in jobs), svc.kill_switch,
                                     min_done=100)
        out = run_ranks([lambda j=j, a=a: j.allreduce(a) for j, a in zip(jobs, inputs)])
        watcher.join(10)
        assert svc.switch_proc.poll() is not None
        _ref_check(out, inputs, scale)
        assert all(j.last_stats.fallback for j in jobs)
    finally:
        for j in jobs:
            j.close()
        svc.close()


def test_blackholed_switch_falls_back_on_timeout() -> None:
    """A switch that silently drops everything (no ICMP): fallback after ``fallback_timeout``."""
    # long enough that a second wait could not hide in a slow call on a loaded machine
    fallback = 8.0
    hole = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    hole.bind(("127.0.0.1", 0))
    world, scale = 2, 2.0**20
    with PSThread() as ps:
        jobs = [InnetJob(3, r, world, hole.getsockname(), ps.address, scale=scale, fallback_timeout=fallback)
                for r in range(world)]
        ps.server.add_job(PSJobConfig(3, world, scale, switch_addr=hole.getsockname(),
                                      workers=tuple(j.direct_address for j in jobs)))
        try:
            inputs = [np.full(500, r + 0.25, np.float32) for r in range(world)]
            t0 = time.monotonic()
            out = run_ranks([lambda j=j, a=a: j.allreduce(a) for j, a in zip(jobs, inputs)])
            assert time.monotonic() - t0 >= fallback
            _ref_check(out, inputs, scale)
            for j in jobs:
                assert j.last_stats.fallback and "no parameter packet" in j.last_stats.fallback_reason
            # the next call goes to the PS at once: it does not wait fallback_timeout again
            out = run_ranks([lambda j=j, a=a: j.allreduce(a) for j, a in zip(jobs, inputs)])
            _ref_check(out, inputs, scale)
            for j in jobs:
                assert j.last_stats.fallback and "earlier in this job" in j.last_stats.fallback_reason
                assert j.last_stats.elapsed < fallback          # no second wait of fallback_timeout
        finally:
            for j in jobs:
                j.close()
            hole.close()


def test_no_switch_and_no_ps_raises_instead_of_hanging() -> None:
    from twisternet.errors import OperationTimeout

    holes = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2)]
    for h in holes:
        h.bind(("127.0.0.1", 0))
    job = InnetJob(5, 0, 2, holes[0].getsockname(), holes[1].getsockname(), fallback_timeout=0.3,
                   timeout=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(OperationTimeout, match="unacknowledged"):
            job.allreduce(np.ones(100, np.float32))
        assert time.monotonic() - t0 < 10
        assert job.last_stats is None or job.last_stats.fallback
    finally:
        job.close()
        for h in holes:
            h.close()


def test_back_on_the_switch_once_it_answers_again() -> None:
    """After an ICMP-detected fallback, the PS's copies of the results arriving through a restarted
    switch put the workers back on it from their next call."""
    from innet.switch_server import SwitchThread
    world = 2
    inputs = [np.full(2000, r + 0.5, np.float32) for r in range(world)]
    with InnetCluster([JobSpec(1, world)]) as c:
        addr = c.switch.address
        config = {"ports": {str(p): list(a) for p, a in c.control.read_ports().items()},
                  "groups": [{"group_id": g.group_id, "ports": list(g.ports)} for g in c.control.read_mcast_groups()],
                  "jobs": [{"job_id": j.job_id, "fan_in": j.fan_in, "ps_port": j.ps_port,
                            "mcast_group": j.mcast_group, "level": j.level} for j in c.control.read_jobs()],
                  "members": [list(m) for m in c.control.read_members()]}
        c.kill_switch()
        out = c.allreduce(1, inputs)
        _ref_check(out, inputs, c.specs[1].scale)
        assert all(h.last_stats.fallback for h in c.jobs[1])
        c.switch = SwitchThread(c.num_aggregators, c.value_count, config=config, bind=addr).start()
        # the next call, still on the PS, sees results come through the switch too; the one after it
        # (or, if the switch was slow to forward them, a later one) uses the switch again
        for _ in range(5):
            out = c.allreduce(1, inputs)
            _ref_check(out, inputs, c.specs[1].scale)
            if not any(h.last_stats.fallback for h in c.jobs[1]):
                break
        assert not any(h.last_stats.fallback for h in c.jobs[1])
        assert c.control.counters()["aggregated"] > 0
