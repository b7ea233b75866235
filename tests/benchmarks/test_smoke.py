"""A tiny run of every benchmark suite, so the scripts keep working (figures are not checked here:
performance belongs to the benchmarks themselves, not to tests on a shared machine)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import job_env

ROOT = Path(__file__).resolve().parent.parent.parent


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], env=job_env(),
                          capture_output=True, text=True, timeout=280, cwd=ROOT)


@pytest.mark.timeout(300)
def test_p2p_quick():
    p = run("p2p.py", "--quick")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "One-way bandwidth" in p.stdout and "| 4 MB " in p.stdout and "raw UDS" in p.stdout


@pytest.mark.timeout(300)
def test_allreduce_quick():
    p = run("allreduce.py", "--quick")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "allreduce, 2 workers" in p.stdout and "| 1 MB " in p.stdout
    assert "failed" not in p.stderr, p.stderr[-2000:]


@pytest.mark.timeout(300)
def test_wordcount_quick():
    p = run("wordcount.py", "--quick")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "twisternet KeyedReduce, 2 workers" in p.stdout and "speedup vs Counter" in p.stdout


@pytest.mark.timeout(300)
def test_stragglers_quick():
    p = run("stragglers.py", "--quick")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "classic barrier" in p.stdout and "partial barrier (knee) + re-execution" in p.stdout
