"""The coflow-gen / coflow-sim command-line functions."""

from __future__ import annotations

import json

import pytest

from twisternet.coflow import read_trace
from twisternet.coflow.cli import gen_main, main


@pytest.mark.timeout(120)
def test_gen_then_sim(tmp_path, capsys) -> None:
    out = tmp_path / "t.txt"
    assert gen_main([str(out), "--ports", "12", "--coflows", "25", "--seed", "3",
                     "--duration-s", "30"]) == 0
    tr = read_trace(out)
    assert tr.num_ports == 12 and len(tr.coflows) == 25
    capsys.readouterr()
    assert main([str(out), "--policy", "sebf", "--policy", "deadline", "--deadline-slack", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("policy=sebf coflows=25 avg_cct_ms=")
    for key in ("p95_cct_ms=", "deadlines_met=", "vs_fair_avg=", "speedup_vs_fair="):
        assert key in lines[0]
    assert lines[1].startswith("policy=deadline ")
    assert main([str(out), "--policy", "fair", "--policy", "fifo", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["policy"]: r for r in doc["results"]}
    assert set(rows) == {"fair", "fifo"}
    assert rows["fair"]["vs_fair_avg"] == pytest.approx(1.0)
    assert rows["fifo"]["coflows"] == 25 and "deadlines_met" not in rows["fifo"]


def test_cli_errors(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("3 1\n1 0 1 7 1 0:1\n")
    assert main([str(bad), "--policy", "fair"]) == 2
    assert "bad.txt:2" in capsys.readouterr().err
    assert main([str(bad), "--policy", "nope"]) == 2
    assert main([str(tmp_path / "missing.txt")]) == 2
    assert gen_main([str(tmp_path / "x.txt"), "--ports", "0"]) == 2
