"""Worker of benchmarks/allreduce.py for twisternet (TCP under `twisternet run`, MPI under mpiexec).

    _allreduce_worker.py SIZES REPS [VIA]     (VIA: an AllReduce ``via``, "auto" by default)

Rank 0 prints the per-call median the suite uses, and beside it per size the 10th percentile, the mean
and the process CPU time per call (all threads): under load the median hides whether the ranks ran at
the same time (see docs/performance.md, issue 22).
"""

import json
import sys
import time

import numpy as np

import twisternet as tn
from collectives import AllReduce


def main() -> None:
    sizes = [int(x) for x in sys.argv[1].split(",")]
    reps = [int(x) for x in sys.argv[2].split(",")]
    with tn.init(timeout=600) as ctx:
        via = sys.argv[3] if len(sys.argv) > 3 else "auto"
        ar = AllReduce(ctx, edge=1, op="sum", via=via)
        out = {}
        extra: dict[int, dict[str, float]] = {}
        for size, n in zip(sizes, reps):
            x = np.ones(size // 4, np.float32)
            y = np.empty_like(x)                    # a preallocated result, as mpi4py's Allreduce(x, y)
            ar.allreduce(x, out=y)                  # warm-up, checked
            assert (y == ctx.world).all(), y[:4]
            times = []
            cpu = time.process_time()
            for _ in range(n):
                t = time.perf_counter()
                ar.allreduce(x, out=y)
                times.append(time.perf_counter() - t)
            cpu = (time.process_time() - cpu) / n
            assert (y == ctx.world).all(), y[:4]
            times.sort()
            out[size] = times[len(times) // 2]
            extra[size] = {"p10_s": times[len(times) // 10], "mean_s": sum(times) / n, "cpu_s": cpu}
        if ctx.rank == 0:
            used = "shm" if ar._rank_allreduce.shm is not None else via
            print("ALLREDUCE " + json.dumps({"channel": ctx.channel.name, "via": used, "median_s": out,
                                             "per_size": extra}), flush=True)


if __name__ == "__main__":
    main()
