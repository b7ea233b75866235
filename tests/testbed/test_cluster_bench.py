"""The ``cluster`` benchmark suite keeps working (figures are not checked: they belong to the benchmark)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.cluster import RAW, bound_s, rate_bits, rtt_target, slowest
from tests.jobs import job_env, require_emulated_cluster

ROOT = Path(__file__).resolve().parents[2]


def test_rate_and_bound() -> None:
    assert rate_bits("1gbit") == 1e9 and rate_bits("100Mbit") == 1e8 and rate_bits("1.5gbit") == 1.5e9
    with pytest.raises(ValueError):
        rate_bits("1gbps")
    # 4 hosts at 1 Gbit/s, 64 MiB: 2 * 3/4 * 67108864 B / 125e6 B/s = 0.805 s
    assert bound_s(64 << 20, 4, "1gbit") == pytest.approx(0.80530636, rel=1e-6)


def test_slowest_takes_the_maximum_over_ranks_even_glued() -> None:
    out = ('CLUSTER {"rank": 1, "host": "host1", "median_s": {"1024": 0.5}}CLUSTER {"rank": 0, "host": "host0", '
           '"median_s": {"1024": 0.25}}\n')
    assert slowest(out, 2) == {1024: 0.5}
    with pytest.raises(RuntimeError, match="ranks 0..2"):
        slowest(out, 3)


def test_the_small_message_target_compares_auto_with_the_raw_round_trip() -> None:
    kb = 1024
    met = rtt_target({"tn auto": {kb: 90e-6}, RAW: {kb: 30e-6}})
    assert met.met is True and met.measured == "3.00x (90 µs vs 30 µs)"
    assert rtt_target({"tn auto": {kb: 91e-6}, RAW: {kb: 30e-6}}).met is False
    for m in ({"tn auto": {kb: 90e-6}}, {RAW: {kb: 30e-6}}, {"tn ring": {kb: 1e-6}, RAW: {kb: 30e-6}}):
        t = rtt_target(m)
        assert t.met is None and t.measured == "not measured"


@pytest.mark.timeout(400)
def test_quick_cluster_suite(tmp_path) -> None:
    require_emulated_cluster()
    p = subprocess.run([sys.executable, "-m", "benchmarks", "--suite", "cluster", "--quick", "--json",
                        str(tmp_path / "r.json"), "--set", "cluster.gloo=0"], env=job_env(), capture_output=True,
                       text=True, timeout=380, cwd=ROOT)
    suite = json.loads((tmp_path / "r.json").read_text())["suites"][0]
    assert p.returncode == 0 and suite["status"] == "ok", p.stdout[-3000:] + p.stderr[-3000:]
    table = suite["tables"][0]
    assert table["headers"][:3] == ["size", "tn auto", "MPICH"] and "bound" in table["headers"]
    assert [r[0] for r in table["rows"]] == ["1 KB", "64 KB"]
    assert all(isinstance(v, float) and v > 0 for r in table["rows"] for v in r[1:4])
    assert "2 hosts x 1 rank(s) per host" in table["title"]
    raw = table["headers"].index(RAW)       # one rank per host: the raw round trip between hosts 0 and 1
    assert all(isinstance(r[raw], float) and r[raw] > 0 for r in table["rows"])
    assert table["headers"][-1] == "auto/raw RTT" and all(isinstance(r[-1], float) for r in table["rows"])
    (target,) = [t for t in suite["targets"] if t["name"] == "1 KB allreduce, 2 hosts x 1"]
    assert target["met"] in (True, False) and "µs vs" in target["measured"]


def test_innet_theory_counts_frames_and_headers() -> None:
    from benchmarks.cluster_innet import parse_size, theory
    assert parse_size("64M") == 64 << 20 and parse_size("1k") == 1024
    t = theory(64 << 20, 4, "100mbit", 364)         # 364 values: one 1500-byte datagram per 1456 bytes
    assert t["innet"] == pytest.approx((64 << 20) / 12.5e6) and t["ring"] == pytest.approx(1.5 * t["innet"])
    assert t["innet_wire"] == pytest.approx(t["innet"] * 1514 / 1456)
    assert t["ring_wire"] == pytest.approx(t["ring"] * 1514 / 1448)
    wide = theory(64 << 20, 4, "100mbit", 2048)     # 8236-byte datagrams: 6 IP fragments, 5 more IP headers
    assert wide["innet_wire"] == pytest.approx(wide["innet"] * (8236 + 6 * 14 + 5 * 20) / 8192)


@pytest.mark.timeout(400)
def test_innet_cluster_benchmark_runs(tmp_path) -> None:
    """The cross-host in-network benchmark runs end to end on 2 hosts (its figures are not checked)."""
    require_emulated_cluster()
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "benchmarks/cluster_innet.py", "--hosts", "2", "--size", "1M", "--reps", "1",
                        "--repeat", "1", "--vias", "ring", "--json", str(out)], env=job_env(), capture_output=True,
                       text=True, timeout=380, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert sorted(res["launches"]) == ["innet", "ring"]
    for runs in res["launches"].values():
        assert len(runs) == 1 and runs[0]["slowest_median_s"] > 0 and runs[0]["worst"] <= 1.0
    assert "x best without the switch (ring)" in p.stdout and "target:" in p.stdout
