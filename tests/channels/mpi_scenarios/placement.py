"""Scenarios: where rendezvous payloads land (page offsets, recycled buffers), payloads into
pre-posted receives, and consumers that keep zero-copy views after release."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import numpy as np
from tests.channels.mpi_scenarios.helpers import Traffic, check, make_channel, ok, payload, spin


def scenario_page_placement() -> None:
    """A rendezvous payload lands at the same offset within a page as the sender's largest part (the
    offset travels in the header), whatever the prefix before it, contents intact; and a payload
    larger than half memory_limit (and than twice the credit) is received into a recycled buffer the
    second time (idle buffers are bounded by twice memory_limit, as in the TCP channel)."""
    ch, rec = make_channel(buffer_size="64K", buffer_count=4, memory_limit="32M", mpi_shared_memory=False)
    big = np.arange(3 << 20, dtype=np.uint8)          # 3 MiB: rendezvous, one at a time (credit 256K)
    skews = (0, 1, 38, 4095, 5000)
    if ch.rank == 0:
        offsets = []
        for skew in skews:
            part = big[skew:]
            offsets.append(part.ctypes.data % 4096)
            head = bytes(range(skew % 251)) + b"h"       # joined into a small segment of its own
            spin(ch, lambda head=head, part=part: ch.send(1, 2, [head, part]), "credit")
        huge = np.ones(40 << 20, np.uint8)
        for _ in range(2):
            spin(ch, lambda: ch.send(1, 3, [huge]), "credit")
        spin(ch, lambda: not ch.has_pending(), "sends")
        ch.close(30)
        ok(0, offsets=offsets)
        return
    offsets = []
    reused = []
    for i in range(len(skews) + 2):
        spin(ch, lambda i=i: len(rec.messages) > i, f"message {i}")
        _, edge, data, release = rec.messages[i]
        arr = np.frombuffer(data, np.uint8)
        if i < len(skews):
            skew = skews[i]
            head_len = skew % 251 + 1
            check(bytes(data[:head_len]) == bytes(range(skew % 251)) + b"h", "prefix")
            body = arr[head_len:]
            check(np.array_equal(body, big[skew:]), "payload")
            offsets.append(body.ctypes.data % 4096)
        else:
            check(arr.nbytes == 40 << 20 and arr.min() == 1, "huge payload")
            reused.append(ch.stats["rndv_buffers_reused"])
        del arr, data
        rec.messages[i] = None                          # nothing refers to the buffer any more
        release()
    ch.close(30)
    ok(1, offsets=offsets, huge_reused=reused[1] - reused[0])


class PrepostTraffic(Traffic):
    """Traffic whose big messages on edge 5 are a small head plus one array placed at a chosen offset
    within a page (the shape that uses pre-posted receives); other messages as in Traffic."""

    def __init__(self, *args: Any, offsets: Callable[[int], int], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.offsets = offsets

    def pump(self) -> None:
        for key, q in self.outq.items():
            for seq, spec in q:
                if key[1] != 5 or not isinstance(spec[0], int) or spec[0] <= 100:
                    continue
                data = payload(self.ch.rank, key[0], key[1], seq, spec[0])
                off = self.offsets(seq)
                store = np.empty(len(data) + 2 * 4096, np.uint8)
                start = off - store.ctypes.data % 4096 + 4096
                body = store[start:start + len(data) - 100]
                body[:] = np.frombuffer(data, np.uint8)[100:]
                spec[0] = [data[:100], body]
        super().pump()


def scenario_preposted() -> None:
    """Payloads into pre-posted receives, both directions at once: a stream of one-segment payloads
    (a small head riding inline) makes the receiver offer them; payloads that outgrow the offer go
    the usual way, then use skips; eager messages on the same edge keep their place; a consumer that
    holds buffers gets receives posted on demand; a payload placed elsewhere within a page goes the
    usual way; contents and order checked end to end; close cancels what was posted ahead."""
    ch, rec = make_channel(buffer_size="64K", buffer_count=8, mpi_shared_memory=False)
    mb = 1 << 20
    big = ([2 * mb] * 6 + [5, 2 * mb, 0, 2 * mb - 7] + [3 * mb] * 4 + [9 * mb] * 3 + [2 * mb, 100, 2 * mb]
           + [2 * mb] * 4 + [2 * mb] * 3)
    moved = range(len(big) - 7, len(big) - 3)       # these four sit elsewhere in a page

    def plan(src: int, dst: int, edge: int) -> list[int]:
        return big if edge == 5 else [int(x) for x in np.random.default_rng([src, dst]).integers(0, 60 << 10, 30)]

    t = PrepostTraffic(ch, rec, [5, 6], plan, hold=2, seed=3, offsets=lambda seq: 1000 if seq in moved else 16)
    t.run()
    stats = dict(ch.stats)
    posted_ahead = sum(len(q) for q in ch._pre_q)
    ch.close(30)
    t.check_tokens()
    check(not rec.lost, f"peers reported lost: {rec.lost}")
    check(stats["pre_sent"] >= 12, f"pre-posted receives hardly used: {stats}")
    check(stats["pre_received"] == stats["pre_sent"], f"both directions carry the same plan: {stats}")
    check(stats["pre_skips"] >= 1, f"the growing payloads never skipped: {stats}")
    check(posted_ahead <= 1, f"{posted_ahead} receives posted ahead for one peer")
    check(all(not q for q in ch._pre_q), "pre-posted receives left after close")
    ok(ch.rank, **{k: stats[k] for k in ("pre_sent", "pre_received", "pre_skips", "rendezvous_sent")})


def scenario_keep_views() -> None:
    """A consumer may keep zero-copy views (e.g. decoded arrays) after release: the channel must not
    recycle those buffers, while buffers nobody views any more are recycled (rendezvous buffers, and
    the buffers eager messages of 64 KB up to half a pool buffer are copied into)."""
    bs = 256 << 10
    ch, rec = make_channel(buffer_size=bs, buffer_count=4, mpi_shared_memory=False)
    check(ch._copy_limit == 128 << 10, f"copy limit {ch._copy_limit}")
    # zero-copy eager, rendezvous, bigger rendezvous, eager copied into a recycled buffer
    sizes = [bs - 100, 3 * bs, 2 << 20, 100 << 10] * 6
    if ch.rank == 0:
        for i, n in enumerate(sizes):
            spin(ch, lambda i=i, n=n: ch.send(1, 1, [payload(0, 1, 1, i, n)]), f"credit for message {i}")
        spin(ch, lambda: not ch.has_pending(), "sends to complete")
        check(ch.send(1, 2, [b"phase 2"]), "send refused")
        # phase 2 starts once the receiver has checked phase 1 (its messages would otherwise land
        # among the views it checks: a poll delivers every message that has arrived)
        ready = []
        rec.on_message_hook = lambda p, e, d, r: (ready.append(bytes(d)), r())
        spin(ch, lambda: bool(ready), "the receiver to be ready for phase 2")
        for i, n in enumerate(sizes):  # phase 2: the receiver keeps nothing
            spin(ch, lambda i=i, n=n: ch.send(1, 3, [payload(0, 1, 3, i, n)]), f"credit for message {i}")
        # the wire buffers of the eager messages of 64 KB and up went back to their cache once sent
        check(ch.stats["wire_buffers_reused"] > 0, "the wire buffers of large eager messages were not reused")
        ok(0, wires_reused=ch.stats["wire_buffers_reused"])
    else:
        kept = []
        rec.on_message_hook = lambda p, e, d, r: (kept.append((e, np.frombuffer(d, np.uint8))), r())
        spin(ch, lambda: len(kept) == len(sizes) + 1, "phase 1")
        for i, n in enumerate(sizes):
            check(kept[i][1].tobytes() == payload(0, 1, 1, i, n), f"kept view {i} was overwritten")
        reused_before = ch.stats["rndv_buffers_reused"]
        copies_before = ch.stats["copy_buffers_reused"]
        kept.clear()
        rec.on_message_hook = lambda p, e, d, r: (kept.append(bytes(d)), r())
        check(ch.send(0, 4, [b"ready"]), "send refused")
        spin(ch, lambda: len(kept) == len(sizes), "phase 2")
        for i, n in enumerate(sizes):
            check(kept[i] == payload(0, 1, 3, i, n), f"phase 2 message {i} corrupt")
        check(ch.stats["rndv_buffers_reused"] > reused_before, "released, unviewed buffers were not recycled")
        check(ch.stats["copy_buffers_reused"] > copies_before, "released, unviewed copies were not recycled")
        ok(1, reused=ch.stats["rndv_buffers_reused"], copies_reused=ch.stats["copy_buffers_reused"])
    ch.close(20)
