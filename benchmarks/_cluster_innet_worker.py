"""Worker of benchmarks/cluster_innet.py: one rank's timings of a float32 allreduce with one ``via``.

    _cluster_innet_worker.py VIA BYTES REPS

One checked call first: every rank's values are seeded by its rank, and the result must equal the
float64 sum of all of them within ``innet.error_bound`` (via="innet") or within float32 rounding of the
sum's partial sums (the other vias: 1e-5 of the sum of magnitudes). Then REPS timed calls of the same
array, each started after a barrier. Prints ``INNETBENCH {"rank", "host", "via", "median_s", "times_s",
"worst", "cpu_s", "stats"}`` (worst: the check's largest error over its bound; cpu_s: this process's
user+system seconds over the timed calls; stats: the in-network worker's counters of the last call).
"""

from __future__ import annotations

import json
import os
import resource
import socket
import sys
import time

# this directory holds benchmarks/innet.py, which would shadow the innet package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402

import twisternet as tn  # noqa: E402
from collectives import AllReduce  # noqa: E402
from innet import DEFAULT_SCALE, error_bound  # noqa: E402


def value(rank: int, n: int) -> np.ndarray:
    return (np.random.default_rng([rank, n]).standard_normal(n) * 10).astype(np.float32)


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    via, nbytes, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    n = nbytes // 4
    with tn.init(timeout=900) as ctx:
        rank, world = ctx.rank, ctx.world
        ar = AllReduce(ctx, edge=1, op="sum", via=via, timeout=600)
        bar = AllReduce(ctx, edge=2, op="sum", via="tree")
        one = np.ones(1, np.int64)
        x = value(rank, n)
        got = ar.allreduce(x)
        ref = np.zeros(n, np.float64)
        mag = np.zeros(n, np.float64)
        for r in range(world):
            v = value(r, n).astype(np.float64)
            ref += v
            mag += np.abs(v)
        if via == "innet":
            bound = error_bound(ref, DEFAULT_SCALE, world)
        else:
            bound = 1e-5 * mag + 1e-30
        worst = float((np.abs(got.astype(np.float64) - ref) / bound).max())
        if worst > 1.0:
            raise SystemExit(f"rank {rank}: via={via} result off by {worst:.3g} x the bound")
        del ref, mag, got
        y = np.empty_like(x)
        times = []
        c0 = cpu()
        for _ in range(reps):
            bar.allreduce(one)
            t = time.perf_counter()
            ar.allreduce(x, out=y) if via != "innet" else ar.allreduce(x)
            times.append(time.perf_counter() - t)
        cpu_s = cpu() - c0
        stats = None
        if via == "innet":
            st = ar._rank_allreduce.innet.last_stats
            stats = {k: v for k, v in vars(st).items() if isinstance(v, (int, float, bool, str))}
        ar.close()
        bar.close()
    print("INNETBENCH " + json.dumps({"rank": rank, "host": socket.gethostname(), "via": via,
                                      "median_s": sorted(times)[len(times) // 2], "times_s": times,
                                      "worst": worst, "cpu_s": cpu_s, "stats": stats}), flush=True)


if __name__ == "__main__":
    main()
