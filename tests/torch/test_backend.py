"""The "twisternet" torch.distributed backend in real jobs: every collective, errors on every rank, DDP =
gloo. All slow (each job imports torch in every rank: tens of seconds on a busy machine); the fast
in-process checks are in test_inprocess.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'twisternet[torch]')")

from tests.jobs import ROOT, job_env, lines, run_mpi, run_tcp

SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")
EXAMPLE = os.path.join(ROOT, "examples", "ddp_train.py")


def _ops_ok(proc: subprocess.CompletedProcess, world: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert not lines(proc, "BAD"), out[-4000:]
    oks = lines(proc, "OK")
    assert len(oks) == 19 * world, out[-4000:]
    assert len(lines(proc, "DONE")) == world
    meta = lines(proc, "ERR meta")
    assert len(meta) == world, out[-4000:]
    assert all("meta" in m and "rank 1" in m for m in meta), (meta, out[-4000:])   # named on every rank
    shape = lines(proc, "ERR shape")
    assert len(shape) == world and all("MismatchError" in s for s in shape), (shape, out[-4000:])
    op = lines(proc, "ERR op")
    assert len(op) == world and all("BAND" in s or "BAND" in s.upper() for s in op), (op, out[-4000:])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_collective_over_twisternet_run() -> None:
    proc = run_tcp(3, os.path.join(SCRIPTS, "pg_ops.py"), timeout=280)
    _ops_ok(proc, 3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_collective_under_torchrun() -> None:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc-per-node", "2", "--master-port", str(port), os.path.join(SCRIPTS, "pg_ops.py"), "tree"]
    proc = subprocess.run(cmd, env=job_env(TWISTERNET_MASTER_PORT=str(_free_port())), capture_output=True,
                          text=True, timeout=280, cwd=ROOT)
    _ops_ok(proc, 2)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp(tmp, backend: str, world: int, *extra: str, launcher: str = "tcp") -> list[np.ndarray]:
    args = ["--backend", backend, "--steps", "50", "--width", "64", "--save", str(tmp), *extra]
    run = run_tcp if launcher == "tcp" else run_mpi
    proc = run(world, EXAMPLE, *args, timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert len(lines(proc, "DDP rank=")) == world
    name = "hook" if "--hook" in extra else backend
    return [np.load(os.path.join(tmp, f"params-{name}-{r}.npy")) for r in range(world)]


def _same_training(ours: list[np.ndarray], gloo: list[np.ndarray]) -> None:
    for r in range(1, len(ours)):
        assert np.array_equal(ours[r], ours[0]), f"rank {r}'s parameters differ from rank 0's"
    # gloo and twisternet add the ranks' gradients in different orders: float32 rounding, no more
    np.testing.assert_allclose(ours[0], gloo[0], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_50_steps_equal_gloo(tmp_path) -> None:
    gloo = _ddp(tmp_path, "gloo", 3)
    ours = _ddp(tmp_path, "twisternet", 3)
    _same_training(ours, gloo)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("via", ["ring", "tree", "doubling"])
def test_ddp_equal_gloo_other_algorithms(tmp_path, via: str) -> None:
    gloo = _ddp(tmp_path, "gloo", 4)
    ours = _ddp(tmp_path, "twisternet", 4, "--via", via)
    _same_training(ours, gloo)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ddp_hook_and_mpiexec_equal_gloo(tmp_path) -> None:
    gloo = _ddp(tmp_path, "gloo", 2)
    hook = _ddp(tmp_path, "gloo", 2, "--hook")
    _same_training(hook, gloo)
    ours = _ddp(tmp_path / "mpi", "twisternet", 2, launcher="mpi")
    _same_training(ours, gloo)
