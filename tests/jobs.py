"""Helpers for tests that start real multi-process jobs (launcher or mpiexec), always with a timeout."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

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


def run_mpi(n: int, script: str | Path, *args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    exe = mpiexec()
    if exe is None:
        raise RuntimeError("no mpiexec: install the mpi extra (pip install .[mpi])")
    cmd = [exe, "-n", str(n), sys.executable, str(script), *args]
    return subprocess.run(cmd, env=job_env(**env), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def lines(proc: subprocess.CompletedProcess, prefix: str) -> list[str]:
    """Output lines (rank prefix removed) that start with ``prefix``."""
    out = []
    for line in proc.stdout.splitlines():
        body = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
        if body.startswith(prefix):
            # mpiexec may glue two ranks' lines together: "A rank=0 ...A rank=1 ..."
            out.extend(prefix + part for part in body.split(prefix)[1:])
    return out


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
