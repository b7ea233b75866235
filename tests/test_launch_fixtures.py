"""The launch helpers behind the fixtures of tests/conftest.py (tests/jobs.py): they skip, printing why,
only where the machine cannot run the job, fail on a broken install, and leave no process behind."""

from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

import tests.jobs as jobs


def test_require_mpiexec_skips_and_says_why_without_mpi4py(monkeypatch, capsys) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mpi4py" else real(name, *a))
    with pytest.raises(pytest.skip.Exception, match="no mpi4py"):
        jobs.require_mpiexec()
    assert "skipping: MPI is not installed here" in capsys.readouterr().out


def test_require_mpiexec_fails_on_mpi4py_without_mpiexec(monkeypatch) -> None:
    """The mpi extra brings both: mpi4py without mpiexec is a broken install, which must not pass as a skip."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(jobs, "mpiexec", lambda: None)
    with pytest.raises(pytest.fail.Exception, match="broken install"):
        jobs.require_mpiexec()


def test_mpiexec_fixture_is_the_mpich_wheels(mpiexec: str) -> None:
    assert os.access(mpiexec, os.X_OK) and os.path.basename(mpiexec) == "mpiexec"


def test_require_emulated_cluster_skips_with_the_reason(monkeypatch, capsys) -> None:
    import twisternet.testbed as testbed

    monkeypatch.setattr(testbed, "unavailable", lambda: "network namespaces need root")
    with pytest.raises(pytest.skip.Exception, match="need root"):
        jobs.require_emulated_cluster()
    assert "skipping: no emulated cluster here: network namespaces need root" in capsys.readouterr().out


def test_run_job_refuses_an_unknown_launcher(run_job) -> None:
    with pytest.raises(ValueError, match="unknown launcher 'ssh'; known: tcp, mpi"):
        run_job("ssh", 2, "whatever.py")


def test_run_job_gives_the_job_the_repository_and_no_twisternet_settings(run_job, tmp_path, monkeypatch) -> None:
    """A job script imports this checkout without sys.path lines, and the test's own TWISTERNET_* settings
    do not leak into it (only the ones passed to run_job)."""
    monkeypatch.setenv("TWISTERNET_TIMEOUT", "7")
    script = tmp_path / "where.py"
    script.write_text("import os, tests.jobs, twisternet as tn\n"
                      "with tn.init() as ctx:\n"
                      "    print('WHERE', ctx.rank, tests.jobs.ROOT, os.environ.get('TWISTERNET_TIMEOUT'),"
                      " os.environ.get('TWISTERNET_PEER_TIMEOUT'), flush=True)\n")
    p = run_job("tcp", 2, script, timeout=120, TWISTERNET_PEER_TIMEOUT="30")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    got = sorted(jobs.lines(p, "WHERE"))
    assert got == [f"WHERE {r} {jobs.ROOT} None 30" for r in range(2)], p.stdout


def test_run_killable_kills_the_whole_process_group_on_timeout(tmp_path) -> None:
    pids = tmp_path / "pids"
    cmd = [sys.executable, "-c",
           "import subprocess, sys, time\n"
           f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
           f"open({str(pids)!r}, 'w').write(str(child.pid))\n"
           "time.sleep(300)\n"]
    with pytest.raises(pytest.fail.Exception, match="the sleeper still running after 3"):
        jobs.run_killable(cmd, 3, what="the sleeper")
    child = int(pids.read_text())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if _is_zombie(child):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the job's child {child} outlived run_killable's timeout")


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
