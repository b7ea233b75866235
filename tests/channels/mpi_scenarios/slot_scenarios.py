"""Scenarios: the shared-memory slot protocol between ranks on one host (slots, split copies,
deferred messages, a rank that refuses slots)."""

from __future__ import annotations

import os
import time
from typing import Any
from collections.abc import Callable

import numpy as np
from tests.channels.mpi_scenarios.helpers import (
    Traffic,
    ch_rank,
    check,
    digest,
    in_slot,
    make_channel,
    ok,
    payload,
    slot_files,
    spin,
)


class KeepTraffic(Traffic):
    """Traffic whose consumer keeps a view of every ``keep_every``-th message it got in a shared-memory
    slot after releasing it (as a program keeping a decoded array would): that memory must never be
    written again."""

    def __init__(self, *args: Any, keep_every: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.keep_every = keep_every
        self.kept: list[tuple[memoryview, str]] = []
        self.in_slots = 0

    def _release_one(self) -> None:
        data, want, _ = self.held[0]
        super()._release_one()
        if in_slot(data):
            self.in_slots += 1
            if self.in_slots % self.keep_every == 0:
                self.kept.append((data, want))

    def check_kept(self, when: str) -> None:
        for i, (data, want) in enumerate(self.kept):
            check(digest(data) == want, f"rank {self.ch.rank}: view {i} kept after release was overwritten {when}")


def scenario_slots() -> None:
    """Large messages between ranks on one host go through shared-memory slots, both directions at
    once: sizes that outgrow the slots (bigger ones offered, the old ones retired) and then the largest size
    slots take (those go through MPI, in order with the rest), multi-part messages, eager messages on the same
    edge keeping their place behind slot messages, a consumer holding messages (slots busy: some sends go
    through MPI meanwhile) and keeping views after release (their slots are retired, never refilled); contents
    checked end to end and
    up to each release; close leaves no slot file behind."""
    ch, rec = make_channel()
    mb = 1 << 20
    big = ([2 * mb] * 8 + [100, 2 * mb + 5, 0] + [5 * mb] * 8 + [17] + [7 * mb] * 6 + [9 * mb] * 4
           + [2 * mb, 1 * mb + 1, 4 * mb, 6] + [3 * mb] * 6 + [70 * mb, 5] + [9 * mb + 3] * 3)

    def plan(src: int, dst: int, edge: int) -> list[int]:
        return big if edge == 5 else [int(x) for x in np.random.default_rng([src, dst]).integers(0, 300 << 10, 30)]

    t = KeepTraffic(ch, rec, [5, 6], plan, hold=1, seed=4, keep_every=3, lead=1)
    t.run()
    t.check_kept("by later messages")
    stats = dict(ch.stats)
    peer = 1 - ch.rank
    pids = ch.comm.allgather(os.getpid())
    ch.close(30)
    t.check_tokens()
    t.check_kept("at close")
    check(not rec.lost, f"peers reported lost: {rec.lost}")
    # (a consumer that holds messages keeps slots busy, so part of the traffic goes through MPI)
    check(stats["slot_sent"] >= 8 and stats["slot_received"] >= 8, f"slots hardly used: {stats}")
    check(t.in_slots == stats["slot_received"], f"{t.in_slots} slot views for {stats['slot_received']} slot messages")
    check(len(t.kept) >= 2, f"only {len(t.kept)} views of slots kept")
    check(stats["slots_retired"] >= 2, f"no slot was retired (outgrown or kept): {stats}")
    check(stats["slot_offers"] >= 3, f"slots never grew: {stats}")
    check(stats["slot_deferred"] >= 1, f"no message ever waited for its slot: {stats}")
    check(stats["slot_split"] >= 1, f"no message was copied in two halves: {stats}")
    check(not ch._slots_in.slots_of(peer) and not ch._slots_out.slots_of(peer), "slots left after close")
    ch_done = time.monotonic() + 5
    while slot_files(pids[ch.rank]) and time.monotonic() < ch_done:
        time.sleep(0.05)
    check(not slot_files(pids[ch.rank]), f"slot files left behind: {slot_files(pids[ch.rank])}")
    ok(ch.rank, **{k: stats[k] for k in ("slot_sent", "slot_received", "slot_offers", "slots_retired",
                                         "rendezvous_sent", "slot_deferred", "slot_wait_timeouts",
                                         "send_refused", "slot_split")})


def scenario_slots_split() -> None:
    """Messages over 8 MB go into a slot in two parts copied at once (the sender's memcpy and MPI's
    copy by the receiver), one-part and multi-part, both directions in step: every byte arrives, in
    order, and the sender gets on_sent only once both parts are in."""
    ch, rec = make_channel()
    mb = 1 << 20

    def plan(src: int, dst: int, edge: int) -> list[int]:
        return [9 * mb] * 2 + [12 * mb] * 6 + [20 * mb + 5] * 3 + [7, 12 * mb - 1]

    t = Traffic(ch, rec, [8], plan, hold=0, seed=7, lead=0)
    t.run()
    stats = dict(ch.stats)
    ch.close(30)
    t.check_tokens()
    check(not rec.lost, f"peers reported lost: {rec.lost}")
    check(stats["slot_split"] >= 6, f"messages were hardly split: {stats}")
    ok(ch.rank, **{k: stats[k] for k in ("slot_split", "slot_sent", "rendezvous_sent")})


def scenario_slots_deferred_then_close() -> None:
    """A message waiting for a slot (its consumer holds the last one) is held back, a smaller message
    on its edge is refused meanwhile (no overtaking), and a close that comes while it waits sends it
    through MPI before the goodbye: the peer gets everything, in order."""
    ch, rec = make_channel()
    mb = 2 << 20
    got: list[tuple[int, memoryview, Callable[[], None]]] = []
    rec.on_message_hook = lambda p, e, d, r: got.append((e, d, r))
    if ch.rank == 0:
        for i in range(2):                        # through MPI, then the slots are offered
            spin(ch, lambda i=i: ch.send(1, 4, [payload(0, 1, 4, i, mb)]), f"message {i}")
        spin(ch, lambda: len(ch._slots_out.slots_of(1)) == 2 and got, "rank 1's slots")
        got.clear()
        check(ch.send(1, 4, [payload(0, 1, 4, 2, mb)], token="in-slot"), "message 2 refused")
        spin(ch, lambda: rec.sent == ["in-slot"], "message 2 to go into a slot")
        check(ch.stats["slot_sent"] == 1, f"message 2 did not go into a slot: {ch.stats}")
        check(ch.send(1, 4, [payload(0, 1, 4, 3, mb)], token="deferred"), "message 3 refused")
        check(ch.stats["slot_deferred"] == 1 and ch.has_pending(1), f"message 3 is not waiting: {ch.stats}")
        check(not ch.send(1, 4, [b"small"]), "a small message overtook the one waiting for a slot")
        check(ch.send(1, 5, [b"other edge"]), "another edge must not wait")
        ch.close(30)                              # message 3 goes through MPI before the goodbye
        check("deferred" in rec.sent, "message 3 was never sent")
        check(ch.stats["slot_refused"] == 1, f"{ch.stats}")
        ok(0, rendezvous_sent=ch.stats["rendezvous_sent"])
    else:
        spin(ch, lambda: len(got) == 2, "messages 0 and 1")
        for _, _, r in got:
            r()
        check(ch.send(0, 9, [b"ready"]), "ready refused")
        got.clear()
        spin(ch, lambda: len([g for g in got if g[0] == 4]) == 2, "messages 2 and 3")   # holds message 2 meanwhile
        big = [(d, r) for e, d, r in got if e == 4]
        for i, (d, _) in enumerate(big):
            check(digest(d) == digest(payload(0, 1, 4, i + 2, mb)), f"message {i + 2} corrupt or out of order")
        check(any(bytes(d) == b"other edge" for e, d, _ in got if e == 5), "the other edge's message is missing")
        for _, _, r in got:
            r()
        ch.close(30)
        check(ch.stats["slot_received"] == 1, f"{ch.stats}")
        ok(1)


def scenario_slots_refused() -> None:
    """Rank 1 may not use shared memory: it refuses rank 0's slot offers, rank 0 offers no more, and
    every message still arrives (through MPI) in order, both directions; no file is left behind."""
    ch, rec = make_channel(mpi_shared_memory=(ch_rank() == 0))
    mb = 1 << 20

    def plan(src: int, dst: int, edge: int) -> list[int]:
        return [2 * mb, 7, 3 * mb, 2 * mb, 4 * mb, 1, 2 * mb, 5 * mb, 2 * mb]

    t = Traffic(ch, rec, [2], plan, hold=1, seed=5)
    t.run()
    # rank 1 keeps going until rank 0 heard its refusal (it may have been still in flight)
    done: list[bytes] = []
    rec.on_message_hook = lambda p, e, d, r: (done.append(bytes(d)), r())
    if ch.rank == 0:
        spin(ch, lambda: ch._slots_in.disabled(1), "rank 1's refusal")
        check(ch.send(1, 9, [b"done"]), "done refused")
    else:
        spin(ch, lambda: done == [b"done"], "rank 0's done")
    stats = dict(ch.stats)
    ch.close(30)
    t.check_tokens()
    check(not rec.lost, f"peers reported lost: {rec.lost}")
    check(stats["slot_sent"] == 0 and stats["slot_received"] == 0, f"a slot was used: {stats}")
    if ch.rank == 0:
        check(stats["slot_offers"] == 2, f"rank 0 should offer one round (two slots), then stop: {stats}")
    else:
        check(stats["slot_offers"] == 0, f"rank 1 may not offer slots: {stats}")
    check(not slot_files(os.getpid()), f"slot files left behind: {slot_files(os.getpid())}")
    ok(ch.rank, **{k: stats[k] for k in ("slot_offers", "rendezvous_sent")})
