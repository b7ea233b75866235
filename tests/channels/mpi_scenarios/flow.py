"""Scenarios: flow control (credit, refusals, resuming) and the bytes a sender has pending."""

from __future__ import annotations

import time
from collections import deque
from typing import Any
from collections.abc import Callable

from tests.channels.mpi_scenarios.helpers import DEADLINE, check, digest, make_channel, ok, payload, spin


def scenario_backpressure() -> None:
    """Rank 1 consumes slowly: rank 0's sends are refused once the credit is used, resume after
    release, never exceed the budget, and other edges keep flowing meanwhile."""
    bs, count = 64 << 10, 4
    credit = bs * count
    ch, rec = make_channel(buffer_size=bs, buffer_count=count)
    size = 48 << 10  # above the copy limit: these hold pool buffers until released
    fit = credit // size  # independent expectation: 5 messages fit in 256 KiB
    total = 40
    if ch.rank == 0:
        data = [payload(0, 1, 1, i, size) for i in range(total)]
        accepted = 0
        while accepted < total and ch.send(1, 1, [data[accepted]]):
            accepted += 1
        check(accepted == fit, f"expected {fit} messages to fit the credit, {accepted} did")
        # Blocked edge 1 does not block edge 2.
        check(ch.send(1, 2, [b"other edge"]), "send on another edge was refused")
        # Stay blocked while rank 1 holds everything (it signals with a message on edge 9).
        go = []
        rec.on_message_hook = lambda p, e, d, r: (go.append(bytes(d)), r())
        refusals = 0
        while not go:
            refusals += not ch.send(1, 1, [data[accepted]])
            ch.progress(0.005)
            check(time.monotonic() < DEADLINE, "rank 0 never got the go signal")
        check(refusals > 0, "send should have stayed refused")
        check(not ch.send(1, 1, [data[accepted]]) or False, "rank 1 still holds the credit")
        # Now rank 1 releases slowly; we keep sending as credit returns.
        while accepted < total:
            if ch.send(1, 1, [data[accepted]]):
                accepted += 1
            else:
                ch.progress(0.002)
            check(time.monotonic() < DEADLINE, "rank 0 stuck sending")
        # A lone message larger than the whole credit may travel once nothing is in flight...
        big = payload(0, 1, 1, total, credit * 2)
        spin(ch, lambda: ch.send(1, 1, [big]), "the oversize send to be accepted")
        # ...and then nothing else on that edge until it is released.
        check(not ch.send(1, 1, [b"x"]), "a send behind an oversize message must wait")
        spin(ch, lambda: ch.send(1, 1, [b"x"]), "credit after the oversize message")
        spin(ch, lambda: not ch.has_pending(), "sends to complete")
        ok(0, accepted=accepted, refused_while_held=refusals)
    else:
        held: deque[tuple[int, memoryview, Callable[[], None]]] = deque()
        order: list[tuple[int, int]] = []
        rec.on_message_hook = lambda p, e, d, r: (held.append((e, d, r)), order.append((e, d.nbytes)))
        spin(ch, lambda: sum(1 for e, _, _ in held if e == 1) == fit and any(e == 2 for e, _, _ in held),
             "the credit's worth of messages and the other edge's message")
        # Hold for a while: nothing more may arrive on edge 1.
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            ch.progress(0.005)
        n1 = sum(1 for e, _, _ in held if e == 1)
        check(n1 == fit, f"rank 0 exceeded the credit: {n1} messages held, credit fits {fit}")
        for _e, d, r in [h for h in held if h[0] == 2]:
            check(bytes(d) == b"other edge", "wrong message on edge 2")
            r()
        held = deque(h for h in held if h[0] == 1)
        check(ch.send(0, 9, [b"go"]), "go signal refused")
        seq = 0
        max_held = 0
        got_big = False
        end = DEADLINE
        while True:
            ch.progress(0.001)
            check(time.monotonic() < end, "rank 1 timed out consuming")
            in_flight = sum(d.nbytes for e, d, _ in held if e == 1)
            max_held = max(max_held, in_flight)
            if in_flight > credit + credit // 16:
                check(len(held) == 1, f"{in_flight} bytes held beyond the credit by {len(held)} messages")
            if not held:
                continue
            e, d, r = held[0]
            if seq < total:
                check(d.nbytes == size and bytes(d) == payload(0, 1, 1, seq, size), f"message {seq} corrupt")
                time.sleep(0.002)  # the slow consumer
            elif seq == total:
                check(d.nbytes == credit * 2 and bytes(d) == payload(0, 1, 1, total, credit * 2),
                      "oversize message corrupt")
                end2 = time.monotonic() + 0.2
                while time.monotonic() < end2:  # hold it: the next message must not arrive meanwhile
                    ch.progress(0.005)
                check(len(held) == 1, "a message overtook the held oversize message's credit")
                got_big = True
            else:
                check(bytes(d) == b"x", "last message corrupt")
                held.popleft()
                r()
                break
            held.popleft()
            r()
            seq += 1
        check(got_big, "oversize message not seen")
        ok(1, max_held=max_held)
    ch.close(30)
    check(not rec.lost, f"peers reported lost: {rec.lost}")


def scenario_pending_bytes() -> None:
    """``pending_bytes`` counts the payload bytes handed to ``send`` that MPI has not finished sending,
    per peer and in total: a rendezvous payload stays pending until its receiver takes it, and
    nothing is pending once the sends completed."""
    from mpi4py import MPI
    ctl = MPI.COMM_WORLD.Dup()   # rank 1 waits on it, without progressing the channel
    ch, rec = make_channel(mpi_shared_memory=False, buffer_size=65536)
    size = 4 << 20
    details: dict[str, Any] = {}
    if ch.rank == 0:
        check(ch.pending_bytes() == 0 and ch.pending_bytes(1) == 0, "pending bytes before any send")
        small = payload(0, 1, 4, 0, 1000)   # on an edge of its own: the big one uses all of edge 3's credit
        check(ch.send(1, 3, [payload(0, 1, 3, 0, size)], token="big"), "big send refused")
        check(ch.send(1, 4, [small[:500], small[500:]], token="small"), "small send refused")
        now = ch.pending_bytes(1)
        # The big payload cannot have left: rank 1 has not read its header yet. (The small one may.)
        check(size <= now <= size + 1000, f"pending_bytes(1) = {now} right after sending {size} + 1000")
        check(ch.pending_bytes() == now, f"pending_bytes() = {ch.pending_bytes()}, the only peer's {now}")
        ctl.send("go", dest=1, tag=77)
        spin(ch, lambda: set(rec.sent) == {"big", "small"} and not ch.has_pending(), "the sends to complete")
        check(ch.pending_bytes() == 0 and ch.pending_bytes(1) == 0,
              f"{ch.pending_bytes()} bytes pending after every send completed")
        details["pending_after_send"] = now
    else:
        ctl.recv(source=0, tag=77)
        spin(ch, lambda: len(rec.messages) == 2, "both messages")
        got = {edge: digest(data) for _, edge, data, _ in rec.messages}
        check(got == {3: digest(payload(0, 1, 3, 0, size)), 4: digest(payload(0, 1, 4, 0, 1000))},
              "message contents")
        for msg in rec.messages:
            msg[3]()
        check(ch.pending_bytes() == 0, "the receiver has bytes pending")
    ch.close(10.0)
    ctl.Free()
    ok(ch.rank, **details)


def scenario_small_pingpong() -> None:
    """The small-message path: in a ping-pong the credit of each message rides back on the reply
    (no control message per message), and only the oldest receive of each kind per peer is in the
    request table, which shrinks again after a burst of sends."""
    ch, rec = make_channel()
    peer = 1 - ch.rank
    idle_active = ch._requests.active
    n, size = 400, 1000
    got: list[bytes] = []
    rec.on_message_hook = lambda p, e, d, r: (got.append(bytes(d)), r())
    for i in range(n):
        if ch.rank == 0:
            check(ch.send(peer, 5, [payload(0, 1, 5, i, size)]), "ping refused")
            spin(ch, lambda i=i: len(got) == i + 1, f"reply {i}")
            check(got[i] == payload(1, 0, 5, i, size), f"reply {i} corrupt or out of order")
        else:
            spin(ch, lambda i=i: len(got) == i + 1, f"ping {i}")
            check(got[i] == payload(0, 1, 5, i, size), f"ping {i} corrupt or out of order")
            check(ch.send(peer, 5, [payload(1, 0, 5, i, size)]), "reply refused")
    # A burst of sends (more than MPI is handed at once per peer), then the table shrinks again.
    burst = 200
    if ch.rank == 0:
        for i in range(burst):
            spin(ch, lambda i=i: ch.send(peer, 6, [payload(0, 1, 6, i, 64)]), "credit for the burst")
        spin(ch, lambda: not ch.has_pending(), "the burst to complete")
    else:
        spin(ch, lambda: len(got) == n + burst, "the burst")
        check(all(got[n + i] == payload(0, 1, 6, i, 64) for i in range(burst)), "burst corrupt or out of order")
    ch.comm.Barrier()
    spin(ch, lambda: ch._requests.active <= idle_active + 1, "the table to empty")
    piggy, ctrl = ch.stats.get("credit_piggybacked", 0), ch.stats["credit_msgs_sent"]
    check(idle_active == 2, f"{idle_active} requests in the table at idle, expected one data and one "
                            "control receive")
    check(len(ch._requests._reqs) <= 8, f"request array of {len(ch._requests._reqs)} slots after the burst")
    # every ping/reply but the last carries the credit of the message before it back (a few may
    # miss the ride when the poll was quiet for a millisecond in between, on a busy machine)
    check(piggy >= n // 2, f"only {piggy} of {n} replies carried their credit back")
    ch.close(10)
    ok(ch.rank, piggybacked=piggy, credit_msgs=ctrl)


def scenario_one_receive_reposted() -> None:
    """A receive whose small message was copied out is posted again by the next poll, not by the one
    that delivered it: with one pool receive per peer, a burst of small messages (sent while the
    receiver does not poll) still arrives whole and in order, and the receive is back in MPI's hands
    after every poll."""
    ch, rec = make_channel(pool_buffers=2, buffer_count=1)
    peer = 1 - ch.rank
    check(ch._recvs_per_peer == 1, f"{ch._recvs_per_peer} pool receives per peer, expected 1")
    n, size = 300, 100
    got: list[bytes] = []
    rec.on_message_hook = lambda p, e, d, r: (got.append(bytes(d)), r())
    delivering_polls = 0
    if ch.rank == 0:
        for i in range(n):
            spin(ch, lambda i=i: ch.send(peer, 3, [payload(0, 1, 3, i, size)]), f"credit for message {i}")
        spin(ch, lambda: not ch.has_pending(), "the sends to complete")
    else:
        ch.comm.Barrier()       # the first messages wait in MPI, with one receive posted for them
        end = time.monotonic() + 60
        while len(got) < n:
            before = len(got)
            ch.progress(0.002)
            if len(got) > before:
                delivering_polls += 1
                check(len(ch._data_recvs[peer]) == 0 and len(ch._repost) == 1,
                      "the delivering poll should leave its receive to the next one")
            check(time.monotonic() < end, f"only {len(got)} of {n} messages came")
        check(all(got[i] == payload(0, 1, 3, i, size) for i in range(n)), "messages corrupt or out of order")
        ch.progress(0)
        check(len(ch._data_recvs[peer]) == 1 and not ch._repost, "the receive was not posted again")
    if ch.rank == 0:
        ch.comm.Barrier()
    ch.comm.Barrier()
    ch.close(10)
    ok(ch.rank, delivering_polls=delivering_polls)


def scenario_two_drivers() -> None:
    """Any thread may drive the channel: a background thread waits in ``progress(timeout)`` while
    the main thread sends and polls with ``progress(0)`` (as a caller waiting for its reply does);
    every message arrives intact and in order, and neither thread sees an error."""
    import threading
    ch, rec = make_channel()
    check(ch.thread_safe_progress, "the MPI channel should say any thread may drive it")
    peer = 1 - ch.rank
    n, size = 300, 700
    got: list[bytes] = []
    rec.on_message_hook = lambda p, e, d, r: (got.append(bytes(d)), r())
    stop = threading.Event()
    errors: list[BaseException] = []

    def background() -> None:
        try:
            while not stop.is_set():
                ch.progress(0.002)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    t = threading.Thread(target=background, daemon=True)
    t.start()
    try:
        for i in range(n):
            def have(i: int = i) -> bool:
                return len(got) > i or bool(errors)
            if ch.rank == 0:
                check(ch.send(peer, 5, [payload(0, 1, 5, i, size)]), "ping refused")
            end = min(time.monotonic() + 30, DEADLINE)
            while not have():
                ch.progress(0)
                check(time.monotonic() < end, f"rank {ch.rank}: message {i} never came")
            check(not errors, f"rank {ch.rank}: the background driver failed: {errors!r}")
            want = payload(1 - ch.rank, ch.rank, 5, i, size)
            check(got[i] == want, f"rank {ch.rank}: message {i} corrupt or out of order")
            if ch.rank == 1:
                check(ch.send(peer, 5, [payload(1, 0, 5, i, size)]), "reply refused")
    finally:
        stop.set()
        t.join(10)
    check(not errors, f"rank {ch.rank}: the background driver failed: {errors!r}")
    spin(ch, lambda: not ch.has_pending(), "sends to complete")
    ch.close(10)
    ok(ch.rank, received=len(got))


def scenario_small_fast() -> None:
    """The core's small-message fast path over MPI: ``idle`` while nothing is queued or unacknowledged
    on (peer, edge); ``send_small`` then posts one eager message at once, and refuses (doing nothing)
    while the credit of the previous one is out; a message too large to go eagerly is refused too."""
    ch, rec = make_channel(buffer_size=64 << 10)
    peer = 1 - ch.rank
    got: list[bytes] = []
    edges: list[int] = []
    rec.on_message_hook = lambda p, e, d, r: (got.append(bytes(d)), edges.append(e), r())
    n, size = 100, 1000
    sent = refused = 0
    for i in range(n):
        if ch.rank == 0:
            check(ch.idle(peer, 4), f"ping {i}: (peer, 4) should be idle once the reply came back")
            check(ch.send_small(peer, 4, [payload(0, 1, 4, i, size)], size), f"ping {i} refused")
            sent += 1
            if not ch.idle(peer, 4):        # its credit is out (unless it already came back)
                refused += not ch.send_small(peer, 4, [b"never"], 5)
            spin(ch, lambda i=i: len(got) == i + 1, f"reply {i}")
            check(got[i] == payload(1, 0, 4, i, size), f"reply {i} corrupt or out of order")
            spin(ch, lambda: ch.idle(peer, 4), f"credit of ping {i}")
        else:
            spin(ch, lambda i=i: len(got) == i + 1, f"ping {i}")
            check(got[i] == payload(0, 1, 4, i, size), f"ping {i} corrupt or out of order")
            spin(ch, lambda i=i: ch.send_small(peer, 4, [payload(1, 0, 4, i, size)], size), f"reply {i}")
    check(not ch.send_small(peer, 9, [bytes(65 << 10)], 65 << 10), "a message over the eager limit went")
    if ch.rank == 0:
        # a size that is not the parts' is refused loudly, with nothing sent; parts of several kinds
        try:
            ch.send_small(peer, 6, [b"abc"], 4)
            check(False, "send_small sent 3 bytes announced as 4")
        except ValueError:
            pass
        check(ch.send_small(peer, 5, [b"he", memoryview(b"l"), bytearray(b"lo")], 5), "a message in parts refused")
    else:
        spin(ch, lambda: len(got) == n + 1, "the message in parts")
        check(got[n] == b"hello" and edges[n] == 5, f"the message in parts came as {got[n]!r} on {edges[n]}")
    ch.comm.Barrier()
    check(ch.rank == 1 or refused == sent, f"send_small went {sent - refused} times while credit was out")
    spin(ch, lambda: not ch.has_pending(), "sends to complete")
    ch.close(10)
    ok(ch.rank, sent=sent, refused=refused)
