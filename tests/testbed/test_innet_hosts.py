"""In-network allreduce across the emulated cluster's hosts: 3 hosts x 1 rank on 100 Mbit/s links, the
ATP switch (with its P4Runtime server) on an unshaped service host and a standing PS on another, the job
pointed at them by the config keys a cluster user sets (``innet_switch``, ``innet_p4runtime``,
``innet_ps``; docs/innet.md).

What must hold: every rank's results equal the float64 sum within ``innet.error_bound``; every address
involved is the testbed's (no loopback), the data crosses each host's link; and a host whose link is
cut mid-job ends every rank's call with an error within the liveness timeout, not a hang.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.jobs import require_emulated_cluster
from tests.testbed.test_bad_hosts import (ENV, PEER_TIMEOUT, SLACK, assert_every_worker_failed_by, cut_link_mid_job,
                                          failures)
from twisternet.testbed import Job, Testbed

SCRIPTS = Path(__file__).parent / "scripts"
EXACT, LOOP = SCRIPTS / "innet_exact.py", SCRIPTS / "allreduce_loop.py"
VALUES = 364          # the widest packet a 1500-byte MTU carries unfragmented: 16 + 4 * 364 + 28 = 1500
ELEMENTS = 200_000    # 800 KB per rank and call
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Testbed, str, dict[str, str], list[Job]]]:
    """3 rank hosts at 100 Mbit/s; svc0 runs the switch, svc1 the standing PS (both links unshaped)."""
    require_emulated_cluster()
    with Testbed(hosts=3, ranks_per_host=1, rate="100mbit", service_hosts=2) as tb:
        token = secrets.token_hex(16)
        switch, env = tb.start_innet_switch(tb.service_host_ids[0], token, values=VALUES)
        ps, ps_env = tb.start_innet_ps(tb.service_host_ids[1], token, values=VALUES)
        yield tb, token, {**env, **ps_env, **ENV}, [switch, ps]


def test_results_are_exact_on_every_rank_and_cross_the_links(cluster) -> None:
    tb, token, env, services = cluster
    calls = 3
    res = tb.twisternet_job(EXACT, [str(calls), str(ELEMENTS)], token=token, env=env, timeout=180)
    assert res.ok, res.describe()
    switch_host, ps_host = (tb.addresses[h] for h in tb.service_host_ids)
    where = {}
    for p in res.workers:
        m = re.search(r"WHERE rank=(\d+) host=(\S+) worker=(\S+):\d+ switch=(\S+):\d+ ps=(\S+):\d+ values=(\d+) "
                      r"own_switch=(\w+)", p.stdout)
        assert m, res.describe()
        where[p.host] = m.groups()
        _, host, worker, switch, ps, values, own = m.groups()
        assert host == tb.hostnames[p.host] and worker == tb.addresses[p.host], m.group(0)
        assert (switch, ps, int(values), own) == (switch_host, ps_host, VALUES, "False"), m.group(0)
        results = re.findall(r"RESULT rank=\d+ call=(\d+) ok=(\w+) worst=\S+ fallback=(\w+)", p.stdout)
        assert [r[0] for r in results] == [str(i) for i in range(calls)], p.stdout
        assert all(ok == "True" and fb == "False" for _, ok, fb in results), p.stdout
    assert sorted(int(w[0]) for w in where.values()) == [0, 1, 2]
    # each rank host's link carried its gradients up and the results down: 2 x 800 KB per call at least
    moved = res.link_bytes()
    for h in range(tb.hosts):
        assert moved[h] >= 2 * calls * ELEMENTS * 4, moved
    assert all(job.main[0].proc.poll() is None for job in services), "the switch or the PS died"


def test_a_cut_link_ends_every_ranks_call_with_an_error(cluster) -> None:
    tb, token, env, services = cluster
    job = tb.start_twisternet_job(LOOP, ["120", "65536", "innet"], token=token, env=env)
    res, down = cut_link_mid_job(tb, job)
    assert_every_worker_failed_by(res, down + PEER_TIMEOUT + SLACK)
    fails = failures(res)
    assert len(fails) == tb.hosts, res.describe()
    for (host, _), m in fails.items():
        if host != 1:
            assert m.group(3) == "PeerLostError", m.group(0)
            assert tb.hostnames[1] in m.group(4) or tb.addresses[1] in m.group(4), m.group(0)
    assert all(s.main[0].proc.poll() is None for s in services), "the switch or the PS died with the job"
