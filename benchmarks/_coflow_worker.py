"""One worker of the coflow benchmark: a big Partition, then (``--delay`` s later) a small one.

Run under ``twisternet worker`` (see benchmarks/_coflow_netns.py). Every rank prints one JSON line with
wall-clock start/finish times of both coflows (all namespaces share the kernel clock), so the caller can
compute each coflow's completion time (CCT = last finish - first start).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

import twisternet
import collectives as C

CHUNK = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big-mb", type=float, default=20.0, help="MB each rank sends in the big coflow")
    ap.add_argument("--small-mb", type=float, default=0.5, help="MB each rank sends in the small coflow")
    ap.add_argument("--delay", type=float, default=0.3, help="seconds between the two coflows")
    a = ap.parse_args(argv)
    ctx = twisternet.init()
    r, w = ctx.rank, ctx.world
    others = [d for d in range(w) if d != r]
    big_chunks = max(1, int(a.big_mb * (1 << 20)) // CHUNK)
    small_bytes = max(1, int(a.small_mb * (1 << 20)) // len(others))
    # a tiny exchange first, so both coflows start on warm connections at about the same time everywhere
    with ctx.coflow("sync", size=64 * w):
        sync = C.Partition(ctx, edge=9)
    for d in others:
        sync.send(r, d, destination=d)
    sync.finish(r)
    list(sync.results())
    sync.close()

    t_big0 = time.time()
    with ctx.coflow("big", size=big_chunks * CHUNK * w):
        big = C.Partition(ctx, edge=1)
    payload = np.ones(CHUNK, dtype=np.uint8)
    for i in range(big_chunks):
        big.send(r, payload, destination=others[i % len(others)])
    big.finish(r)
    time.sleep(max(0.0, t_big0 + a.delay - time.time()))
    t_small0 = time.time()
    with ctx.coflow("small", size=small_bytes * len(others) * w):
        small = C.Partition(ctx, edge=2)
    for d in others:
        small.send(r, np.full(small_bytes, 7, dtype=np.uint8), destination=d)
    small.finish(r)
    t_small_sent = time.time()
    got_small = sum(int(np.asarray(x[1]).nbytes) for x in small.results())
    t_small1 = time.time()
    got_big = sum(int(np.asarray(x[1]).nbytes) for x in big.results())
    t_big1 = time.time()
    small.close()
    big.close()
    print(json.dumps({"rank": r, "big": [t_big0, t_big1], "small": [t_small0, t_small1], "small_sent": t_small_sent,
                      "got_small": got_small, "got_big": got_big,
                      "policy": ctx.config.coflow_policy}), flush=True)
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
