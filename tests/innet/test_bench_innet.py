"""Smoke run of benchmarks/innet.py: the switch cuts what reaches the PS to about 1/N."""

import pytest

from benchmarks import innet as bench
from benchmarks.harness import SuiteOptions


@pytest.mark.timeout(120)
def test_quick_run_reports_ps_bytes_per_worker_count() -> None:
    res = bench.run(SuiteOptions(quick=True, workers=[2, 3]))
    (table,) = res.tables
    assert [row[0] for row in table.rows] == [2, 3]
    for row in table.rows:
        n, with_switch, without = row[0], row[1], row[2]
        assert 0 < with_switch < without
        assert with_switch / without <= 1 / n + 0.05
    assert [t.met for t in res.targets] == [True, True]
    assert res.raw["runs"][2]["switch"][0]["ps_packets"] > 0
