"""Scenarios: all-to-all traffic around every protocol boundary, 64 MB and > 2 GiB messages, and
messages of many parts (segments and the non-contiguous fallback)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from tests.channels.mpi_scenarios.helpers import Traffic, check, make_channel, ok, payload, spin


def scenario_mixed() -> None:
    """All-to-all on three edges (one the largest edge id) with sizes around every protocol boundary."""
    bs = 32 << 10
    ch, rec = make_channel(buffer_size=bs, buffer_count=4)
    credit = bs * 4
    boundaries = [0, 1, 17, 1000, bs // 2 - 1, bs // 2, bs // 2 + 1, bs - 1, bs, bs + 1, 3 * bs,
                  credit, credit + 1, 1 << 20]

    def plan(src: int, dst: int, edge: int) -> list[int]:
        rng = np.random.default_rng([src, dst, edge % 1000003, 99])
        sizes = list(boundaries) + [int(x) for x in rng.integers(0, 3 * bs, size=20)]
        rng.shuffle(sizes)
        return sizes

    t = Traffic(ch, rec, [0, 7, (1 << 31) - 1], plan, hold=3, seed=1)
    t.run()
    stats = dict(ch.stats)
    ch.close(30)
    t.check_tokens()
    check(not rec.lost, f"peers reported lost: {rec.lost}")
    check(stats["rendezvous_sent"] > 0 and stats["eager_sent"] > 0, "both protocols must be used")
    ok(ch.rank, received_bytes=t.received_bytes, refusals=t.refusals, **stats)


def scenario_big() -> None:
    """64 MB messages both ways (single part and multi-part), each followed by eager messages on the
    same edge that must not overtake them; default buffer configuration."""
    ch, rec = make_channel()
    mb64 = 64 << 20

    def plan(src: int, dst: int, edge: int) -> list[int]:
        return [mb64, 5, mb64 + 3, 0, 1 << 20, 2 << 20, 1]

    t = Traffic(ch, rec, [3], plan, hold=1, seed=2)
    t.run()
    ch.close(30)
    t.check_tokens()
    ok(ch.rank, received_bytes=t.received_bytes, refusals=t.refusals)


def scenario_huge() -> None:
    """One message over 2 GiB (a 2.1 GiB array plus a small part): 64-bit lengths end to end and
    MPI counts kept below 2**31 per segment."""
    words = (2200 << 20) // 8
    ch, rec = make_channel()
    if ch.rank == 0:
        arr = np.arange(words, dtype=np.uint64)
        check(ch.send(1, 11, [arr, b"tail"], token="huge"), "huge send refused")
        spin(ch, lambda: rec.sent == ["huge"], "the huge send to complete", limit=80)
        del arr
    else:
        spin(ch, lambda: len(rec.messages) == 1, "the huge message", limit=80)
        _, edge, data, release = rec.messages.pop()
        check(edge == 11 and data.nbytes == words * 8 + 4, f"huge message has {data.nbytes} bytes")
        got = np.frombuffer(data, dtype=np.uint64, count=words)
        step = 1 << 24
        for start in range(0, words, step):
            stop = min(words, start + step)
            check(np.array_equal(got[start:stop], np.arange(start, stop, dtype=np.uint64)),
                  f"huge message corrupt in words {start}..{stop}")
        check(bytes(data[words * 8:]) == b"tail", "huge message tail corrupt")
        del got
        release()
    ch.close(60)
    ok(ch.rank)


def scenario_many_parts() -> None:
    """With the smallest buffer_size a header announces at most 7 segments: a message with more large
    parts goes as one non-contiguous (hindexed) send; fewer parts go as segments. Both ways, both
    directions, contents checked."""
    ch, rec = make_channel(buffer_size=64, buffer_count=4, mpi_shared_memory=False)
    peer = 1 - ch.rank
    shapes = [[70_000] * 10, [70_000, 5, 100_000, 0, 3], [1] * 300, [200_000] * 7 + [10]]
    got: list[bool] = []

    def on_message(src: int, edge: int, data: memoryview, release: Callable[[], None]) -> None:
        i = len(got)
        want = b"".join(payload(peer, ch.rank, i, j, n) for j, n in enumerate(shapes[i]))
        got.append(src == peer and edge == 5 and bytes(data) == want)
        release()

    rec.on_message_hook = on_message
    for i, sizes in enumerate(shapes):
        parts = [payload(ch.rank, peer, i, j, n) for j, n in enumerate(sizes)]
        spin(ch, lambda parts=parts, i=i: ch.send(peer, 5, parts, token=i), f"credit for message {i}")
    spin(ch, lambda: len(got) == len(shapes) and len(rec.sent) == len(shapes), "all messages")
    check(all(got), f"corrupt messages: {[i for i, g in enumerate(got) if not g]}")
    check(sorted(rec.sent) == list(range(len(shapes))), f"on_sent tokens {rec.sent}")
    check(ch.stats["noncontiguous_sent"] == 2, f"expected 2 hindexed sends: {ch.stats}")
    ch.close(20)
    ok(ch.rank)
