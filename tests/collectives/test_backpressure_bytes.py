"""Streaming back pressure counts bytes: a slow consumer of 1 MB arrays keeps the receiver's resident
memory within ``receive_pending_bytes`` plus the channel's credit and a constant (it held up to
~2.6 GB when only records were counted), under both launchers."""

from __future__ import annotations

import re

import numpy as np
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(400)
SCRIPT = Path(__file__).parent / "scripts" / "slow_consumer.py"
BOUND_MB = 32
CREDIT_MB = 8          # buffer_size 1 MB x buffer_count 8, per sending peer


@pytest.mark.parametrize("launcher", ["tcp", "mpi"])
def test_slow_consumer_bounds_receiver_rss(run_job, launcher: str) -> None:
    n = 400              # 2 senders x 400 MB
    env = {"TWISTERNET_RECEIVE_PENDING_BYTES": str(BOUND_MB << 20), "TWISTERNET_BUFFER_COUNT": "8",
           "TWISTERNET_TIMEOUT": "120"}
    p = run_job(launcher, 3, SCRIPT, str(n), timeout=350, **env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    m = re.search(r"RSS growth=([\d.]+) count=(\d+)", p.stdout)
    assert m and int(m.group(2)) == 2 * n, p.stdout[-3000:]
    growth = float(m.group(1))
    # the bound, the credit of two senders (twice: receive buffers and their decoded copies), 1 MB
    # records in hand, and a constant for allocator slack; far below the 800 MB sent
    assert growth < BOUND_MB + 4 * CREDIT_MB + 100, growth


def test_threads_sink_stops_at_the_byte_bound() -> None:
    """A destination that reads nothing: the sender is held back once the results waiting there reach
    ``receive_pending_bytes`` (4 arrays of 100 kB here), not after receive_pending_limit records."""

    import collectives as C
    from twisternet.errors import BackPressureTimeout
    from twisternet.testing import run_local

    def body(ctx):
        op = C.Gather(ctx, sources=[1], destinations=[0], edge=1, mode="streaming", timeout=30)
        if ctx.rank == 1:
            sent = 0
            try:
                for _ in range(60):
                    op.send(1, np.zeros(100_000 // 8), timeout=3)
                    sent += 1
            except BackPressureTimeout:
                pass
            ctx.send(0, 5, sent)
            return sent
        got = []
        ctx.register(5, lambda src, obj: got.append(obj) or True)
        ctx.wait_until(lambda: got, timeout=60)
        sink = op._sinks[0]
        held = (len(sink.items), sink.nbytes)
        op.abort()
        return held

    held, sent = run_local(2, body, timeout=120, receive_pending_bytes=400_000, buffer_size=65536,
                           buffer_count=2)
    assert held[1] <= 400_000 + 100_000 and held[0] <= 5, held
    assert sent < 60, sent


def test_threads_streaming_reduce_queue_stops_at_the_byte_bound() -> None:
    """Streaming Reduce waits for a round: the values of a source that runs ahead queue at the node
    until the slow source sends. That queue is held to its share of ``receive_pending_bytes`` (2 inputs
    share 400 kB here), not to ``limit`` records of any size."""

    import collectives as C
    from twisternet.errors import BackPressureTimeout
    from twisternet.testing import run_local

    def body(ctx):
        op = C.Reduce(ctx, sources=[0, 1], destinations=[0], edge=1, mode="streaming", timeout=30)
        if ctx.rank == 1:
            sent = 0
            try:
                for _ in range(60):
                    op.send(1, np.ones(100_000 // 8), timeout=3)
                    sent += 1
            except BackPressureTimeout:
                pass
            ctx.send(0, 5, sent)
            return sent
        got = []
        ctx.register(5, lambda src, obj: got.append(obj) or True)
        ctx.wait_until(lambda: got, timeout=60)
        st = next(iter(op._nodes.values())).state
        held = (len(st.queues[("r", 1)]), sum(a.nbytes for a in st.queues[("r", 1)]))
        op.abort()
        return held

    held, sent = run_local(2, body, timeout=120, receive_pending_bytes=400_000, buffer_size=65536,
                           buffer_count=2)
    assert held[1] <= 200_000 + 100_000 and held[0] <= 3, held
    assert sent < 60, sent


def test_threads_keyed_reduce_combiner_flushes_at_the_byte_bound() -> None:
    """A batch KeyedReduce inner combiner holding arrays under distinct keys passes them up once it
    holds ``receive_pending_bytes`` of them (400 kB here), not only after ``limit`` keys; the result
    is unchanged."""

    import collectives as C
    from twisternet.testing import run_local

    def body(ctx):
        op = C.KeyedReduce(ctx, sources=[0, 1, 2], destinations=[0], edge=1, op="sum", timeout=60)
        peak = 0
        for t in op.local_sources:
            node = op._nodes[0]
            for k in range(40):
                op.send(t, (t, k), np.full(100_000 // 8, float(k)))
                if node.parent is not None:
                    peak = max(peak, sum(v.nbytes for v in node.state.values()))
            op.finish(t)
        out = dict(op.results(0)) if 0 in op.local_destinations else None
        op.close()
        return peak, out

    got = run_local(3, body, timeout=120, receive_pending_bytes=400_000)
    for rank, (peak, _) in enumerate(got):
        assert peak <= 400_000 + 100_000, (rank, peak)
    out = got[0][1]
    assert sorted(out) == sorted((t, k) for t in range(3) for k in range(40))
    assert all(np.array_equal(v, np.full(100_000 // 8, float(k[1]))) for k, v in out.items())
