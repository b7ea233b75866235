"""Word count with a batch KeyedReduce — the README demo.

    twisternet run -n 4 examples/wordcount.py [FILE] [--words N] [--top K]
    mpirun -n 4 python examples/wordcount.py

Each worker counts its share of the words (every world-th line of FILE, or a deterministic generated
text when no file is given); KeyedReduce routes every word to one destination by a stable hash, combining
counts at each tree node on the way; each destination then sends its local top K to rank 0 (Gather),
which prints the overall top K and the time taken.
"""

from __future__ import annotations

import argparse
import heapq
import time

import numpy as np

import twisternet as tn
from collectives import Gather, KeyedReduce

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "ve", "zu", "an", "or"]


def vocabulary(size: int) -> list[str]:
    """``size`` distinct made-up words, the same in every process."""
    words: list[str] = []
    n = 0
    while len(words) < size:
        i, w = n, ""
        while True:
            w += SYLLABLES[i % len(SYLLABLES)]
            i //= len(SYLLABLES)
            if i == 0:
                break
        words.append(w)
        n += 1
    return words


def generated_words(rank: int, world: int, total: int, seed: int = 42) -> list[str]:
    """This rank's share of a deterministic Zipf-distributed text of ``total`` words."""
    vocab = vocabulary(5000)
    share = total // world + (1 if rank < total % world else 0)
    rng = np.random.default_rng([seed, rank])
    ranks = (rng.zipf(1.3, size=share) - 1) % len(vocab)
    return [vocab[i] for i in ranks.tolist()]


def file_words(path: str, rank: int, world: int) -> list[str]:
    """Words of every ``world``-th line of ``path``, starting at line ``rank``."""
    out: list[str] = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f):
            if i % world == rank:
                out.extend(w.strip(".,;:!?\"'()[]").lower() for w in line.split())
    return [w for w in out if w]


def main(argv: list[str] | None = None) -> list[tuple[str, int]] | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", nargs="?", help="text file to count (default: generated text)")
    ap.add_argument("--words", type=int, default=400_000, help="words to generate without a file")
    ap.add_argument("--top", type=int, default=10)
    args = ap.parse_args(argv)

    with tn.init() as ctx:
        words = file_words(args.file, ctx.rank, ctx.world) if args.file else \
            generated_words(ctx.rank, ctx.world, args.words)
        t0 = time.perf_counter()
        counts = KeyedReduce(ctx, sources=ctx.tasks, destinations=ctx.tasks, edge=1,
                             op="sum", key_type="str", mode="batch")
        top = Gather(ctx, sources=ctx.tasks, destinations=[0], edge=2, mode="batch")
        task = ctx.my_tasks[0]
        for w in words:
            counts.send(task, w, 1)            # blocks (while progressing) under back pressure
        counts.finish(task)
        mine = heapq.nlargest(args.top, counts.results(task), key=lambda kv: (kv[1], kv[0]))
        for word, n in mine:
            top.send(task, (word, n))
        top.finish(task)
        best = None
        if ctx.rank == 0:
            best = heapq.nlargest(args.top, (wn for _src, wn in top.results()), key=lambda kv: (kv[1], kv[0]))
            elapsed = time.perf_counter() - t0
            total = sum(1 for _ in words) * ctx.world
            print(f"top {args.top} words ({ctx.world} workers, ~{total} words, {elapsed:.2f} s):")
            for word, n in best:
                print(f"{n:>10}  {word}")
            print(f"time taken: {elapsed:.3f} s")
        counts.close()
        top.close()
        return best


if __name__ == "__main__":
    main()
