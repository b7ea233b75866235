"""``AllReduce.allreduce`` through shared memory (``via="shm"``, and what "auto" picks on one host)."""

from __future__ import annotations

import functools
import hashlib
import os
import time
from pathlib import Path

import numpy as np
import pytest

import collectives as C
from collectives.allreduce import shm as shm_allreduce
from tests.jobs import assert_survivors_saw_the_kill, lines, run_tcp
from twisternet.errors import ConfigError, OperationTimeout
from twisternet import futex
from twisternet.testing import run_local

from tests.collectives.launchers import run_scenario
from tests.collectives.scenarios import run_shm_allreduce, shm_value

pytestmark = [pytest.mark.timeout(200),
              pytest.mark.skipif(not shm_allreduce.supported(), reason="needs /dev/shm on an x86-64 machine")]

UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum, "prod": np.multiply}
# (size, dtype) per call: single elements, a chunk boundary, arrays split among the ranks (chunks above
# DIRECT_BYTES) with a short tail chunk, then small calls again on the same segment
CALLS = [(1, "float64"), (5, "int32"), (4099, "float32"), (70_000, "float64"), (3, "int64"),
         (100_003, "int32"), (33_000, "float32"), (2, "float64")]


def reference(world: int, reduce: str, calls: list) -> list:
    """Digest, shape, dtype and head of the expected result of every call (ranks combined in rank order,
    as the shared-memory path combines them, so even float results must match bit for bit)."""
    out = []
    for k, (size, dtype) in enumerate(calls):
        r = functools.reduce(UFUNCS[reduce], [shm_value(rank, size, dtype, k) for rank in range(world)])
        out.append([hashlib.sha1(r.tobytes()).hexdigest(), [size], dtype, r[:3].tolist()])
    return out


def segments() -> set[str]:
    """Segments of this process (its pid in the name), whichever naming made them: other jobs on the
    machine create and remove theirs at any time."""
    pid = os.getpid()
    return {f for f in os.listdir(shm_allreduce.SHM_DIR)
            if f.startswith((f"twisternet-{pid}-", f"twisternet-shm-{pid}-"))}


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("reduce", ["sum", "max", "prod"])
def test_threads_equal_the_reference(world: int, reduce: str) -> None:
    before = segments()
    params = {"calls": CALLS, "reduce": reduce, "via": "shm", "shm_chunk_bytes": 128 << 10}
    res = run_local(world, run_shm_allreduce, params, timeout=150)
    want = reference(world, reduce, CALLS)
    for r in res:
        assert r["shm"] and r["calls"] == want
    assert segments() == before     # unlinked once every rank had it mapped


def test_arrays_that_differ_between_ranks_fail_on_every_rank() -> None:
    def body(ctx):
        op = C.AllReduce(ctx, edge=1, op="sum", via="shm")
        op.allreduce(np.ones(10))
        try:
            op.allreduce(np.ones(10 if ctx.rank == 0 else 12))
        except ValueError as e:
            first = str(e)
        else:
            first = "no error"
        try:
            op.allreduce(np.ones(10))
        except Exception as e:   # noqa: BLE001 - the operation is unusable after a failed call
            second = f"{type(e).__name__}: {e}"
        return first, second

    for first, second in run_local(2, body, timeout=60):
        assert "same shape and dtype" in first and "80 bytes of float64" in first and "96 bytes" in first
        assert "previous shared-memory allreduce failed" in second


def test_a_rank_that_never_calls_is_named_in_the_timeout() -> None:
    def body(ctx):
        op = C.AllReduce(ctx, edge=1, op="sum", via="shm")
        op.allreduce(np.ones(4))
        if ctx.rank == 1:
            return "skipped"
        with pytest.raises(OperationTimeout) as ei:
            op.allreduce(np.ones(4), timeout=1.0)
        return str(ei.value)

    msg = run_local(2, body, timeout=60)[0]
    assert "ranks [1]" in msg and "edge=1" in msg


def test_a_set_up_that_times_out_leaves_no_segment() -> None:
    """The first rank created the segment, the other never came: the timeout removes the file."""
    before = segments()

    def body(ctx):
        if ctx.rank == 1:
            return "skipped"
        op = C.AllReduce(ctx, edge=1, op="sum", via="shm")
        with pytest.raises(OperationTimeout):
            op.allreduce(np.ones(4), timeout=1.0)
        return segments() - before

    assert run_local(2, body, timeout=60)[0] == set()
    assert segments() == before


def test_a_set_up_whose_peer_is_lost_leaves_no_segment() -> None:
    before = segments()

    def body(ctx):
        if ctx.rank == 1:
            raise RuntimeError("rank 1 dies before its first allreduce")
        op = C.AllReduce(ctx, edge=1, op="sum", via="shm")
        try:
            op.allreduce(np.ones(4), timeout=30.0)
        finally:
            assert segments() == before

    with pytest.raises(RuntimeError, match="rank 1 dies"):
        run_local(2, body, timeout=60)
    assert segments() == before


def test_ranks_that_cannot_map_the_segment_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*a, **k):
        raise OSError("no such segment here")
    monkeypatch.setattr(shm_allreduce, "_attach", refuse)
    before = segments()

    def explicit(ctx):
        op = C.AllReduce(ctx, edge=1, op="sum", via="shm")
        with pytest.raises(ConfigError, match="cannot share memory"):
            op.allreduce(np.ones(8))
        return True
    assert run_local(3, explicit, timeout=60) == [True] * 3

    # "auto" (allowed here on the local channel for the test) falls back to the ring/tree and stays there
    monkeypatch.setattr(C.allreduce.RankAllReduce, "_auto_shm",
                        lambda self: self.shm is not None or not self.shm_tried)
    params = {"calls": CALLS[:5], "reduce": "sum", "via": "auto"}
    res = run_local(3, run_shm_allreduce, params, timeout=100)
    want = reference(3, "sum", CALLS[:5])
    for r in res:
        assert not r["shm"]
        assert [c[1:] for c in r["calls"]] == [c[1:] for c in want]   # ring order may differ in float bits
    assert segments() == before


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="shm_chunk_bytes"):
        run_local(1, lambda ctx: C.AllReduce(ctx, edge=1, shm_chunk_bytes=1000))

    def body(ctx):
        op = C.AllReduce(ctx, edge=1, op="sum", via="shm")
        for bad in ([1.0, 2.0], np.array([], np.float32), np.array([object()] * 2)):
            with pytest.raises(ConfigError, match="via='shm' needs"):
                op.allreduce(bad)
        with pytest.raises(ConfigError, match="via='shm' needs"):
            C.AllReduce(ctx, edge=2, op=lambda a, b: a + b, via="shm").allreduce(np.ones(3))
        return True
    assert run_local(2, body, timeout=60) == [True, True]


@pytest.mark.parametrize("launcher", ["tcp", "mpi"])
@pytest.mark.parametrize("world", [2, 4])
def test_auto_uses_shared_memory_in_processes(launcher: str, world: int) -> None:
    before = segments()
    res = run_scenario(launcher, world, "run_shm_allreduce", {"calls": CALLS, "reduce": "sum"}, timeout=150)
    want = reference(world, "sum", CALLS)
    for r in res:
        assert r["shm"] and r["calls"] == want
    assert segments() == before


def test_a_killed_rank_is_reported_by_the_spinning_survivors() -> None:
    script = Path(__file__).parent / "scripts" / "shm_kill.py"
    before = segments()
    p = run_tcp(3, script, TWISTERNET_PEER_TIMEOUT="10", timeout=100, grace=20)
    assert len(lines(p, "SHM")) == 3 and all("used=True" in x for x in lines(p, "SHM")), p.stdout + p.stderr
    assert_survivors_saw_the_kill(p, victim=2, survivors=2, within=10)
    assert segments() == before


@pytest.mark.skipif(not futex.available(), reason="futex: Linux on x86-64 only")
def test_ranks_that_may_not_spin_sleep_in_the_kernel_and_are_woken(monkeypatch: pytest.MonkeyPatch) -> None:
    """With busy polling off (ranks outnumber cores), a rank that waits for a late one sleeps on the
    header word (twisternet.futex) and the late one's publication wakes it. The sleeps' time slice is
    made a minute here: without the wake-up the 20 calls would take 20 minutes, not well under one."""
    monkeypatch.setattr(shm_allreduce, "_SLEEP_SLICE", 60.0)
    sleeps = []
    real = futex.wait

    def spy(addr: int, seen: int, timeout: float) -> None:
        sleeps.append(timeout)
        real(addr, seen, timeout)
    monkeypatch.setattr(futex, "wait", spy)

    def body(ctx):
        op = C.AllReduce(ctx, edge=1, op="sum", via="shm")
        out = []
        for i in range(20):
            if ctx.rank == 0:
                time.sleep(0.005)                  # the others wait past their spinning
            out.append(op.allreduce(np.full(64, float(i + ctx.rank)), timeout=300))
        return out

    t0 = time.monotonic()
    res = run_local(3, body, timeout=600, busy_poll_us=0)
    for r in range(3):
        for i, got in enumerate(res[r]):
            assert np.array_equal(got, np.full(64, 3.0 * i + 3))
    assert sleeps and max(sleeps) > 30            # they slept, with the long slice
    assert time.monotonic() - t0 < 50             # and were woken, every time
