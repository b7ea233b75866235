"""Worker side of benchmarks/p2p.py: run under `twisternet run -n 2` (or mpiexec); prints one JSON line."""

import json
import statistics
import sys
import time

import numpy as np

import twisternet as tn

from benchmarks._raw_sockets import pass_reps


def main() -> None:
    sizes = [int(x) for x in sys.argv[1].split(",")]
    budget = int(sys.argv[2])            # bytes per bandwidth measurement
    lat_sizes = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 and sys.argv[3] else []
    passes = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    with tn.init(timeout=600) as ctx:
        got = [0]

        def handle(src, obj):
            got[0] += 1     # like the raw baseline, the data is not kept (its buffer can be reused)
            return True
        ctx.register(1, handle)
        out = {"bandwidth": {}, "latency": {}, "channel": ctx.channel.name,
               "link": getattr(ctx.channel, "_peers", {}).get(1 - ctx.rank).kind
               if hasattr(ctx.channel, "_peers") else ctx.channel.name}
        peer = 1 - ctx.rank
        # Cumulative expected counts (not snapshots of the counter: the peer's next message may
        # already have arrived when a snapshot would be taken).
        expect = 0
        for size in sizes:
            arr = np.ones(size, np.uint8)
            reps = pass_reps(size, budget, passes)
            if ctx.rank == 0:
                ctx.send(peer, 1, arr)      # warm-up (allocations, page faults)
                ctx.flush()
                expect += 1
                ctx.wait_until(lambda expect=expect: got[0] == expect)
                rates = []
                for _ in range(passes):     # the median of timed passes (see PASSES in benchmarks/p2p.py)
                    t = time.perf_counter()
                    for _ in range(reps):
                        ctx.send(peer, 1, arr)
                    ctx.flush()
                    expect += 1
                    ctx.wait_until(lambda expect=expect: got[0] == expect)
                    rates.append(reps * size / (time.perf_counter() - t))
                out["bandwidth"][size] = statistics.median(rates)
            else:
                expect += 1
                ctx.wait_until(lambda expect=expect: got[0] == expect)
                ctx.send(peer, 1, b"k")
                ctx.flush()
                for _ in range(passes):
                    expect += reps
                    ctx.wait_until(lambda expect=expect: got[0] == expect)
                    ctx.send(peer, 1, b"k")
                    ctx.flush()
        for size in lat_sizes:
            arr = np.ones(size, np.uint8)
            reps = max(20, min(2000, (64 << 20) // max(size, 1)))
            t = time.perf_counter()
            for _ in range(reps):
                expect += 1
                if ctx.rank == 0:
                    ctx.send(peer, 1, arr)
                    ctx.flush()
                    ctx.wait_until(lambda expect=expect: got[0] == expect)
                else:
                    ctx.wait_until(lambda expect=expect: got[0] == expect)
                    ctx.send(peer, 1, arr)
                    ctx.flush()
            out["latency"][size] = (time.perf_counter() - t) / reps / 2
        if ctx.rank == 0:
            print("P2P " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
