"""Partial barriers across a real job: coordinator in rank 0 (local/MPI) or the bootstrap master (TCP)."""

import importlib.util
import threading
import time
from pathlib import Path

import pytest

from tests.jobs import lines, run_mpi, run_tcp
from twisternet.testing import run_local
from collectives.barrier.distributed import PartialBarrier

SCRIPT = Path(__file__).parent / "scripts" / "straggler.py"
spec = importlib.util.spec_from_file_location("straggler", SCRIPT)
straggler = importlib.util.module_from_spec(spec)
spec.loader.exec_module(straggler)


def check(outs, late):
    """The fast workers fired among themselves; the straggler, which entered only after their release
    (see the script), was late."""
    fast = [o for o in outs if not o.startswith("rank=3 ")]
    slow = [o for o in outs if o.startswith("rank=3 ")][0]
    for o in fast:
        assert "status=FIRE" in o and "passed=task0,task1,task2 " in o, outs
    assert ("status=LATE_FIRE" if late == "pass" else "status=CATCHUP") in slow, outs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late", ["pass", "catch_up"])
def test_knee_releases_fast_workers_local(late, monkeypatch, tmp_path):
    monkeypatch.setattr(straggler, "LATE", late)
    monkeypatch.setattr(straggler, "SIGNAL_DIR", str(tmp_path))
    check(run_local(4, straggler.main, timeout=90), late)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late", ["pass", "catch_up"])
def test_knee_releases_fast_workers_tcp(late, tmp_path):
    p = run_tcp(4, SCRIPT, late, str(tmp_path), timeout=100)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    check([l[3:] for l in lines(p, "PB ")], late)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("late", ["pass", "catch_up"])
def test_knee_releases_fast_workers_mpi(late, tmp_path):
    p = run_mpi(4, SCRIPT, late, str(tmp_path), timeout=100)          # coordinator: rank 0, over control edges
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    check([l[3:] for l in lines(p, "PB ")], late)


def test_enter_callback_installed_on_the_hosting_rank_forces_the_fire():
    """The callback vetoes the first entry and forces the fire on the second (2 of max=3); the third
    rank enters only after both were released, so it is late. Ordered by events, not sleeps: the other
    ranks enter once the callback is installed, the third once the fire reached both."""
    from collectives.barrier.distributed import set_enter_callback

    installed = threading.Event()
    released = [threading.Event(), threading.Event()]
    seen: list = []

    def callback(label, rank, default):
        seen.append((label, default))
        return default or len(seen) >= 2          # veto the first entry, force the fire on the second

    def job(ctx):
        if ctx.rank == 0:
            set_enter_callback(ctx, "cb", callback)
            installed.set()
        b = PartialBarrier(ctx, "cb", max=ctx.world, timeout=60)
        assert installed.wait(30), "rank 0 never installed the callback"
        if ctx.rank == 2:
            assert all(e.wait(30) for e in released), "ranks 0 and 1 were never released"
        rel = b.enter(f"t{ctx.rank}", wait=30)
        if ctx.rank < 2:
            released[ctx.rank].set()
        return rel.status.name, sorted(rel.fire.passed), rel.fire.reason.name

    out = run_local(3, job, timeout=60)
    assert out[0] == out[1] == ("FIRE", ["t0", "t1"], "CALLBACK")
    assert out[2][0] == "LATE_FIRE" and out[2][1] == ["t0", "t1"]
    assert sorted(label for label, _ in seen) == ["t0", "t1"] and not any(d for _, d in seen)


def test_coordinator_answers_while_its_rank_is_leaving():
    """Rank 0 hosts the barrier service (as under MPI) and is already in close(), lingering for the
    others, when rank 1's barrier fires on its timeout. That fire comes from the service's timer thread,
    and its release must still reach rank 1: it used to be refused there ("context is closed"), and
    rank 1 waited until its own limit (the series caught it under MPI, where rank 0 left right after
    its own release)."""
    closing = threading.Event()
    contexts = {}

    def job(ctx):
        contexts[ctx.rank] = ctx
        b = PartialBarrier(ctx, "leaving", max=ctx.world, timeout=0.2)
        if ctx.rank == 0:
            closing.set()
            ctx.close()
            return None
        assert closing.wait(30), "rank 0 never started to close"
        while not contexts[0].closed:     # close() marks the context closed first, then lingers
            time.sleep(0.001)
        rel = b.enter("t1", wait=30)
        return rel.status.name, sorted(rel.fire.passed), rel.fire.reason.name

    out = run_local(2, job, timeout=60)
    assert out[1] == ("FIRE", ["t1"], "TIMEOUT")
