"""Worker of benchmarks/innet.py: float32 allreduce via the ATP switch or the ring, timed per call.

    _innet_allreduce_worker.py NBYTES REPS VIA     (VIA: "innet" or "ring")

Prints ``INNET_AR {"via":..., "median_s":..., "stats":..., "cpu_s":...}`` on rank 0. Inputs are random
float32; the result is checked against the float64 sum (the quantization bound for innet, float32
rounding for the ring) on every rank. ``cpu_s`` is the CPU time (user + system, all threads) per timed
call: ``ranks``, summed over the ranks' processes, and ``helpers``, of the processes rank 0 started
for the operation (the switch and the PS, read from /proc; 0 for the ring). On a machine with few
cores their sum over the core count is a floor under the time of a call.
"""

import json
import os
import resource
import sys
import time

# this script's directory holds benchmarks/innet.py, which would shadow the innet package
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import numpy as np  # noqa: E402

import twisternet as tn  # noqa: E402
from twisternet.procfs import children_by_parent, cpu_seconds  # noqa: E402
from collectives import AllReduce  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _children_cpu() -> dict[int, float]:
    """CPU seconds of each running child process of this one (Linux /proc; elsewhere empty)."""
    out = {}
    for pid in children_by_parent().get(os.getpid(), []):
        cpu = cpu_seconds(pid)
        if cpu is not None:
            out[pid] = cpu
    return out


def main() -> None:
    nbytes, reps, via = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    with tn.init(timeout=600) as ctx:
        ar = AllReduce(ctx, edge=1, op="sum", via=via)
        inputs = [(np.random.default_rng([r, nbytes]).standard_normal(nbytes // 4) * 10).astype(np.float32)
                  for r in range(ctx.world)]
        ref = np.sum([a.astype(np.float64) for a in inputs], axis=0)
        x = inputs[ctx.rank]
        times = []
        cpu = 0.0
        helpers: dict[int, float] = {}
        for i in range(reps + 1):                  # the first call (setup, warm-up) is not timed
            if i == 1:
                helpers = _children_cpu()          # (the checks below leave them idle)
            c, t = _cpu(), time.perf_counter()
            y = ar.allreduce(x)
            if i:
                times.append(time.perf_counter() - t)
                cpu += _cpu() - c
            tol = 1e-3 * ctx.world + 1e-4 * np.abs(ref)
            if not (np.abs(np.asarray(y, np.float64) - ref) <= tol).all():
                raise AssertionError(f"rank {ctx.rank}: {via} allreduce result off the float64 sum")
        after = _children_cpu()
        helpers_cpu = sum(after[p] - helpers[p] for p in helpers if p in after) / reps
        # every rank's CPU per call, summed (a second operation: the first one's calls are done)
        ranks_cpu = float(AllReduce(ctx, edge=2, op="sum", via="tree").allreduce(np.array([cpu / reps]))[0])
        stats = {}
        if via == "innet":
            ls = ar._rank_allreduce.innet.job.last_stats if hasattr(ar._rank_allreduce.innet, "job") else None
            if ls is not None:
                stats = {"retransmits": ls.retransmits, "timeouts": ls.timeouts,
                         "final_window": ls.final_window, "fallback": ls.fallback}
        if ctx.rank == 0:
            print("INNET_AR " + json.dumps({"via": via, "world": ctx.world, "median_s": sorted(times)[len(times) // 2],
                                            "times": times, "stats": stats,
                                            "cpu_s": {"ranks": ranks_cpu, "helpers": helpers_cpu}}), flush=True)


if __name__ == "__main__":
    main()
