"""Worker of benchmarks/stragglers.py: rounds of map tasks with a heavy-tailed duration, synchronised
by a classic barrier or by a knee-released partial barrier with re-execution of the left-out tasks."""

import json
import sys
import time

import numpy as np

import twisternet as tn
from collectives import Barrier, CatchUp, PartialBarrier


def task_time(rnd: int, task: int, world: int, median: float, attempt: int = 0) -> float:
    """Deterministic heavy tail: each round one task (a different one) takes 10x the median, the
    others vary log-normally around it; a re-executed task (attempt 1) runs on a healthy node."""
    if attempt == 0 and task == rnd % world:
        return 10 * median
    z = np.random.default_rng([rnd, task, attempt]).standard_normal()
    return float(median * np.exp(0.25 * z))


def main() -> None:
    mode, rounds, median = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    with tn.init(timeout=600) as ctx:
        w, n = ctx.rank, ctx.world
        Barrier(ctx, "start", n).enter(w)
        t0 = time.perf_counter()
        reexecuted = skipped = 0
        pb = PartialBarrier(ctx, "map", max=n, knee=True, percent=50, late="catch_up")
        r = 0
        while r < rounds:
            time.sleep(task_time(r, w, n, median))            # the map task
            if mode == "classic":
                Barrier(ctx, f"round{r}", n).enter(w)
                r += 1
                continue
            try:
                rel = pb.enter(f"t{w}", round=r)
            except CatchUp as cu:
                # released without us: our task (and those of any rounds we skip) were re-executed
                skipped += cu.next_round - r
                r = cu.next_round
                continue
            passed = sorted(int(label[1:]) for label in rel.fire.passed)
            missing = sorted(set(range(n)) - set(passed))
            if missing:
                # re-execute the left-out tasks, their input split evenly over the released workers
                work = sum(task_time(r, t, n, median, attempt=1) for t in missing)
                time.sleep(work / len(passed))
                reexecuted += len(missing)
            Barrier(ctx, f"reexec{r}-{len(passed)}", len(passed)).enter(w)
            r += 1
        elapsed = time.perf_counter() - t0
        if ctx.rank == 0:
            print("STRAGGLERS " + json.dumps({"mode": mode, "seconds": elapsed, "reexecuted_by_rank0": reexecuted,
                                              "skipped_by_rank0": skipped}), flush=True)


if __name__ == "__main__":
    main()
