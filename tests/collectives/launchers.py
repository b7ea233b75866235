"""Run a scenario of :mod:`tests.collectives.scenarios` in real processes (TCP launcher or mpiexec)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.jobs import job_env, json_objects, require_mpiexec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCENARIOS = os.path.join(ROOT, "tests", "collectives", "scenarios.py")
MARK = '{"rank": '


def command(launcher: str, world: int, argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` on ``world`` processes; for "mpi" it skips (printing why)
    when MPI is not installed (see :func:`tests.jobs.require_mpiexec`)."""
    if launcher == "tcp":
        return [sys.executable, "-m", "twisternet", "run", "-n", str(world), "--env", f"PYTHONPATH={ROOT}", *argv]
    if launcher == "mpi":
        return [require_mpiexec(), "-n", str(world), "-genv", "PYTHONPATH", ROOT, sys.executable, *argv]
    raise ValueError(launcher)


def run_script(launcher: str, world: int, script: str, args: list[str], timeout: float = 120) -> str:
    """Run ``script args`` on ``world`` processes; returns stdout (raises on failure, with stderr)."""
    p = subprocess.run(command(launcher, world, [script, *args]), capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=job_env())
    if p.returncode != 0:
        raise AssertionError(f"{launcher} run of {script} failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                             f"{p.stderr[-3000:]}")
    return p.stdout


def run_scenario(launcher: str, world: int, name: str, params: dict, timeout: float = 120) -> list:
    """Results of scenario ``name`` by rank."""
    out = run_script(launcher, world, SCENARIOS, [name, json.dumps(params)], timeout)
    results = {obj["rank"]: obj["result"] for obj in json_objects(out, MARK)    # lines may interleave (mpiexec)
               if isinstance(obj, dict) and "result" in obj}
    assert sorted(results) == list(range(world)), f"missing ranks in output:\n{out[-2000:]}"
    return [results[r] for r in range(world)]
