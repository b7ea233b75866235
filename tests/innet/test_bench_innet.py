"""Smoke run of benchmarks/innet.py: the switch cuts what reaches the PS to about 1/N."""

import pytest

from benchmarks import innet as bench
from benchmarks.harness import SuiteOptions


@pytest.mark.timeout(120)
def test_quick_run_reports_ps_bytes_per_worker_count() -> None:
    res = bench.run(SuiteOptions(quick=True, workers=[2, 3], extra={"allreduce": False,
                                                                     "rate_fragments": 1000}))
    table, tenancy, ecn, rate = res.tables
    assert [row[0] for row in table.rows] == [2, 3]
    for row in table.rows:
        with_switch, without = row[1], row[2]
        assert 0 < with_switch < without     # the 1/n + 5% target is the benchmark's (flaky under load)
    # the rate table: the bare ceiling, both server loops and both dataplanes, every figure measured
    from innet.fastpath import c_available
    compiled = ["bare receive loop (recvmmsg", "switch server", "dataplane alone", "switch server"]
    assert [r[0].split(",")[0] for r in rate.rows] == ["bare receive loop (recvfrom_into)", "switch server",
                                                        "switch server", "dataplane alone", "dataplane alone",
                                                        "switch server"] + (compiled if c_available() else [])
    assert all(r[2] > 0 for r in rate.rows)
    assert res.raw["rate"]["runs"]["batched"][0]["aggregated"] == 2000
    assert res.raw["rate"]["runs"]["batched"][0]["dataplane"] == "python"
    if c_available():
        assert res.raw["rate"]["runs"]["compiled"][0]["aggregated"] == 2000
        assert res.raw["rate"]["runs"]["compiled"][0]["dataplane"] == "c"
    assert res.raw["runs"][2]["switch"][0]["ps_packets"] > 0
    # ECN on/off: both modes ran to exact results; with ECN off the switch never marked, with it on it did
    on, off = (res.raw["ecn"]["runs"][m][0] for m in ("on", "off"))
    assert [row[0] for row in ecn.rows] == ["on", "off"]
    assert on["ecn_signals"] > 0 and off["ecn_signals"] == 0
    assert off["tail_drops"] > 0      # without ECN the 32-packet buffer overflows
    assert [t.name.split(",")[0] for t in res.targets[2:5]] == ["multi-tenancy", "ECN on vs off", "ECN on vs off"]
    # multi-tenancy: 96, 48 and 10 aggregators; fewer aggregators, more collisions (sent to the PS)
    assert [row[1] for row in tenancy.rows] == [96, 48, 10]
    collisions = [row[4] for row in tenancy.rows]
    assert collisions[2] > collisions[0]


@pytest.mark.timeout(300)
def test_the_allreduce_worker_reports_the_cpu_of_the_ranks_and_of_the_switch_and_ps() -> None:
    """The loopback comparison's CPU columns: innet's switch and PS are the job's helpers, the ring has none."""
    innet = bench.allreduce_vs_ring(2, 1 << 18, "innet", 2, 2048)
    ring = bench.allreduce_vs_ring(2, 1 << 18, "ring", 2)
    assert innet["cpu_s"]["ranks"] > 0 and innet["cpu_s"]["helpers"] > 0
    assert ring["cpu_s"]["ranks"] > 0 and ring["cpu_s"]["helpers"] == 0
