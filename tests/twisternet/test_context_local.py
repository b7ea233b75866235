"""Context and progress engine on the in-process channel: ordering, back pressure, failures, modes."""

import threading
import time

import numpy as np
import pytest

from twisternet.errors import BackPressureTimeout, ClosedError, PeerLostError, TwisternetError
from twisternet.testing import run_local

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("progress", ["thread", "manual"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_all_to_all_in_order_with_mixed_sizes(world, progress):
    n = 300

    def job(ctx):
        got = []
        ctx.register(3, lambda src, obj: got.append((src, obj)) or True)
        big = np.arange(200_000, dtype=np.float32) + ctx.rank
        for i in range(n):
            for d in range(ctx.world):
                ctx.send(d, 3, (ctx.rank, i, "x" * (i % 97)))
                if i % 100 == 0:
                    ctx.send(d, 3, big)
        ctx.flush()
        ctx.wait_until(lambda: len(got) == ctx.world * (n + 3), timeout=30)
        seqs = {}
        for src, obj in got:
            if isinstance(obj, np.ndarray):
                assert np.array_equal(obj, np.arange(200_000, dtype=np.float32) + src)
            else:
                assert obj[0] == src and obj[2] == "x" * (obj[1] % 97)
                seqs.setdefault(src, []).append(obj[1])
        return {s: v == list(range(n)) for s, v in seqs.items()}

    for res in run_local(world, job, progress=progress):
        assert res == {r: True for r in range(world)}


def test_sender_blocks_while_receiver_refuses_and_nothing_is_lost():
    total = 5000

    def job(ctx):
        if ctx.rank == 1:
            state = {"open": False, "seen": []}

            def h(src, obj):
                if not state["open"]:
                    return False
                state["seen"].append(obj)
                return True
            ctx.register(1, h)
            time.sleep(0.5)
            state["open"] = True
            ctx.resume(1)
            ctx.wait_until(lambda: len(state["seen"]) == total, timeout=30)
            return state["seen"] == list(range(total))
        t = time.monotonic()
        for i in range(total):
            ctx.send(1, 1, i)
        return time.monotonic() - t

    blocked_for, ok = run_local(2, job, buffer_size=4096, buffer_count=1, pool_buffers=2)
    assert ok
    assert blocked_for >= 0.4  # the sender could not run ahead of a refusing receiver


def test_try_send_and_timeout():
    def job(ctx):
        if ctx.rank == 1:
            ctx.register(1, lambda s, o: False)
            ctx.wait_until(lambda: False, timeout=1.5, on_timeout=lambda: TimeoutError("done"))
        refused = 0
        for _ in range(10_000):
            if not ctx.try_send(1, 1, b"y" * 500):
                refused += 1
                break
        with pytest.raises(BackPressureTimeout, match="edge=1"):
            for _ in range(10_000):
                ctx.send(1, 1, b"y" * 500, timeout=0.2)
        return refused

    with pytest.raises(TimeoutError, match="done"):
        run_local(2, job, buffer_size=4096, buffer_count=1, pool_buffers=2)


def test_peer_failure_raises_in_waiters_quickly():
    def job(ctx):
        if ctx.rank == 2:
            time.sleep(0.2)
            raise RuntimeError("rank 2 broke")
        t = time.monotonic()
        with pytest.raises(PeerLostError) as e:
            ctx.wait_until(lambda: False, timeout=20)
        assert e.value.rank == 2 and time.monotonic() - t < 5
        raise e.value

    with pytest.raises(RuntimeError, match="rank 2 broke"):
        run_local(3, job)


def test_handler_exception_fails_the_waiter():
    def job(ctx):
        def bad(src, obj):
            raise ValueError("handler bug")
        ctx.register(1, bad)
        ctx.send(ctx.rank, 1, 1)
        ctx.wait_until(lambda: False, timeout=10)

    with pytest.raises(ValueError, match="handler bug"):
        run_local(1, job)


def test_records_before_register_are_kept():
    def job(ctx):
        if ctx.rank == 0:
            for i in range(100):
                ctx.send(1, 9, i)
            ctx.flush()
            return None
        time.sleep(0.3)
        got = []
        ctx.register(9, lambda s, o: got.append(o) or True)
        ctx.wait_until(lambda: len(got) == 100, timeout=10)
        return got

    assert run_local(2, job)[1] == list(range(100))


def test_bad_arguments_are_clear_errors():
    def job(ctx):
        with pytest.raises(TwisternetError, match="destination rank"):
            ctx.send(5, 1, 1)
        with pytest.raises(TwisternetError, match="edge"):
            ctx.register(-1, lambda s, o: True)
        ctx.register(1, lambda s, o: True)
        with pytest.raises(TwisternetError, match="already used"):
            ctx.register(1, lambda s, o: True)
        return True

    assert run_local(2, job) == [True, True]


def test_closed_context_refuses_sends():
    def job(ctx):
        return ctx

    ctx = run_local(1, job)[0]
    with pytest.raises(ClosedError):
        ctx.send(0, 1, 1)


def test_thread_safe_sends():
    per_thread, nthreads = 500, 4

    def job(ctx):
        got = []
        lock = threading.Lock()

        def h(src, obj):
            with lock:
                got.append(obj)
            return True
        ctx.register(2, h)

        def worker(t):
            for i in range(per_thread):
                ctx.send(1 - ctx.rank, 2, (t, i))
        ts = [threading.Thread(target=worker, args=(t,)) for t in range(nthreads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        ctx.flush()
        ctx.wait_until(lambda: len(got) == per_thread * nthreads, timeout=30)
        by = {}
        for t, i in got:
            by.setdefault(t, []).append(i)
        return all(v == list(range(per_thread)) for v in by.values())

    assert run_local(2, job) == [True, True]


def test_try_send_of_a_large_record_does_not_wait_for_its_completion():
    # A record above the zero-copy threshold through try_send (as operations do from their
    # non-blocking paths) used to wait for the send's completion with a zero timeout and fail.
    def job(ctx):
        got = []
        ctx.register(4, lambda src, obj: got.append(np.array(obj, copy=True)) or True)
        if ctx.rank == 0:
            arr = np.arange(1 << 18, dtype=np.float64)       # 2 MB
            assert ctx.try_send(1, 4, arr)
            arr[:] = -1                                        # try_send copied: no effect on the peer
            ctx.flush()
            return "sent"
        ctx.wait_until(lambda: len(got) == 1, timeout=20)
        return bool(np.array_equal(got[0], np.arange(1 << 18, dtype=np.float64)))

    assert run_local(2, job) == ["sent", True]


def _edge_incarnations_job(ctx):
    """Rank 0 sends on edge 9 as incarnation 0, then 1, then 2 (stale 0 again after); rank 1's handler
    of incarnation 0 is still registered when incarnation 1's records arrive."""
    if ctx.rank == 0:
        for epoch in (0, 1, 2):
            ctx.tag_edges([9], epoch, "Op")
            for i in range(3):
                ctx.send(1, 9, (epoch, i))
        ctx.flush()
        ctx.send(1, 10, "sent")
        return None
    got = {0: [], 1: [], 2: []}
    done = []
    ctx.register(10, lambda src, obj: done.append(obj) or True)
    ctx.tag_edges([9], 0, "Op")
    ctx.register(9, lambda src, obj: got[0].append(obj) or True)
    ctx.wait_until(lambda: done, timeout=20)
    ctx.wait_until(lambda: len(got[0]) == 3, timeout=20)
    time.sleep(0.2)                    # incarnation 1's records are here: they must wait, not go to 0
    early = list(got[0])
    ctx.unregister(9)
    ctx.tag_edges([9], 2, "Op")        # incarnation 1 never registers here: its records are stale now
    ctx.register(9, lambda src, obj: got[2].append(obj) or True)
    ctx.wait_until(lambda: len(got[2]) == 3, timeout=20)
    return early, got[2]


def test_records_of_the_next_incarnation_of_an_edge_wait_and_stale_ones_are_dropped():
    early, late = run_local(2, _edge_incarnations_job)[1]
    assert early == [(0, 0), (0, 1), (0, 2)]
    assert late == [(2, 0), (2, 1), (2, 2)]


def test_different_operations_on_one_edge_fail_both_ranks():
    def job(ctx):
        errors = []
        ctx.tag_edges([9], 0, "Gather" if ctx.rank == 0 else "Reduce")
        ctx.register(9, lambda src, obj: True, on_error=errors.append)
        ctx.send(1 - ctx.rank, 9, "x")
        ctx.wait_until(lambda: errors, timeout=20)
        return str(errors[0])

    for msg in run_local(2, job):
        assert "rank 0 runs Gather" in msg or "rank 1 runs Reduce" in msg
        assert "different operations on one edge" in msg


# ------------------------------------------------------------------ channel capabilities, control edges
def test_every_channel_reports_pending_bytes_and_whether_it_spans_processes():
    """Capabilities are part of the Channel interface (the core asked ``getattr(channel, "pending_bytes")``
    and collectives compared ``channel.name`` with "local" before)."""
    from channels.local import LocalChannel, LocalHub
    from channels.tcp import TCPChannel
    from twisternet.channel import Channel
    from twisternet.config import load_config

    assert Channel.spans_processes is True
    assert TCPChannel.spans_processes is True
    assert LocalChannel.spans_processes is False
    assert TCPChannel.pending_bytes is not Channel.pending_bytes      # TCP queues sends: it counts them
    hub = LocalHub(2)
    a, _b = (LocalChannel(hub, r, load_config(env={}, channel="local")) for r in range(2))
    assert a.pending_bytes(1) == 0      # hands every message over inside send()


class _QueueingChannel:
    """Stands in for a channel that queues sends: ``held[peer]`` bytes still wait inside it."""

    def __init__(self) -> None:
        self.held = {1: 0}
        self.sent: list[int] = []

    def pending_bytes(self, peer: int) -> int:
        return self.held[peer]

    def send(self, peer, edge, parts, token=None) -> bool:
        self.sent.append(edge)
        return True


class _Coflows:
    """A scheduler fake: every edge is scheduled (rank >= 0), no pacing."""

    def refresh(self, force: bool = False) -> bool:
        return False

    def edge_rank(self, edge: int) -> int:
        return 0

    def pace(self, edge, peer, nbytes) -> float:
        return 0.0

    def report_sent(self, edge, peer, nbytes) -> None:
        pass


def test_the_coflow_pump_holds_sends_while_the_channel_holds_its_inflight_cap():
    """The coflow in-flight cap asks the channel interface (``pending_bytes``) for what it holds, so it
    applies on any channel that implements it (it silently did nothing where the probe found no such
    attribute)."""
    from twisternet.config import load_config
    from twisternet.context.coflow_pump import CoflowPump
    from twisternet.context.streams import _OutMsg, _OutStream
    from twisternet.framing import BufferPool

    cfg = load_config(env={}, channel="local", coflow_inflight=1000)
    ch = _QueueingChannel()
    s = _OutStream(1, 7, BufferPool(4096, 2))
    for _ in range(2):
        s.queue.append(_OutMsg([b"\x01", b"x" * 100], 101, None, None))
        s.queued_bytes += 101
    out, ready = {(1, 7): s}, {(1, 7)}
    pump = CoflowPump(ch, _Coflows(), cfg, out, ready)
    ch.held[1] = 1000                 # the channel holds the cap already: nothing more goes
    assert not pump.pump()
    assert ch.sent == [] and len(s.queue) == 2 and ready == {(1, 7)}
    ch.held[1] = 999                  # below the cap: the backlog goes
    assert pump.pump()
    assert ch.sent == [7, 7] and not s.queue and s.queued_bytes == 0 and ready == set()


def test_register_control_handler_takes_only_control_edges_and_gets_earlier_records():
    from twisternet.channel import CONTROL_EDGE_BASE

    edge = CONTROL_EDGE_BASE + 40     # a reserved edge no core service uses

    def job(ctx):
        got = []
        with pytest.raises(TwisternetError):
            ctx.register_control_handler(5, lambda src, obj: True)        # a user edge
        with pytest.raises(TwisternetError):
            ctx.register(edge, lambda src, obj: True)                      # and the other way round
        go = threading.Event()
        ctx.register(1, lambda src, obj: go.set() or True)
        if ctx.rank == 1:
            ctx.send(0, edge, "early")      # before rank 0 registers its control handler
            ctx.send(0, 1, "go")
            return None
        ctx.wait_until(go.is_set, timeout=20)
        ctx.register_control_handler(edge, lambda src, obj: got.append((src, obj)) or True)
        ctx.wait_until(lambda: got, timeout=20)
        return got

    assert run_local(2, job)[0] == [(1, "early")]


@pytest.mark.parametrize("progress", ["thread", "manual"])
def test_deferred_work_runs_within_the_flush_delay_again_until_done_and_on_flush(progress):
    """ctx.defer: the engine (or whoever drives it) calls the function once it is due, again after
    another delay while it returns False; a second defer of a waiting key changes nothing; flush()
    calls every waiting function at once."""
    def job(ctx):
        calls = []
        done = threading.Event()

        def fn():
            calls.append(time.monotonic())
            if len(calls) >= 3:
                done.set()
                return True
            return False
        ctx.defer("k", fn)
        ctx.defer("k", lambda: calls.append(-1.0) or True)   # already waiting: ignored
        if progress == "manual":
            deadline = time.monotonic() + 20
            while not done.is_set() and time.monotonic() < deadline:
                ctx.progress(0.01)
        ok = done.wait(20)
        flushed = []
        ctx.defer("other", lambda: flushed.append(1) or True)
        ctx.flush()                       # due in flush_delay, run now
        return ok, len(calls), -1.0 in calls, flushed

    for ok, n, second, flushed in run_local(2, job, progress=progress, timeout=40):
        assert ok and n == 3 and not second and flushed == [1]


def test_notify_wakes_threads_asleep_on_the_context_and_no_wake_up_is_lost():
    """Two threads hand a counter back and forth 300 times, each sleeping on the Context's condition
    (the engine is held, so neither can drive it instead) with a one-minute timeout: a notification
    lost between a waiter's look at the state and its sleep would stall the test for a minute."""
    def job(ctx):
        n = 300
        state = {"c": 0}
        stuck = []

        def player(parity: int) -> None:
            for i in range(n):
                want = 2 * i + parity
                while True:
                    gen = ctx._gen
                    if state["c"] == want:
                        break
                    t = time.monotonic()
                    ctx._wait_change(gen, 60.0)
                    if time.monotonic() - t > 30:
                        stuck.append(want)
                        return
                state["c"] = want + 1
                ctx.notify()

        assert ctx._chan_lock.acquire(timeout=10)   # keep the engine: waiters sleep on the condition
        try:
            threads = [threading.Thread(target=player, args=(p,), daemon=True) for p in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(50)
            alive = [t.is_alive() for t in threads]
        finally:
            ctx._chan_lock.release()
        return state["c"], stuck, alive, ctx._cond_waiters

    [(count, stuck, alive, waiters)] = run_local(1, job, busy_poll_us=0)
    assert (count, stuck, alive, waiters) == (600, [], [False, False], 0)
