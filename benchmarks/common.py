"""Shared helpers of the benchmark scripts: launching jobs, medians, tables."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from benchmarks.harness import Target

ROOT = Path(__file__).resolve().parent.parent


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a benchmark job: ours without TWISTERNET_* settings, the repository importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWISTERNET_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def run_tagged(cmd: Sequence[str], tag: str, *, timeout: float = 900, **env: str) -> dict[str, Any]:
    """Run ``cmd``; return the JSON printed after ``tag`` on one of its output lines."""
    p = subprocess.run(list(cmd), env=job_env(**env), capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    for line in p.stdout.splitlines():
        body = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
        if body.startswith(tag + " "):
            return json.loads(body[len(tag) + 1:])
    raise RuntimeError(f"{' '.join(cmd)} printed no {tag} line (exit {p.returncode}):\n"
                       f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def twisternet_run(n: int, script: str, *args: str) -> list[str]:
    """The command line launching ``script`` (relative to the repository) as an ``n``-worker local job."""
    return [sys.executable, "-m", "twisternet", "run", "-n", str(n), str(ROOT / script), *args]


def mpiexec_run(n: int, script: str, *args: str) -> list[str] | None:
    """The mpiexec command line for ``script`` with ``n`` ranks, or None without the mpich wheel's mpiexec."""
    exe = Path(sys.executable).parent / "mpiexec"
    if not exe.exists():
        return None
    return [str(exe), "-n", str(n), sys.executable, str(ROOT / script), *args]


def median(xs: Sequence[float]) -> float:
    """The median of ``xs`` (raises StatisticsError when empty)."""
    return statistics.median(xs)


def fmt_size(n: int) -> str:
    """``65536`` -> ``"64 KB"``: byte counts as table labels (exact binary units only)."""
    for unit, k in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table of pre-formatted cells (the suites use :mod:`benchmarks.report` instead)."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def spark_missing() -> str | None:
    """Why the PySpark peer cannot run here (None: it can)."""
    import importlib.util
    if importlib.util.find_spec("pyspark") is None:
        return "pyspark is not installed (pip install pyspark; needs Java 17)"
    try:
        java = subprocess.run(["java", "-version"], capture_output=True).returncode
    except OSError:
        java = 1
    if java != 0:
        return "no java on PATH (PySpark needs Java 17)"
    return None


def dask_missing() -> str | None:
    """Why the Dask peer cannot run here (None: it can)."""
    import importlib.util
    if importlib.util.find_spec("dask") is None or importlib.util.find_spec("distributed") is None:
        return "dask is not installed (pip install 'dask[dataframe,distributed]')"
    return None


def choose_peers(opts: Any, suite: str, skipped: list[str]) -> list[str]:
    """The heavy peers (PySpark, Dask) a suite runs: on by default in full runs, off in quick runs,
    ``--set SUITE.spark=0|1`` / ``SUITE.dask=0|1`` decide; every one left out goes to ``skipped`` with why."""
    active = []
    for name, flag, missing in (("PySpark", "spark", spark_missing), ("Dask", "dask", dask_missing)):
        on = int(opts.get(flag, 0 if opts.quick else 1))
        off = ("left out of quick runs (startup takes seconds)" if opts.quick and flag not in opts.extra
               else "left out on request")
        why = missing() if on else f"{off}; --set {suite}.{flag}=1 includes it"
        if why:
            skipped.append(f"{name}: {why}")
        else:
            active.append(name)
    return active


#: Seconds a heavy peer (PySpark, Dask) may take before it is reported as failed instead of waited for.
PEER_TIMEOUT = 1800.0


def peer_env(**extra: str) -> dict[str, str]:
    """The environment of a peer process whose workers import ``benchmarks/`` and ``examples/`` modules."""
    env = job_env(**extra)
    env["PYTHONPATH"] = f"{ROOT / 'benchmarks'}:{ROOT / 'examples'}:{env['PYTHONPATH']}"
    return env


def run_peer(cmd: Sequence[str], tag: str, who: str, env: dict[str, str]) -> dict[str, Any]:
    """Run a peer's command (at most PEER_TIMEOUT s) and return the JSON it printed after ``tag``; a run
    that printed none raises RuntimeError with the end of its output."""
    p = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=PEER_TIMEOUT)
    for line in p.stdout.splitlines():
        if line.startswith(tag + " "):
            return json.loads(line[len(tag) + 1:])
    raise RuntimeError(f"{who} run failed (exit {p.returncode}):\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}")


def failure_reason(e: BaseException) -> str:
    """A one-line account of a peer run that produced no result (for ``SuiteResult.skipped``)."""
    if isinstance(e, subprocess.TimeoutExpired):
        return f"no result within {e.timeout:.0f} s"
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    return text[:300]


def try_peer(name: str, run: Any, failed: set[str], skipped: list[str], where: str,
             wrong: type[BaseException] | tuple = ()) -> Any:
    """``run()`` of heavy peer ``name`` unless it failed before (None then). A crash or a timeout puts it
    in ``failed`` and ``skipped`` (with ``where`` and why) and returns None; an exception of a ``wrong``
    type (a wrong answer) is raised on."""
    if name in failed:
        return None
    try:
        return run()
    except wrong:
        raise
    except (RuntimeError, subprocess.TimeoutExpired) as e:   # it crashed or ran out of time
        failed.add(name)
        skipped.append(f"{name}: failed at {where}, not run again: {failure_reason(e)}")
        return None


def versus_spark(what: str, t: float, spark_t: float | None, spark_failed: bool) -> Target | None:
    """The ">= 3x faster than PySpark local mode" target of a suite that took ``t`` s (None: PySpark
    was not run)."""
    if spark_t is not None:
        return Target(f"{what}: twisternet vs PySpark local mode", ">= 3x faster",
                      f"{spark_t / t:.2f}x ({t:.2f} s vs {spark_t:.2f} s)", spark_t / t >= 3)
    if spark_failed:
        return Target(f"{what}: twisternet vs PySpark local mode", ">= 3x faster",
                      "not measured: the PySpark run failed (see skipped peers)", None)
    return None
