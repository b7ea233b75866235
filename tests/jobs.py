"""Helpers for tests that start real multi-process jobs (launcher or mpiexec), always with a timeout.

The fixtures in tests/conftest.py (``mpiexec``, ``run_job``, ``emulated_cluster``) are built on these.
Every job gets the repository first on PYTHONPATH and no TWISTERNET_* settings from the test's own
environment, so job scripts import this checkout without touching ``sys.path``."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import NoReturn

import pytest

ROOT = Path(__file__).resolve().parent.parent


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWISTERNET_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_tcp(n: int, script: str | Path, *args: str, timeout: float = 120, grace: float = 10,
            **env: str) -> subprocess.CompletedProcess:
    """``twisternet run -n N script args`` with TWISTERNET_* settings from ``env``."""
    cmd = [sys.executable, "-m", "twisternet", "run", "-n", str(n), "--grace", str(grace), str(script), *args]
    return subprocess.run(cmd, env=job_env(**env), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def mpiexec() -> str | None:
    """The mpiexec next to this interpreter (the mpich wheel's), else one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else shutil.which("mpiexec")


def skip_because(why: str) -> NoReturn:
    """Skip the test, printing why (the CI rule: a test skips only where the machine cannot run it)."""
    print(f"skipping: {why}")
    pytest.skip(why)


def require_mpiexec() -> str:
    """The mpiexec to run MPI jobs with. Skips (printing why) when the mpi extra is not installed
    (no mpi4py); fails when mpi4py is there but no mpiexec is: the mpi extra brings both (mpi4py and
    the mpich wheel), so that is a broken install, not a machine that cannot run MPI."""
    if importlib.util.find_spec("mpi4py") is None:
        skip_because("MPI is not installed here: no mpi4py (pip install '.[mpi]' brings mpi4py and mpich)")
    exe = mpiexec()
    if exe is None:
        pytest.fail(f"mpi4py is installed but there is no mpiexec next to {sys.executable} or on PATH: "
                    "a broken install of the mpi extra (pip install '.[mpi]' brings the mpich wheel's)")
    return exe


def require_emulated_cluster() -> None:
    """Skip (printing why) unless emulated hosts can be built here: root, ``ip``/``tc``/``unshare``/
    ``nsenter``, and network namespaces allowed (see :func:`twisternet.testbed.unavailable`)."""
    from twisternet.testbed import unavailable

    why = unavailable()
    if why:
        skip_because(f"no emulated cluster here: {why}")


def run_mpi(n: int, script: str | Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    """``mpiexec -n N python script args`` with TWISTERNET_* settings from ``env`` (skips or fails as
    :func:`require_mpiexec` says when MPI is missing)."""
    cmd = [require_mpiexec(), "-n", str(n), sys.executable, str(script), *args]
    return subprocess.run(cmd, env=job_env(**env), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def run_killable(cmd: list[str], timeout: float, env: dict[str, str] | None = None,
                 what: str = "the job") -> tuple[int, str, str, float]:
    """Run ``cmd`` in its own session; returns (exit code, stdout, stderr, seconds). On timeout the whole
    process group is killed (no rank outlives the test) and the test fails with the output so far."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=job_env() if env is None else env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what} still running after {timeout}s\nstdout:\n{out}\nstderr:\n{err[-4000:]}")
    return proc.returncode, out, err, time.monotonic() - start


def lines(proc: subprocess.CompletedProcess, prefix: str) -> list[str]:
    """Output lines (rank prefix removed) that start with ``prefix``."""
    out = []
    for line in proc.stdout.splitlines():
        body = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
        if body.startswith(prefix):
            # mpiexec may glue two ranks' lines together: "A rank=0 ...A rank=1 ..."
            out.extend(prefix + part for part in body.split(prefix)[1:])
    return out


def json_objects(text: str, mark: str) -> list[dict]:
    """The JSON objects starting with ``mark`` in ``text`` (mpiexec may glue the ranks' lines together)."""
    found, dec, pos = [], json.JSONDecoder(), text.find(mark)
    while pos >= 0:
        try:
            obj, end = dec.raw_decode(text, pos)
            found.append(obj)
        except json.JSONDecodeError:
            end = pos + 1
        pos = text.find(mark, end)
    return found


def assert_survivors_saw_the_kill(proc: subprocess.CompletedProcess, victim: int, survivors: int,
                                  within: float) -> None:
    """Every survivor printed ``PEERLOST rank=R lost=V after=S`` naming ``victim`` within ``within``
    seconds, and the launcher reported the victim's SIGKILL."""
    lost = lines(proc, "PEERLOST")
    assert len(lost) == survivors, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in lost:
        assert f"lost={victim}" in line
        assert float(re.search(r"after=([\d.]+)", line).group(1)) < within, line
    assert f"rank {victim} was killed by SIGKILL" in proc.stderr
