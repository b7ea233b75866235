"""Real jobs joined under torchrun-, Slurm- and token-directory-style environments (processes started
by the test with the variables those launchers set; nothing else is needed on the machine)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import ROOT, job_env

SCRIPT = ROOT / "tests" / "twisternet" / "scripts" / "launcher_env_job.py"
TOKEN = "9c4e1f7a2b8d5e3f60a1c9b7d4e2f8a3b5c7d9e1f2a4b6c8d0e2f4a6b8c0d2e4"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clean_env(**extra: str) -> dict[str, str]:
    launcher_vars = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                     "PMI_RANK", "PMI_SIZE", "PMI_FD", "JOB_COMPLETION_INDEX")
    env = {k: v for k, v in job_env().items() if k not in launcher_vars and not k.startswith("SLURM_")}
    env.update(extra)
    return env


def _start(envs: list[dict[str, str]]) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen([sys.executable, str(SCRIPT)], env=e, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for e in envs]
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def _assert_sum(results: list[subprocess.CompletedProcess], world: int) -> None:
    want = world * (world + 1) // 2
    for r, res in enumerate(results):
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"RESULT rank={r} world={world} total={want}" in res.stdout, res.stdout + res.stderr[-2000:]


def test_torchrun_variables_make_one_job():
    world, port = 3, _free_port()
    envs = [_clean_env(RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1), TWISTERNET_TOKEN=TOKEN)
            for r in range(world)]
    _assert_sum(_start(envs), world)


def test_slurm_step_variables_make_one_job():
    world, port = 3, _free_port()
    envs = [_clean_env(SLURM_PROCID=str(r), SLURM_STEP_NUM_TASKS=str(world), SLURM_NTASKS=str(world),
                       SLURM_LOCALID=str(r), SLURM_NODEID="0", SLURM_STEP_ID="0", SLURM_JOB_ID="77",
                       SLURM_STEP_NODELIST="localhost", TWISTERNET_MASTER_PORT=str(port),
                       TWISTERNET_TOKEN=TOKEN)
            for r in range(world)]
    _assert_sum(_start(envs), world)


def test_token_directory(tmp_path: Path):
    world, port = 2, _free_port()
    envs = [_clean_env(RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1),
                       TORCHELASTIC_RUN_ID="run42", TWISTERNET_TOKEN_DIR=str(tmp_path)) for r in range(world)]
    _assert_sum(_start(envs), world)
    assert not list(tmp_path.iterdir()), "rank 0 removes the token file it wrote when the job ends"


def test_missing_token_says_how_to_give_one():
    port = _free_port()
    envs = [_clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1))
            for r in range(2)]
    for res in _start(envs):
        assert res.returncode != 0
        assert "no job token" in res.stderr and "TWISTERNET_TOKEN" in res.stderr, res.stderr[-2000:]


def test_world_token_file_is_refused(tmp_path: Path):
    f = tmp_path / "token"
    f.write_text(TOKEN)
    os.chmod(f, 0o644)
    port = _free_port()
    envs = [_clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port - 1),
                       TWISTERNET_TOKEN_FILE=str(f)) for r in range(2)]
    for res in _start(envs):
        assert res.returncode != 0 and "chmod 600" in res.stderr, res.stderr[-2000:]


def test_announced_world_that_resolves_to_one_is_an_error():
    env = _clean_env(WORLD_SIZE="4", TWISTERNET_CHANNEL="local")
    res = _start([env])[0]
    assert res.returncode != 0
    assert "WORLD_SIZE" in res.stderr and "started 4 processes" in res.stderr, res.stderr[-2000:]


def test_torchrun_itself_starts_one_job():
    """The README's torchrun recipe, on one node: torchrun sets the variables, twisternet joins."""
    pytest.importorskip("torch", reason="torch is in the dev extra (pip install '.[dev]')")
    port = _free_port()
    env = _clean_env(TWISTERNET_TOKEN=TOKEN, TWISTERNET_MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(port), str(SCRIPT)],
                         env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    for r in range(2):
        assert f"RESULT rank={r} world=2 total=3" in res.stdout, res.stdout + res.stderr[-2000:]
