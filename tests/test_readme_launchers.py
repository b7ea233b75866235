"""The README's launcher recipes, run as shown where this machine can: the sbatch script under a
stand-in for Slurm (an `srun` that starts the tasks with the variables Slurm gives them), and the torchrun
line on one node."""

from __future__ import annotations

import os
import re
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.jobs import ROOT, job_env

README = (ROOT / "README.md").read_text()
JOB = ROOT / "tests" / "twisternet" / "scripts" / "launcher_env_job.py"

FAKE_SRUN = textwrap.dedent('''\
    #!{python}
    """Stand-in for Slurm's srun: one task per slot of the allocation, with the variables srun sets."""
    import os, subprocess, sys
    n = int(os.environ["SLURM_NTASKS"])
    per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
    procs = []
    for r in range(n):
        env = dict(os.environ, SLURM_PROCID=str(r), SLURM_LOCALID=str(r % per_node),
                   SLURM_NODEID=str(r // per_node), SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(n),
                   SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
                   SLURM_STEP_TASKS_PER_NODE=os.environ["SLURM_TASKS_PER_NODE"])
        procs.append(subprocess.Popen(sys.argv[1:], env=env))
    sys.exit(max(p.wait() for p in procs))
''')


def _block(lang: str, must_contain: str) -> str:
    for m in re.finditer(rf"```{lang}\n(.*?)```", README, re.S):
        if must_contain in m.group(1):
            return m.group(1)
    raise AssertionError(f"README has no {lang} block containing {must_contain!r}")


def _slurm_port_job_id() -> tuple[int, int]:
    """A job id whose derived bootstrap port (20000 + id % 20000) is free now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if 20000 <= port < 40000:
            return port, 100000 + (port - 20000)
    pytest.fail("no free port in 20000-39999")


def test_sbatch_recipe_runs_as_shown(tmp_path: Path):
    script = _block("sh", "#SBATCH")
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", script).group(1))
    per_node = int(re.search(r"#SBATCH --ntasks-per-node=(\d+)", script).group(1))
    n = nodes * per_node
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(srun.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "job.py").write_text(JOB.read_text())
    (tmp_path / "sbatch.sh").write_text(script)
    _, job_id = _slurm_port_job_id()
    env = job_env(PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                  HOME=str(tmp_path), SLURM_JOB_ID=str(job_id), SLURM_NTASKS=str(n),
                  SLURM_NTASKS_PER_NODE=str(per_node), SLURM_TASKS_PER_NODE=f"{per_node}(x{nodes})",
                  SLURM_JOB_NODELIST="localhost", SLURM_PROCID="0", SLURM_STEP_ID="4294967294",
                  OMP_NUM_THREADS="1")
    res = subprocess.run(["bash", "sbatch.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    want = n * (n + 1) // 2
    for r in range(n):
        assert f"RESULT rank={r} world={n} total={want}" in res.stdout, res.stdout + res.stderr[-2000:]
    assert not list((tmp_path / ".twisternet").iterdir()), "rank 0 removes the token it wrote"


def test_python_in_the_batch_script_itself_is_refused(tmp_path: Path):
    """The mistake the sbatch recipe warns about: `python job.py` without srun."""
    env = job_env(SLURM_JOB_ID="5", SLURM_NTASKS="8", SLURM_JOB_NODELIST="localhost", SLURM_PROCID="0",
                  TWISTERNET_TOKEN_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, str(JOB)], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "srun python job.py" in res.stderr, res.stderr[-2000:]


def test_torchrun_recipe_on_one_node(tmp_path: Path):
    """The torchrun line with --nnodes 1 and this host as the rendezvous endpoint (one machine here)."""
    pytest.importorskip("torch", reason="torch is in the dev extra (pip install '.[dev]')")
    recipe = _block("sh", "torchrun")
    line = next(x for x in recipe.splitlines() if x.startswith("torchrun "))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    line = re.sub(r"--nnodes \d+", "--nnodes 1", line)
    line = re.sub(r"--nproc-per-node \d+", "--nproc-per-node 2", line)
    line = re.sub(r"--rdzv-endpoint \S+", f"--rdzv-endpoint 127.0.0.1:{port}", line)
    (tmp_path / "job.py").write_text(JOB.read_text())
    setup = recipe.splitlines()[0].replace("/shared/twisternet", str(tmp_path / "tokens"))
    # rank 0 picks a free port and publishes it in torchrun's agent store: no port to choose here
    env = job_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", OMP_NUM_THREADS="1")
    env.pop("TWISTERNET_MASTER_PORT", None)
    res = subprocess.run(["bash", "-c", f"{setup}\n{line}"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    for r in range(2):
        assert f"RESULT rank={r} world=2 total=3" in res.stdout, res.stdout + res.stderr[-2000:]
