"""A producer floods a slow consumer; prints the producer's RSS growth and how long it was held back."""

import sys
import threading
import time
from collections import deque

import psutil

import twisternet as tn

TOTAL_MB = int(sys.argv[1]) if len(sys.argv) > 1 else 200
RECORD = 32 << 10
N = (TOTAL_MB << 20) // RECORD

with tn.init() as ctx:
    if ctx.rank == 1:
        inbox: deque = deque()
        limit = 16

        def handle(src, obj):
            if len(inbox) >= limit:
                return False   # the application is behind: refuse, so credit stops flowing
            inbox.append(obj)
            return True
        ctx.register(1, handle)
        consumed = 0
        t0 = time.monotonic()
        while consumed < N:
            ctx.wait_until(lambda: len(inbox) > 0, timeout=120)
            while inbox:
                obj = inbox.popleft()
                assert len(obj) == RECORD
                consumed += 1
                if consumed % 50 == 0:
                    time.sleep(0.004)   # deliberately slow
            ctx.resume(1)
        print(f"CONSUMER consumed={consumed} seconds={time.monotonic() - t0:.2f}", flush=True)
    else:
        proc = psutil.Process()
        payload = b"p" * RECORD
        base = proc.memory_info().rss
        peak = base
        stop = False

        def sample():
            global peak
            while not stop:
                peak = max(peak, proc.memory_info().rss)
                time.sleep(0.005)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        t0 = time.monotonic()
        for _ in range(N):
            ctx.send(1, 1, payload)
        ctx.flush()
        sent_s = time.monotonic() - t0
        stop = True
        th.join()
        budget = (ctx.config.pool_buffers + 2 * ctx.config.buffer_count) * ctx.config.buffer_size
        print(f"PRODUCER growth_mb={(peak - base) / 2**20:.1f} send_seconds={sent_s:.2f} "
              f"budget_mb={budget / 2**20:.1f} "
              f"total_mb={TOTAL_MB}", flush=True)
