"""The benchmark entry point and report rendering, on fabricated suites (no real measurements)."""

import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import __main__ as entry
from benchmarks import allreduce, report
from benchmarks.harness import (Chart, Progress, SuiteOptions, SuiteResult, Table, Target, parse_size,
                                ratio)
from tests.jobs import job_env

ROOT = Path(__file__).resolve().parent.parent.parent


def fabricated() -> SuiteResult:
    return SuiteResult(
        suite="fake",
        description="a fabricated suite",
        tables=[Table("speeds", ["size", "ours ms", "peer ms", "ratio"],
                      [["1 KB", 0.5, 0.25, 2.0], ["64 MB", 120.0, None, None]], note="lower is better")],
        charts=[Chart("time_vs_size", "time vs size", "message size (bytes)", "ms",
                      {"ours": [(1024, 0.5), (65536, 2.0)], "peer": [(1024, 0.25), (65536, 1.0)]}, logx=True)],
        targets=[Target("fast at 1 KB", "ratio <= 1.00", "2.00x", False),
                 Target("fast at 64 KB", "ratio <= 1.25", "0.90x", True),
                 Target("fast at 64 MB", "ratio <= 1.15", "not measured (peer did not run)", None)],
        skipped=["ray gloo: ray is not installed (pip install ray)"],
        raw={"samples": {1024: [0.5, 0.6]}},
        seconds=3.25)


MACHINE = {"cpu": "Test CPU 9000", "logical_cores": 2, "physical_cores": 1, "usable_cores": 2, "ram_gb": 7.5,
           "os": "TestOS-1", "python": "CPython 3.x", "packages": {"numpy": "1.0", "ray": None},
           "mpi_library": "MPICH Version: 9"}


def table_blocks(md: str) -> list[list[list[str]]]:
    """Parse every Markdown table of ``md`` into rows of stripped cells (separator lines dropped)."""
    tables, cur = [], []
    for line in md.splitlines() + [""]:
        if line.startswith("|"):
            if not set(line) <= set("|- "):
                cur.append([c.strip() for c in line.strip("|").split(" | ")])
        elif cur:
            tables.append(cur)
            cur = []
    return tables


# ---------------------------------------------------------------------------------- rendering

def test_format_cell():
    assert report.format_cell(None) == "n/a"
    assert report.format_cell(float("nan")) == "n/a"
    assert report.format_cell(123456.7) == "123,457"
    assert report.format_cell(2.0) == "2.00"
    assert report.format_cell(0.0123456) == "0.012"
    assert report.format_cell(1.5e-6) == "1.5e-06"
    assert report.format_cell("a|b") == "a\\|b"


def test_markdown_table_rejects_ragged_rows():
    with pytest.raises(ValueError, match="2 cells"):
        report.markdown_table(["a", "b", "c"], [[1, 2]])


def test_results_page_structure(tmp_path):
    ok = fabricated()
    failed = SuiteResult(suite="broken", status="failed", error="Traceback ...\nRuntimeError: boom", seconds=1.0)
    absent = SuiteResult(suite="missing", status="not available", error="no module benchmarks.missing")
    png = tmp_path / "results" / "fake_time_vs_size.png"
    page = report.render_results([ok, failed, absent], machine=MACHINE, command="python -m benchmarks --quick",
                                 charts={("fake", "time_vs_size"): png}, page_dir=tmp_path)
    lines = page.splitlines()
    assert lines[0] == "# twisternet benchmark results"
    assert "python -m benchmarks --quick" in page
    assert "- CPU: Test CPU 9000 (2 logical, 1 physical)" in page
    assert "- RAM: 7.5 GB" in page and "ray (not installed)" in page and "numpy 1.0" in page
    # the headings, in order
    heads = [l for l in lines if l.startswith("## ")]
    assert heads == ["## Machine", "## Summary", "## fake", "## broken", "## missing"]
    summary, fake_table = table_blocks(page)[:2]
    assert summary[0] == ["suite", "status", "targets met", "targets missed", "peers skipped", "seconds"]
    assert summary[1][:5] == ["fake", "ok", "1", "1", "1"]
    assert summary[2][:2] == ["broken", "failed"] and summary[3][:2] == ["missing", "not available"]
    assert fake_table == [["size", "ours ms", "peer ms", "ratio"], ["1 KB", "0.500", "0.250", "2.00"],
                          ["64 MB", "120", "n/a", "n/a"]]
    # targets stated plainly, missed ones also listed up front
    assert "- **MISSED**: fast at 1 KB: wanted ratio <= 1.00; measured 2.00x" in page
    assert "- **MET**: fast at 64 KB" in page and "- **NOT MEASURED**: fast at 64 MB" in page
    assert "**Targets missed in this run:**" in page
    assert page.index("Targets missed in this run") < page.index("## fake")
    assert "- ray gloo: ray is not installed (pip install ray)" in page
    assert "![time vs size](results/fake_time_vs_size.png)" in page
    assert "**FAILED**" in page and "RuntimeError: boom" in page
    assert "Not available: no module benchmarks.missing" in page


def test_results_page_all_targets_met():
    r = fabricated()
    r.targets = [Target("t", "w", "m", True)]
    page = report.render_results([r], machine=MACHINE, command="x")
    assert "Every measured target was met" in page and "MISSED" not in page


def test_json_round_trip():
    r = fabricated()
    doc = json.loads(json.dumps(r.to_json()))
    assert doc["raw"]["samples"] == {"1024": [0.5, 0.6]}      # keys made JSON strings
    back = report.suite_from_json(doc)
    assert back.tables == r.tables and back.targets == r.targets and back.skipped == r.skipped
    assert back.charts[0].series == r.charts[0].series


def test_write_charts_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = report.write_charts([fabricated()], tmp_path)
    assert list(out) == [("fake", "time_vs_size")]
    assert out[("fake", "time_vs_size")].read_bytes()[:4] == b"\x89PNG"


def test_machine_info_is_read():
    m = report.machine_info()
    assert m["logical_cores"] >= 1 and m["cpu"] and m["python"].split()[-1] == ".".join(
        map(str, sys.version_info[:3]))
    assert m["packages"]["numpy"] == __import__("numpy").__version__


# ---------------------------------------------------------------------------------- options

@given(st.integers(0, 10**6), st.sampled_from([("", 1), ("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30)]))
def test_parse_size(n, unit):
    suffix, mult = unit
    assert parse_size(f"{n}{suffix}") == n * mult
    assert parse_size(f"{n}{suffix.lower()}") == n * mult


def test_parse_size_rejects_garbage():
    for bad in ("", "K", "1.5M", "-3", "12X"):
        with pytest.raises(ValueError, match="not a size"):
            parse_size(bad)


def test_options_get_converts_to_the_default_type():
    o = SuiteOptions(extra={"sizes": "1K,64K", "n": "8", "median": "0.5", "ray": "0", "name": "x"})
    assert o.get("sizes", [1]) == [1024, 65536]
    assert o.get("n", 4) == 8 and o.get("median", 0.1) == 0.5 and o.get("ray", True) is False
    assert o.get("name", "y") == "x" and o.get("absent", 7) == 7
    with pytest.raises(ValueError, match="--set n=abc"):
        SuiteOptions(extra={"n": "abc"}).get("n", 4)


def test_repeats():
    assert SuiteOptions(quick=True, repeat=3).repeats() == 1
    assert SuiteOptions(quick=True, repeat=3, repeat_given=True).repeats() == 3
    assert SuiteOptions(repeat=5).repeats() == 5


def test_ratio():
    assert ratio(1.0, 2.0) == 0.5 and ratio(None, 1.0) is None and ratio(1.0, None) is None
    assert ratio(1.0, 0.0) is None


def test_progress_counts_runs():
    s = io.StringIO()
    p = Progress("x", stream=s)
    p.set_total(2)
    p.step("a")
    p.step("b")
    p.finish()
    lines = s.getvalue().splitlines()
    assert [ln.split("] ")[2].split()[0] for ln in lines] == ["0/2", "1/2", "2/2"]


# ---------------------------------------------------------------------------------- entry point

def fake_module(name: str, run) -> types.ModuleType:
    m = types.ModuleType(f"benchmarks.{name}")
    m.NAME, m.DESCRIPTION, m.run = name, f"the {name} suite", run
    return m


@pytest.fixture
def fake_suites(monkeypatch):
    calls: list[tuple[str, SuiteOptions]] = []

    def good(opts):
        calls.append(("good", opts))
        bar = opts.bar("good")
        bar.set_total(1)
        bar.step("only run")
        r = fabricated()
        r.suite = "good"
        return r

    def bad(opts):
        calls.append(("bad", opts))
        raise RuntimeError("suite exploded")

    def after(opts):
        calls.append(("after", opts))
        opts.extra.get("direct")            # a suite may read its overrides straight from extra
        return SuiteResult(suite="after", tables=[Table("t", ["a"], [[1]])])

    mods = {"good": fake_module("good", good), "bad": fake_module("bad", bad), "after": fake_module("after", after)}

    def load(name):
        if name not in mods:
            raise entry.SuiteUnavailable(f"no module benchmarks.{name}")
        return mods[name]
    monkeypatch.setattr(entry, "SUITE_MODULES", ["good", "bad", "missing", "after"])
    monkeypatch.setattr(entry, "load_suite", load)
    monkeypatch.setattr(report, "machine_info", lambda: MACHINE)
    return calls


def test_failing_suite_sets_exit_code_and_others_still_run(fake_suites, tmp_path, capsys):
    rc = entry.main(["--json", str(tmp_path / "r.json"), "--results", str(tmp_path / "RESULTS.md"),
                     "--set", "k=v", "--set", "after.only=1", "--repeat", "2", "--workers", "2,4"])
    assert rc == 1
    assert [c[0] for c in fake_suites] == ["good", "bad", "after"]
    opts = dict(fake_suites)
    assert opts["good"].extra["k"] == "v" and "only" not in opts["good"].extra
    assert opts["after"].extra["only"] == "1" and opts["after"].repeat == 2 and opts["after"].workers == [2, 4]
    out = capsys.readouterr()
    assert "FAILED suites: bad" in out.out and "RuntimeError: suite exploded" in out.out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [(s["suite"], s["status"]) for s in doc["suites"]] == [
        ("good", "ok"), ("bad", "failed"), ("missing", "not available"), ("after", "ok")]
    assert "suite exploded" in doc["suites"][1]["error"]
    assert doc["machine"] == MACHINE
    page = (tmp_path / "RESULTS.md").read_text()
    assert "## bad" in page and "suite exploded" in page and "**MISSED**" in page


def test_missing_suite_alone_is_not_a_failure_unless_asked_for(fake_suites, tmp_path):
    assert entry.main(["--suite", "good", "--json", "-"]) == 0
    assert entry.main(["--suite", "missing", "--json", "-"]) == 1


def test_unknown_suite_is_a_usage_error(fake_suites, capsys):
    with pytest.raises(SystemExit) as e:
        entry.main(["--suite", "nosuch"])
    assert e.value.code == 2 and "unknown suite(s): nosuch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        entry.main(["--set", "novalue"])


def test_plot_without_matplotlib_continues(fake_suites, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "have_matplotlib", lambda: False)
    rc = entry.main(["--suite", "good", "--plot", str(tmp_path / "png"), "--json", "-",
                     "--results", str(tmp_path / "RESULTS.md")])
    assert rc == 0
    assert "need matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "png").exists()
    assert "matplotlib is not installed" in (tmp_path / "RESULTS.md").read_text()


def test_absent_peers_are_skipped_with_a_reason(monkeypatch):
    monkeypatch.setattr(allreduce, "installed", lambda m: m not in ("ray", "torch"))
    assert "ray is not installed" in allreduce._ray_reason(SuiteOptions())
    monkeypatch.setattr(allreduce, "installed", lambda m: m != "torch")
    assert "torch is not installed" in allreduce._ray_reason(SuiteOptions())
    monkeypatch.setattr(allreduce, "installed", lambda m: True)
    assert "quick" in allreduce._ray_reason(SuiteOptions(quick=True))
    assert allreduce._ray_reason(SuiteOptions(quick=True, extra={"ray": "1"})) is None


@pytest.mark.timeout(120)
def test_allreduce_without_torch_and_ray_reports_them_skipped(monkeypatch):
    """A real (tiny) allreduce suite run with torch and ray hidden: skipped with reasons, no failure."""
    monkeypatch.setattr(allreduce, "installed", lambda m: m not in ("ray", "torch"))
    res = allreduce.run(SuiteOptions(quick=True, workers=[2], progress=Progress("t", stream=io.StringIO()),
                                     extra={"sizes": "1K"}))
    assert res.status == "ok"
    assert any(s.startswith("torch gloo: torch is not installed") for s in res.skipped)
    assert any(s.startswith("ray gloo: ray is not installed") for s in res.skipped)
    heads = res.tables[0].headers
    assert "torch gloo" not in heads and "tn run" in heads and "tn ring UDS" in heads
    assert res.raw["median_s"][2]["twisternet-tcp"][1024] > 0
    assert res.raw["median_s"][2]["twisternet-tcp-ring"][1024] > 0
    assert "(here: shm)" in res.tables[0].note    # what via="auto" chose is reported


@pytest.mark.timeout(60)
def test_list_via_module_and_cli():
    for cmd in ([sys.executable, "-m", "benchmarks", "--list"],
                [sys.executable, "-m", "twisternet", "bench", "--list"]):
        p = subprocess.run(cmd, env=job_env(), capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert p.returncode == 0, p.stderr[-2000:]
        names = [line.split()[0] for line in p.stdout.splitlines() if line.strip()]
        assert names == entry.SUITE_MODULES
        assert "point-to-point" in p.stdout and "not available" not in p.stdout.splitlines()[0]


def test_render_from_saved_json_reproduces_the_page(fake_suites, tmp_path):
    first, second = tmp_path / "a" / "RESULTS.md", tmp_path / "b" / "RESULTS.md"
    assert entry.main(["--suite", "good", "--json", str(tmp_path / "r.json"), "--results", str(first)]) == 0
    n_calls = len(fake_suites)
    assert entry.main(["--render", str(tmp_path / "r.json"), "--results", str(second)]) == 0
    assert len(fake_suites) == n_calls                     # nothing was run again
    assert second.read_text() == first.read_text()
    with pytest.raises(SystemExit):
        entry.main(["--render", str(tmp_path / "nosuch.json")])


def test_unused_suite_setting_is_flagged(fake_suites, tmp_path, capsys):
    assert entry.main(["--suite", "after", "--set", "after.sizez=1K", "--set", "after.direct=1",
                       "--json", str(tmp_path / "r.json")]) == 0
    err = capsys.readouterr().err
    assert "--set after.sizez not used by this suite" in err and "after.direct" not in err
    doc = json.loads((tmp_path / "r.json").read_text())
    assert any("sizez" in n for n in doc["suites"][0]["notes"])
