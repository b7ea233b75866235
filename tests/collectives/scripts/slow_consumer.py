"""Ranks 1.. stream ``argv[1]`` arrays of 1 MB each into a streaming Gather whose destination (rank 0)
consumes them slowly; rank 0 prints ``RSS growth=MB count=N`` with the peak growth of its resident
set (psutil, sampled every 5 ms) over the run."""

import sys
import threading
import time

import numpy as np
import psutil

import collectives as C
import twisternet as tn

N = int(sys.argv[1]) if len(sys.argv) > 1 else 400

with tn.init() as ctx:
    proc = psutil.Process()
    op = C.Gather(ctx, sources=list(range(1, ctx.world)), destinations=[0], edge=1, mode="streaming",
                  timeout=120)
    if ctx.rank == 0:
        base = proc.memory_info().rss
        peak = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.005)
        threading.Thread(target=sample, daemon=True).start()
        count = 0
        for src, arr in op.results():
            assert arr.nbytes == 1 << 20 and arr[0] == src
            count += 1
            time.sleep(0.004)            # the slow consumer
        stop.set()
        peak[0] = max(peak[0], proc.memory_info().rss)
        print(f"RSS growth={(peak[0] - base) / 2**20:.1f} count={count}", flush=True)
    else:
        a = np.full(1 << 17, float(ctx.rank))   # 1 MB
        for _ in range(N):
            op.send(ctx.rank, a)
        op.finish(ctx.rank)
    op.close()
