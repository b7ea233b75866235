"""Shared parts of the MPI channel scenarios (``run.py`` runs one of them under ``mpiexec``): the
reference payloads, a recording handler, channel set-up, progress loops and the ``Traffic`` driver.

Payloads are derived from a seeded generator per (source, destination, edge, sequence number);
receivers regenerate them independently and compare digests, which checks contents and per
(peer, edge) order at once. Every rank prints one line ``OK <scenario> rank=<r> <json details>`` on
success (:func:`ok`); any failed check raises, so the rank exits non-zero and hydra ends the job.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import deque
from typing import Any
from collections.abc import Callable

import numpy as np

import channels.mpi as mpich
from channels import shm_slots
from twisternet.config import load_config

#: The scenario this process runs (``run.py``'s argument).
SCENARIO = sys.argv[1] if len(sys.argv) > 1 else "mixed"

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


def in_slot(data: memoryview) -> bool:
    """Whether a delivered message is a view of a shared-memory slot (a slice of an mmap'ed array)."""
    import mmap
    base = data.obj
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)


def slot_files(pid: int) -> list[str]:
    """The shared-memory slot files a process created that still have a name."""
    import glob
    return glob.glob(os.path.join(shm_slots.SHM_DIR, f"{shm_slots.PREFIX}{pid}-*"))


def ch_rank() -> int:
    from mpi4py import MPI
    return MPI.COMM_WORLD.Get_rank()
