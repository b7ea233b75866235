"""The MPI channel notices a frozen rank by heartbeats (peer_timeout, as TCP does), and an error no
handler caught ends the whole MPI job (MPI_Abort) instead of leaving it to the operation timeout."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests.jobs import job_env, require_mpiexec, run_killable

pytestmark = pytest.mark.usefixtures("mpiexec")     # skips (printing why) where MPI is not installed

SCRIPT = Path(__file__).with_name("mpi_liveness_job.py")
PEER_TIMEOUT = 4.0


def assert_no_segments_left(out: str) -> None:
    """The MPICH shared-memory files the ranks mapped are gone: a job ended by MPI_Abort must not
    leave them in /dev/shm (MPICH removes them only in MPI_Finalize)."""
    named = set()
    for m in re.finditer(r"READY rank=\d+ segments=(\S*)", out):
        named.update(p for p in m.group(1).split(",") if p)
    assert named, f"the ranks named no MPICH segment:\n{out}"
    left = sorted(p for p in named if os.path.exists(p))
    assert not left, f"left in /dev/shm: {left}"


def run_liveness_job(args: list[str], timeout: float, **env_extra: str) -> tuple[int, str, str, float]:
    """The liveness job on 3 ranks under mpiexec; the test fails if it is still running after ``timeout``
    (the operation timeout is 300 s, so a job that ends at all ended by the liveness mechanisms).

    The ranks' stderr goes to files (``LIVENESS_ERR_DIR``), appended to the stderr returned: hydra
    forwards a rank's output through a pipe it stops reading once the job aborts, so the last lines
    before an MPI_Abort (the ones these tests look for) were lost in 1 of 2-3 runs beside a CPU hog."""
    import tempfile
    cmd = [require_mpiexec(), "-n", "3", sys.executable, str(SCRIPT), *args]
    with tempfile.TemporaryDirectory(prefix="liveness-err-") as d:
        rc, out, err, took = run_killable(cmd, timeout, job_env(LIVENESS_ERR_DIR=d, **env_extra), what="mpiexec")
        ranks = "".join(p.read_text(errors="replace") for p in sorted(Path(d).glob("err-*")))
    return rc, out, err + ranks, took


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["freeze", "freeze-exit"])
def test_a_frozen_rank_is_lost_by_heartbeat_and_the_job_ends(tmp_path: Path, mode: str) -> None:
    """freeze: the survivors' PeerLostError goes uncaught; freeze-exit: they catch it and exit 3."""
    rc, out, err, took = run_liveness_job([mode, str(tmp_path)], timeout=120,
                                 TWISTERNET_PEER_TIMEOUT=str(PEER_TIMEOUT),
                                 TWISTERNET_HEARTBEAT_INTERVAL="0.5")
    assert out.count("READY") == 3, out + err[-3000:]
    reports = {p.name: p.read_text() for p in tmp_path.glob("lost-*")}
    assert sorted(reports) == ["lost-0", "lost-1"], f"{reports}\n{out}\n{err[-3000:]}"
    for text in reports.values():
        assert text.startswith("rank=2 "), text
        assert "heartbeat" in text, text
        after = float(re.search(r"after=([\d.]+)", text).group(1))
        # peer_timeout, plus a liveness tick, plus a loaded machine's scheduling delays
        assert after < PEER_TIMEOUT + 10, text
    assert rc != 0, f"mpiexec exited 0\n{out}\n{err[-3000:]}"
    assert "NOT LOST" not in out
    assert "MPI_Abort" in err, err[-3000:]
    assert took < 90, f"the job took {took:.0f}s to end"
    assert_no_segments_left(out)


@pytest.mark.timeout(150)
def test_a_rank_stuck_inside_mpi_ends_the_job_by_its_watchdog() -> None:
    """A rank whose progress is stuck (in an MPI call that never returns) cannot run its liveness pass,
    raise or send heartbeats; its watchdog ends the job after 2 x peer_timeout, naming the silent ranks
    and printing every thread's stack. The other ranks run without abort-on-error here, so nothing
    else could end the job before their 120 s sleep."""
    rc, out, err, took = run_liveness_job(["wedge"], timeout=100,
                                          TWISTERNET_PEER_TIMEOUT=str(PEER_TIMEOUT),
                                          TWISTERNET_HEARTBEAT_INTERVAL="0.5")
    assert out.count("READY") == 3, out + err[-3000:]
    assert rc != 0, f"mpiexec exited 0\n{out}\n{err[-3000:]}"
    assert "rank 0: the MPI channel's progress has been stuck" in err, err[-3000:]
    assert "MPI_Abort" in err and "stuck_poll" in err, err[-3000:]   # the stacks show where
    assert "never aborted" not in err
    assert took < 90, f"the job took {took:.0f}s to end"
    assert_no_segments_left(out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["uncaught", "uncaught-in-with"])
def test_an_uncaught_exception_on_one_rank_ends_the_job_promptly(mode: str) -> None:
    rc, out, err, took = run_liveness_job([mode], timeout=90)
    assert rc != 0, f"mpiexec exited 0\n{out}\n{err[-3000:]}"
    # rank 1's own traceback, or (inside ``with ctx:``, whose exit aborts the channel at once) the
    # others' PeerLostError, whose reason carries rank 1's error, if they abort the job first
    assert "ValueError: deliberate failure on rank 1" in err or \
        "rank 1 failed: ValueError('deliberate failure on rank 1')" in err, err[-3000:]
    assert "SURVIVED" not in out
    assert took < 60, f"the job took {took:.0f}s to end after the exception"
    assert_no_segments_left(out)


@pytest.mark.timeout(120)
def test_abort_on_error_can_be_switched_off() -> None:
    """mpi_abort_on_error=false: the failed rank's error does not end the job by itself (the others
    then wait for it; here a short operation timeout ends them)."""
    rc, out, err, took = run_liveness_job(["uncaught"], timeout=90, TWISTERNET_MPI_ABORT_ON_ERROR="false",
                                 TWISTERNET_TIMEOUT="8")
    assert "ValueError: deliberate failure on rank 1" in err, err[-3000:]
    assert "MPI_Abort" not in err
    assert took >= 7, f"the job ended after {took:.1f}s, before the others' operation timeout"


@pytest.mark.timeout(150)
def test_a_rank_idle_past_the_peer_timeout_is_not_lost() -> None:
    rc, out, err, took = run_liveness_job(["idle", str(3 * PEER_TIMEOUT)], timeout=120,
                                 TWISTERNET_PEER_TIMEOUT=str(PEER_TIMEOUT),
                                 TWISTERNET_HEARTBEAT_INTERVAL="0.5")
    assert rc == 0, f"{out}\n{err[-3000:]}"
    assert out.count("ALIVE") == 3, out + err[-3000:]
    assert "lost" not in err, err[-3000:]
