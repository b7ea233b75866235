"""Scenarios: how a channel ends: close with messages in flight, an abort notice, a peer that never
closes."""

from __future__ import annotations

import time

from tests.channels.mpi_scenarios.helpers import Traffic, check, make_channel, ok, spin

from twisternet.errors import ClosedError, PeerLostError


def scenario_close() -> None:
    """Rank 0 closes right after posting its sends; the others' messages to it are delivered during
    its close, and nobody is reported lost."""
    from mpi4py import MPI
    ch, rec = make_channel(buffer_size=16 << 10, buffer_count=8)

    def plan(src: int, dst: int, edge: int) -> list[int]:
        return [100, 40 << 10, 0, 10]  # fits the credit: no refusal

    t = Traffic(ch, rec, [4], plan, hold=0, seed=3)
    t.pump()
    check(t.done_sending(), "all sends should fit the credit")
    MPI.COMM_WORLD.Barrier()  # every rank has posted its sends; rank 0 has not received them yet
    if ch.rank == 0:
        start = time.monotonic()
        ch.close(30)
        took = time.monotonic() - start
        check(t.done_receiving(), "rank 0 did not get its messages during close")
    else:
        t.run()
        time.sleep(0.05 * ch.rank)
        start = time.monotonic()
        ch.close(30)
        took = time.monotonic() - start
        try:
            ch.send(0, 4, [b"late"])
            raise AssertionError("send after close must raise")
        except ClosedError:
            pass
    t.check_tokens()
    check(not rec.lost, f"peers reported lost: {rec.lost}")
    check(took < 10, f"close took {took:.1f}s")
    ok(ch.rank, close_seconds=round(took, 3))


def scenario_abort_notice() -> None:
    """Rank 1 aborts its channel: the others see it lost (with the reason), can no longer send to it,
    and still close cleanly among themselves."""
    ch, rec = make_channel(buffer_size=16 << 10)
    if ch.rank == 1:
        ch.abort("boom in rank 1")
        ok(1)
        return
    spin(ch, lambda: 1 in rec.lost, "rank 1 to be reported lost", limit=20)
    check("boom in rank 1" in rec.lost[1], f"reason not carried: {rec.lost[1]!r}")
    try:
        ch.send(1, 0, [b"to the dead"])
        raise AssertionError("send to a lost peer must raise")
    except PeerLostError as e:
        check(e.rank == 1, "wrong rank in PeerLostError")
    others = [p for p in range(ch.world) if p not in (ch.rank, 1)]
    for p in others:
        check(ch.send(p, 0, [b"hello %d" % ch.rank]), "send refused")
    spin(ch, lambda: len(rec.messages) == len(others), "messages from the survivors", limit=20)
    start = time.monotonic()
    ch.close(20)
    took = time.monotonic() - start
    check(took < 5, f"close waited {took:.1f}s for a lost peer")
    check(set(rec.lost) == {1}, f"unexpected losses {rec.lost}")
    ok(ch.rank, close_seconds=round(took, 3))


def scenario_peer_never_closes() -> None:
    """Rank 1 never closes its channel (nor progresses): rank 0's close still returns within its
    timeout, flushing what it can."""
    ch, rec = make_channel(buffer_size=16 << 10)
    if ch.rank == 1:
        time.sleep(3.0)
        ok(1)
        return
    check(ch.send(1, 0, [b"unread" * 100]), "send refused")
    start = time.monotonic()
    ch.close(1.0)
    took = time.monotonic() - start
    check(0.9 <= took < 5.0, f"close took {took:.2f}s for a 1s timeout")
    check(not rec.lost, "a silent peer is not a lost peer")
    ok(0, close_seconds=round(took, 3))
