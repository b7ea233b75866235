"""Scenarios for the MPI channel, run under ``mpiexec`` by ``test_mpi_channel.py``.

Usage: ``mpiexec -n N python tests/channels/mpi_scenarios.py SCENARIO``. Every rank prints one line
``OK <scenario> rank=<r> <json details>`` on success; any failed check raises, so the rank exits
non-zero and hydra ends the job. Payloads are derived from a seeded generator per
(source, destination, edge, sequence number); receivers regenerate them independently and compare
digests, which checks contents and per (peer, edge) order at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from collections import deque
from typing import Any, Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SCENARIO = sys.argv[1] if len(sys.argv) > 1 else "mixed"
if SCENARIO == "funneled":
    import mpi4py
    mpi4py.rc.thread_level = "funneled"
elif SCENARIO == "selfinit":
    import mpi4py
    mpi4py.rc.initialize = False

from twisternet.config import load_config  # noqa: E402
from twisternet.errors import ClosedError, ConfigError, PeerLostError, TwisternetError  # noqa: E402

import channels.mpi as mpich  # noqa: E402
from channels import shm_slots  # noqa: E402

#: Safety net: no scenario may run longer than this (the pytest side has its own timeout too).
DEADLINE = time.monotonic() + float(os.environ.get("MPI_SCENARIO_DEADLINE", "100"))


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def payload(src: int, dst: int, edge: int, seq: int, size: int) -> bytes:
    """The reference contents of message ``seq`` from ``src`` to ``dst`` on ``edge``."""
    return np.random.default_rng([src, dst, edge % 1000003, seq]).bytes(size)


def digest(data: Any) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def split_parts(data: bytes, rng: np.random.Generator) -> list[Any]:
    """Cut ``data`` into 1-4 parts of assorted buffer types (including empty parts)."""
    n = len(data)
    k = int(rng.integers(1, 5))
    cuts = sorted(int(c) for c in rng.integers(0, n + 1, size=k - 1)) if n else [0] * (k - 1)
    bounds = [0, *cuts, n]
    parts: list[Any] = []
    for i in range(k):
        piece = data[bounds[i]:bounds[i + 1]]
        kind = (i + int(rng.integers(0, 4))) % 4
        if kind == 0:
            parts.append(piece)
        elif kind == 1:
            parts.append(bytearray(piece))
        elif kind == 2:
            padded = b"#" + piece + b"#"
            parts.append(memoryview(padded)[1:1 + len(piece)])
        else:
            arr = np.frombuffer(piece, dtype=np.uint8)
            if len(piece) % 4 == 0 and len(piece):
                arr = arr.view(np.float32).reshape(-1, 2) if len(piece) % 8 == 0 else arr.view(np.float32)
            parts.append(arr)
    return parts


class Recorder:
    """A ChannelHandler that records everything the channel reports."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.messages: list[tuple[int, int, memoryview, Callable[[], None]]] = []
        self.credits: list[tuple[int, int]] = []
        self.sent: list[object] = []
        self.lost: dict[int, str] = {}
        self.on_message_hook: Callable[[int, int, memoryview, Callable[[], None]], None] | None = None

    def on_message(self, peer: int, edge: int, data: memoryview, release: Callable[[], None]) -> None:
        if self.on_message_hook is not None:
            self.on_message_hook(peer, edge, data, release)
        else:
            self.messages.append((peer, edge, data, release))

    def on_credit(self, peer: int, edge: int) -> None:
        self.credits.append((peer, edge))

    def on_sent(self, token: object) -> None:
        self.sent.append(token)

    def on_peer_lost(self, peer: int, reason: str) -> None:
        self.lost[peer] = reason


def make_channel(comm: Any = None, **cfg: Any) -> tuple[mpich.MPIChannel, Recorder]:
    config = load_config(env={}, **cfg)
    ch = mpich.create_channel(config, comm=comm)
    rec = Recorder(ch.rank)
    ch.start(rec)
    return ch, rec


def spin(ch: mpich.MPIChannel, cond: Callable[[], bool], what: str, limit: float = 60.0) -> None:
    """Progress until ``cond()``; fail naming ``what`` after ``limit`` seconds."""
    end = min(time.monotonic() + limit, DEADLINE)
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"rank {ch.rank}: timed out waiting for {what}")
        ch.progress(0.002)


def ok(rank: int, **details: Any) -> None:
    print(f"OK {SCENARIO} rank={rank} {json.dumps(details, sort_keys=True)}", flush=True)


class Traffic:
    """Sends a planned set of messages to every peer on several edges, obeying credit, while
    checking what arrives against the reference payloads."""

    def __init__(self, ch: mpich.MPIChannel, rec: Recorder, edges: list[int],
                 plan: Callable[[int, int, int], list[int]], hold: int = 0, seed: int = 0,
                 lead: int | None = None) -> None:
        self.ch, self.rec = ch, rec
        self.lead = lead  # if set: message n goes only once n - lead messages came back (same plan both ways)
        self.rng = np.random.default_rng([seed, ch.rank])
        me, world = ch.rank, ch.world
        self.outq: dict[tuple[int, int], deque[tuple[int, list[Any]]]] = {}
        self.expected: dict[tuple[int, int], list[int]] = {}
        self.tokens: set[tuple[int, int, int]] = set()
        for peer in range(world):
            if peer == me:
                continue
            for edge in edges:
                sizes = plan(me, peer, edge)
                self.outq[(peer, edge)] = deque((i, [s]) for i, s in enumerate(sizes))
                self.expected[(peer, edge)] = plan(peer, me, edge)
        self.next_seq = {k: 0 for k in self.expected}
        self.blocked: set[tuple[int, int]] = set()
        self.held: deque[tuple[memoryview, str, Callable[[], None]]] = deque()
        self.hold = hold
        self.refusals = 0
        rec.on_message_hook = self._on_message
        self.received_bytes = 0

    def _on_message(self, peer: int, edge: int, data: memoryview, release: Callable[[], None]) -> None:
        key = (peer, edge)
        check(key in self.expected, f"rank {self.ch.rank}: message on unexpected (peer, edge) {key}")
        seq = self.next_seq[key]
        sizes = self.expected[key]
        check(seq < len(sizes), f"rank {self.ch.rank}: extra message from {peer} on edge {edge}")
        check(data.nbytes == sizes[seq],
              f"rank {self.ch.rank}: message {seq} from {peer} edge {edge}: {data.nbytes} bytes, "
              f"expected {sizes[seq]}")
        want = digest(payload(peer, self.ch.rank, edge, seq, sizes[seq]))
        check(digest(data) == want, f"rank {self.ch.rank}: message {seq} from {peer} edge {edge} corrupt "
                                    "or out of order")
        self.next_seq[key] = seq + 1
        self.received_bytes += data.nbytes
        self.held.append((data, want, release))
        while len(self.held) > self.hold:
            self._release_one()

    def _release_one(self) -> None:
        data, want, release = self.held.popleft()
        # The buffer must still hold the message until release: catches early reuse by the channel.
        check(digest(data) == want, f"rank {self.ch.rank}: message data changed before release")
        release()

    def pump(self) -> None:
        for key in self.rec.credits:
            self.blocked.discard(key)
        self.rec.credits.clear()
        for key, q in self.outq.items():
            if key in self.blocked:
                continue
            while q:
                seq, spec = q[0]
                peer, edge = key
                if self.lead is not None and seq > self.next_seq[key] + self.lead:
                    break
                if isinstance(spec[0], int):
                    data = payload(self.ch.rank, peer, edge, seq, spec[0])
                    spec[0] = split_parts(data, self.rng)
                token = (peer, edge, seq)
                if not self.ch.send(peer, edge, spec[0], token=token):
                    self.blocked.add(key)
                    self.refusals += 1
                    break
                self.tokens.add(token)
                q.popleft()

    def done_sending(self) -> bool:
        return not any(self.outq.values())

    def done_receiving(self) -> bool:
        return all(self.next_seq[k] == len(v) for k, v in self.expected.items())

    def run(self, limit: float = 60.0) -> None:
        end = min(time.monotonic() + limit, DEADLINE)
        while not (self.done_sending() and self.done_receiving()):
            if time.monotonic() > end:
                missing = {str(k): (self.next_seq[k], len(v)) for k, v in self.expected.items()
                           if self.next_seq[k] != len(v)}
                raise AssertionError(f"rank {self.ch.rank}: traffic timed out; unsent="
                                     f"{sum(len(q) for q in self.outq.values())} missing={missing}")
            self.pump()
            self.ch.progress(0.001)
            if self.held and self.rng.random() < 0.3:
                self._release_one()
        while self.held:
            self._release_one()

    def check_tokens(self) -> None:
        reported = [t for t in self.rec.sent]
        check(len(reported) == len(set(reported)), f"rank {self.ch.rank}: a token was reported twice")
        check(set(reported) == self.tokens,
              f"rank {self.ch.rank}: on_sent tokens differ: missing {len(self.tokens - set(reported))}")


# --- scenarios -----------------------------------------------------------------------------------

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
        spin(ch, lambda: ch.send(peer, 5, parts, token=i), f"credit for message {i}")
    spin(ch, lambda: len(got) == len(shapes) and len(rec.sent) == len(shapes), "all messages")
    check(all(got), f"corrupt messages: {[i for i, g in enumerate(got) if not g]}")
    check(sorted(rec.sent) == list(range(len(shapes))), f"on_sent tokens {rec.sent}")
    check(ch.stats["noncontiguous_sent"] == 2, f"expected 2 hindexed sends: {ch.stats}")
    ch.close(20)
    ok(ch.rank)


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
            spin(ch, lambda: ch.send(1, 2, [head, part]), "credit")
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
        spin(ch, lambda: len(rec.messages) > i, f"message {i}")
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
    recycle those buffers, while buffers nobody views any more are recycled."""
    bs = 64 << 10
    ch, rec = make_channel(buffer_size=bs, buffer_count=4, mpi_shared_memory=False)
    sizes = [bs - 100, 3 * bs, 2 << 20] * 6  # zero-copy eager, rendezvous, bigger rendezvous
    if ch.rank == 0:
        for i, n in enumerate(sizes):
            spin(ch, lambda: ch.send(1, 1, [payload(0, 1, 1, i, n)]), f"credit for message {i}")
        spin(ch, lambda: not ch.has_pending(), "sends to complete")
        check(ch.send(1, 2, [b"phase 2"]), "send refused")
        for i, n in enumerate(sizes):  # phase 2: the receiver keeps nothing
            spin(ch, lambda: ch.send(1, 3, [payload(0, 1, 3, i, n)]), f"credit for message {i}")
        ok(0)
    else:
        kept = []
        rec.on_message_hook = lambda p, e, d, r: (kept.append((e, np.frombuffer(d, np.uint8))), r())
        spin(ch, lambda: len(kept) == len(sizes) + 1, "phase 1")
        for i, n in enumerate(sizes):
            check(kept[i][1].tobytes() == payload(0, 1, 1, i, n), f"kept view {i} was overwritten")
        reused_before = ch.stats["rndv_buffers_reused"]
        kept.clear()
        rec.on_message_hook = lambda p, e, d, r: (kept.append(bytes(d[:1])), r())
        spin(ch, lambda: len(kept) == len(sizes), "phase 2")
        check(ch.stats["rndv_buffers_reused"] > reused_before, "released, unviewed buffers were not recycled")
        ok(1, reused=ch.stats["rndv_buffers_reused"])
    ch.close(20)


def in_slot(data: memoryview) -> bool:
    """Whether a delivered message is a view of a shared-memory slot (a slice of an mmap'ed array)."""
    import mmap
    base = data.obj
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)


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


def slot_files(pid: int) -> list[str]:
    """The shared-memory slot files a process created that still have a name."""
    import glob
    return glob.glob(os.path.join(shm_slots.SHM_DIR, f"{shm_slots.PREFIX}{pid}-*"))


def scenario_slots() -> None:
    """Large messages between ranks on one host go through shared-memory slots, both directions at
    once: sizes that outgrow the slots (bigger ones offered, the old ones retired) and then the largest
    size slots take (those go through MPI, in order with the rest), multi-part messages, eager messages on the same edge keeping their place behind slot
    messages, a consumer holding messages (slots busy: some sends go through MPI meanwhile) and keeping
    views after release (their slots are retired, never refilled); contents checked end to end and
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
            spin(ch, lambda: ch.send(1, 4, [payload(0, 1, 4, i, mb)]), f"message {i}")
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


def ch_rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()


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
        for e, d, r in [h for h in held if h[0] == 2]:
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


def scenario_mpi_error() -> None:
    """An MPI error on a request (here: rank 1 sends an oversized message into rank 0's control
    receive, so MPI reports truncation) makes rank 0 report rank 1 lost; the rest carries on."""
    ch, rec = make_channel(buffer_size=16 << 10)
    if ch.rank == 1:
        ch.comm.Send(b"z" * 10000, 0, mpich.TAG_CTRL)
        ch.close(1.0)  # rank 0 no longer talks to us: its goodbye never comes
        check(not rec.lost, f"rank 1 should not lose anyone: {rec.lost}")
        ok(1)
        return
    if ch.rank == 0:
        spin(ch, lambda: 1 in rec.lost, "rank 1 to be reported lost", limit=20)
        check("truncat" in rec.lost[1].lower(), f"reason should name the MPI error: {rec.lost[1]!r}")
        try:
            ch.send(1, 0, [b"x"])
            raise AssertionError("send to a lost peer must raise")
        except PeerLostError:
            pass
    others = [p for p in range(ch.world) if p not in (ch.rank, 1)]
    for p in others:
        check(ch.send(p, 0, [b"still here"]), "send refused")
    spin(ch, lambda: len(rec.messages) == len(others), "messages from the survivors", limit=20)
    ch.close(10)
    check(set(rec.lost) == ({1} if ch.rank == 0 else set()), f"unexpected losses {rec.lost}")
    ok(ch.rank)


def scenario_config_mismatch() -> None:
    """Ranks that disagree on buffer_size get a clear ConfigError on every rank (not a truncation)."""
    from mpi4py import MPI
    size = 8192 if MPI.COMM_WORLD.rank == 1 else 4096
    try:
        mpich.create_channel(load_config(env={}, buffer_size=size))
        raise AssertionError("mismatched buffer_size must be refused")
    except ConfigError as e:
        check(e.key == "buffer_size" and "4096" in str(e) and "8192" in str(e), f"unclear error: {e}")
    ok(MPI.COMM_WORLD.rank)


def scenario_rank_dies() -> None:
    """Rank 1 dies (os._exit) in the middle of traffic: the launcher must end the job."""
    ch, rec = make_channel(buffer_size=16 << 10)
    print(f"READY rank={ch.rank}", flush=True)
    end = time.monotonic() + 0.3
    peer = (ch.rank + 1) % ch.world
    while True:
        ch.send(peer, 0, [b"x" * 1000])
        ch.progress(0.001)
        for *_, r in rec.messages:
            r()
        rec.messages.clear()
        if ch.rank == 1 and time.monotonic() > end:
            os._exit(7)
        check(time.monotonic() < DEADLINE, "survived the death of rank 1")


def scenario_mpi_abort() -> None:
    """Rank 2 calls MPI_Abort(3) while the others progress: the launcher must end the job."""
    from mpi4py import MPI
    ch, rec = make_channel()
    print(f"READY rank={ch.rank}", flush=True)
    if ch.rank == 2:
        time.sleep(0.2)
        MPI.COMM_WORLD.Abort(3)
    while time.monotonic() < DEADLINE:  # the others wait forever: only the launcher can end them
        ch.progress(0.01)
    raise AssertionError("survived the abort")


def scenario_funneled() -> None:
    """MPI granted only THREAD_FUNNELED: threaded progress is refused at start; manual progress from
    the main thread works; a call from another thread is refused."""
    from mpi4py import MPI
    check(MPI.Query_thread() == MPI.THREAD_FUNNELED, f"thread level is {MPI.Query_thread()}")
    config = load_config(env={}, progress="thread")
    ch0 = mpich.create_channel(config)
    check(ch0.requires_main_thread_progress, "requires_main_thread_progress should be True")
    try:
        ch0.start(Recorder(ch0.rank))
        raise AssertionError("start must refuse threaded progress under THREAD_FUNNELED")
    except ConfigError as e:
        check("THREAD_FUNNELED" in str(e) and "manual" in str(e), f"unclear message: {e}")
    ch0.close(1)
    ch, rec = make_channel(progress="manual")
    peer = 1 - ch.rank
    check(ch.send(peer, 1, [b"manual %d" % ch.rank]), "send refused")
    spin(ch, lambda: len(rec.messages) == 1, "a message")
    check(bytes(rec.messages[0][2]) == b"manual %d" % peer, "wrong message")
    rec.messages[0][3]()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            ch.progress(0)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=other)
    th.start()
    th.join(10)
    check(len(errors) == 1 and isinstance(errors[0], TwisternetError), f"other thread got {errors}")
    ch.close(10)
    ok(ch.rank)


def scenario_usercomm() -> None:
    """The channel on a split communicator: its world is the split, and the user's own traffic on
    that communicator with the channel's tag values never mixes with the channel's."""
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    sub = world.Split(color=world.rank % 2, key=world.rank)
    ch, rec = make_channel(comm=sub, buffer_size=4096)
    check(ch.world == sub.size and ch.rank == sub.rank, "rank/world must come from the communicator")
    peer = 1 - ch.rank
    user_reqs = [sub.Isend(b"user %d" % tag, peer, tag) for tag in (mpich.TAG_DATA, mpich.TAG_BULK, mpich.TAG_CTRL)]
    check(ch.send(peer, mpich.TAG_DATA, [b"chan small"]), "send refused")
    big = payload(sub.rank, peer, 0, 0, 100_000)
    check(ch.send(peer, 0, [big]), "send refused")
    spin(ch, lambda: len(rec.messages) == 2, "channel messages")
    got = {e: bytes(d) for _, e, d, _ in rec.messages}
    check(got == {mpich.TAG_DATA: b"chan small", 0: payload(peer, sub.rank, 0, 0, 100_000)},
          "channel messages wrong")
    for *_, r in rec.messages:
        r()
    for tag in (mpich.TAG_DATA, mpich.TAG_BULK, mpich.TAG_CTRL):
        buf = bytearray(32)
        st = MPI.Status()
        sub.Recv(buf, peer, tag, st)
        check(bytes(buf[:st.Get_count()]) == b"user %d" % tag, "user message wrong")
    MPI.Request.Waitall(user_reqs)
    ch.close(10)
    check(ch.comm == MPI.COMM_NULL, "the channel's communicator was not freed")
    sub.Free()
    ok(world.rank, sub_rank=ch.rank)


def scenario_selfinit() -> None:
    """mpi4py was told not to initialise MPI: the channel initialises it (asking for MULTIPLE)."""
    import atexit
    from mpi4py import MPI
    check(not MPI.Is_initialized(), "MPI should not be initialised yet")
    # Registered before the channel's hooks, so it runs after them: MPI must be finalized by then.
    atexit.register(lambda: print(f"AT EXIT finalized={MPI.Is_finalized()}", flush=True))
    ch, rec = make_channel()
    check(MPI.Is_initialized(), "create_channel did not initialise MPI")
    check(ch.thread_level == MPI.THREAD_MULTIPLE, f"thread level {ch.thread_level}")
    peer = 1 - ch.rank
    check(ch.send(peer, 0, [b"hi"]), "send refused")
    spin(ch, lambda: len(rec.messages) == 1, "a message")
    rec.messages[0][3]()
    ch.close(10)
    ok(ch.rank)


def scenario_wakeup() -> None:
    """``wakeup`` from another thread cuts a long progress wait short; an idle wait does not spin."""
    ch, rec = make_channel()
    timer = threading.Timer(0.2, ch.wakeup)
    start = time.monotonic()
    timer.start()
    ch.progress(20.0)
    woke = time.monotonic() - start
    timer.join()
    check(woke < 5.0, f"progress did not return after wakeup ({woke:.1f}s)")
    # Idle for 1.5 s: the backoff must keep CPU use well below a full core.
    cpu0, t0 = time.process_time(), time.monotonic()
    while time.monotonic() - t0 < 1.5:
        ch.progress(0.5)
    cpu = (time.process_time() - cpu0) / (time.monotonic() - t0)
    check(cpu < 0.6, f"idle progress used {cpu:.0%} of a core")
    # A message arriving while the peer waits is still seen (the wait polls).
    peer = 1 - ch.rank
    check(ch.send(peer, 0, [b"after idle"]), "send refused")
    spin(ch, lambda: len(rec.messages) == 1, "a message after idling")
    rec.messages[0][3]()
    ch.close(10)
    ok(ch.rank, woke_after=round(woke, 3), idle_cpu=round(cpu, 3))


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


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}

if __name__ == "__main__":
    import logging
    logging.basicConfig(level=os.environ.get("MPI_SCENARIO_LOG", "WARNING"),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if SCENARIO not in SCENARIOS:
        sys.exit(f"unknown scenario {SCENARIO!r}; known: {', '.join(sorted(SCENARIOS))}")
    SCENARIOS[SCENARIO]()
