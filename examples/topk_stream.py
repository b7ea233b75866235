"""Streaming top-k over an unbounded event stream with a streaming KeyedReduce.

    twisternet run -n 4 examples/topk_stream.py [--seconds S | --events N] [--k K]

Every worker produces a stream of item ids whose popularity drifts over time (a Zipf law over a slowly
rotating catalogue). A streaming KeyedReduce routes each ``(item, 1)`` to one of the destinations by key;
each destination keeps the running count of its items (delivered to a callback as ``(item, count)``
updates), and a streaming Gather carries every destination's current top k to rank 0, which prints the
global top k once a second. The stream is unbounded: it stops after ``--seconds`` (or ``--events`` per
worker) only so that the demo ends.
"""

from __future__ import annotations

import argparse
import heapq
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np

import twisternet as tn
from collectives import Gather, KeyedReduce


class TopK:
    """Running counts of one destination's items and their current top k (updated by the callback)."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.counts: dict[int, int] = {}
        self.lock = threading.Lock()
        self.updates = 0

    def on_update(self, task: int, item: tuple[int, int]) -> None:
        key, count = item
        with self.lock:
            self.counts[key] = count
            self.updates += 1

    def top(self) -> list[tuple[int, int]]:
        with self.lock:
            return heapq.nlargest(self.k, self.counts.items(), key=lambda kv: (kv[1], -kv[0]))


def events(rank: int, catalogue: int, seed: int = 7) -> Iterator[int]:
    """An endless stream of item ids; popular items drift as the catalogue rotates."""
    rng = np.random.default_rng([seed, rank])
    shift = 0
    while True:
        block = (rng.zipf(1.5, size=1024) - 1 + shift) % catalogue
        yield from block.tolist()
        shift += 1


def main(argv: list[str] | None = None) -> list[tuple[int, int]] | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="stop producing after this long")
    ap.add_argument("--events", type=int, default=0, help="stop after this many events per worker")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--catalogue", type=int, default=10_000)
    args = ap.parse_args(argv)

    with tn.init() as ctx:
        task = ctx.my_tasks[0]
        top = TopK(args.k)
        counts = KeyedReduce(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1, op="sum", key_type="int",
                             mode="streaming", callback=top.on_update, limit=10_000)
        reports = Gather(ctx, sources=ctx.tasks, destinations=[0], edge=2, mode="streaming", limit=1000)
        latest: dict[int, list[Sequence[int]]] = {}   # per worker: its top (item, count) pairs
        t0 = time.perf_counter()
        next_report, sent = t0 + 1.0, 0
        for item in events(ctx.rank, args.catalogue):
            counts.send(task, item, 1)
            sent += 1
            now = time.perf_counter()
            if now >= next_report or (args.events and sent >= args.events) or \
                    (not args.events and now - t0 >= args.seconds):
                reports.send(task, top.top())
                next_report = now + 1.0
                if ctx.rank == 0:
                    for src, part in reports.drain():
                        latest[src] = part
                    merged = heapq.nlargest(args.k, ((item, n) for p in latest.values() for item, n in p),
                                            key=lambda kv: (kv[1], -kv[0]))
                    print(f"[{now - t0:5.1f}s] top {args.k}: {merged}", flush=True)
                if (args.events and sent >= args.events) or (not args.events and now - t0 >= args.seconds):
                    break
        counts.finish(task)
        ctx.wait_until(lambda: counts.done(task), timeout=60)
        reports.send(task, top.top())       # final counts of this destination
        reports.finish(task)
        result = None
        if ctx.rank == 0:
            for src, part in reports.results():
                latest[src] = part
            result = heapq.nlargest(args.k, ((item, n) for p in latest.values() for item, n in p),
                                    key=lambda kv: (kv[1], -kv[0]))
            print(f"final top {args.k} after {time.perf_counter() - t0:.2f} s: {result}")
        counts.close()
        reports.close()
        return result


if __name__ == "__main__":
    main()
