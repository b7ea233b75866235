"""The threaded in-process harness: one service thread, N clients on threads, real and manual clocks."""

from __future__ import annotations

import threading
import time

import pytest

from collectives.barrier import (BarrierClosed, BarrierSpec, BarrierTimeout, CatchUp, FireReason,
                                 LocalBarrierCluster, ManualClock, SemaphoreSpec, Status)

pytestmark = pytest.mark.timeout(60)


def run_workers(cluster, work, body):
    """Run body(rank, client) after sleeping work[rank] on one thread per rank; return results by rank."""
    results = {}

    def worker(rank):
        time.sleep(work[rank])
        try:
            results[rank] = body(rank, cluster.clients[rank])
        except BaseException as exc:  # noqa: BLE001 - collected for the assertions
            results[rank] = exc

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(len(work))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a worker hung"
    return results


@pytest.mark.parametrize("late", ["pass", "catch_up"])
def test_knee_releases_the_fast_and_the_slow_one_is_late(late):
    base = 0.1
    work = [base, base + 0.01, base + 0.02, 20 * base]          # rank 3 is 20x slower
    spec = BarrierSpec(max=4, percent=75, knee=True, late=late)
    with LocalBarrierCluster(4) as cluster:
        res = run_workers(cluster, work,
                          lambda rank, c: c.enter("phase", f"task{rank}", spec, timeout=20))
    fast = [res[r] for r in range(3)]
    for rel in fast:
        assert not isinstance(rel, BaseException), rel
        assert rel.status is Status.FIRE and rel.fire.reason is FireReason.KNEE
        assert sorted(rel.fire.passed) == ["task0", "task1", "task2"]
        assert rel.fire.passed == {f"task{r}": r for r in range(3)}
    slow = res[3]
    if late == "pass":
        assert not isinstance(slow, BaseException), slow
        assert slow.status is Status.LATE_FIRE and slow.fire == fast[0].fire
    else:
        assert isinstance(slow, CatchUp), slow
        assert slow.next_round == 1 and slow.fire == fast[0].fire
        assert cluster.clients[3].next_round("phase", "task3") == 1


def test_rounds_through_the_harness():
    spec = BarrierSpec(max=3)
    with LocalBarrierCluster(3) as cluster:
        def body(rank, c):
            return [c.enter("loop", f"t{rank}", spec, timeout=10).round for _ in range(5)]
        res = run_workers(cluster, [0, 0.01, 0.02], body)
    assert all(res[r] == [0, 1, 2, 3, 4] for r in range(3)), res


def test_wait_timeout_and_close_fail_cleanly():
    with LocalBarrierCluster(2) as cluster:
        c = cluster.clients[0]
        t0 = time.monotonic()
        with pytest.raises(BarrierTimeout):
            c.enter("never", "a", BarrierSpec(max=2), timeout=0.2)
        assert time.monotonic() - t0 < 5
        box = []
        cluster.clients[1].enter_async("never2", "b", box.append, BarrierSpec(max=2))
    assert len(box) == 1 and isinstance(box[0], BarrierClosed)
    with pytest.raises(BarrierClosed):
        cluster.clients[0].enter("x", "a", BarrierSpec(max=1))


def test_semaphore_bounds_concurrency_across_threads():
    inside = []
    peak = [0]
    lock = threading.Lock()
    spec = SemaphoreSpec(n=2, hold_timeout=10.0)
    with LocalBarrierCluster(5) as cluster:
        def body(rank, c):
            c.acquire("sem", f"w{rank}", spec, timeout=10)
            with lock:
                inside.append(rank)
                peak[0] = max(peak[0], len(inside))
            time.sleep(0.05)
            with lock:
                inside.remove(rank)
            c.release("sem", f"w{rank}", timeout=10)
            return True
        res = run_workers(cluster, [0.0] * 5, body)
    assert all(v is True for v in res.values()), res
    assert peak[0] <= 2


def test_manual_clock_drives_timer_fires():
    clock = ManualClock()
    with LocalBarrierCluster(2, clock, poll_interval=0.01) as cluster:
        box = []
        done = threading.Event()
        cluster.clients[0].enter_async("b", "a", lambda r: (box.append(r), done.set()),
                                       BarrierSpec(max=2, timeout=5.0))
        time.sleep(0.1)
        assert not box
        clock.advance(5.0)
        cluster.wake()
        assert done.wait(5)
    assert box[0].fire.reason is FireReason.TIMEOUT and box[0].fire.time == 5.0


def test_enter_callback_through_an_in_process_client():
    """The callback vetoes "a" and forces the fire on "b"; "b" enters only once the callback has seen
    "a" (an event, not a head start in time), so the order is the same however loaded the machine is."""
    with LocalBarrierCluster(2) as cluster:
        calls = []
        a_seen = threading.Event()

        def cb(label, rank, default):
            calls.append(label)
            if label == "a":
                a_seen.set()
            return label == "b"

        def body(rank, client):
            if rank == 1:
                assert a_seen.wait(30), "the callback never saw a's entry"
            return client.enter("cb", "ab"[rank], BarrierSpec(max=5), timeout=30, callback=cb)

        res = run_workers(cluster, [0.0, 0.0], body)
    assert res[0].fire.reason is FireReason.CALLBACK and res[1].fire == res[0].fire
    assert sorted(res[0].fire.passed) == ["a", "b"]
    assert calls == ["a", "b"]


def test_retry_after_a_wait_timeout_gets_the_rounds_answer():
    spec = BarrierSpec(max=2)
    with LocalBarrierCluster(2) as cluster:
        a, b = cluster.clients
        with pytest.raises(BarrierTimeout):
            a.enter("r", "a", spec, timeout=0.1)
        rel_b = b.enter("r", "b", spec, timeout=10)           # a's entry still counts: the round fires
        rel_a = a.enter("r", "a", spec, timeout=10)           # the retry of round 0 gets the same fire
    assert rel_a.round == 0 and rel_a.status is Status.FIRE and rel_a.fire == rel_b.fire
    assert sorted(rel_a.fire.passed) == ["a", "b"]
