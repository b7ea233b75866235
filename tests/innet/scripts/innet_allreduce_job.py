"""AllReduce(via="innet") in a real job (twisternet run / mpiexec): checks each result against the float64
sum within the documented quantization bound, optionally kills the switch after the first call (fate
sharing), and prints the switch and PS process ids so the test can check they are gone afterwards."""

import sys

import numpy as np

import twisternet as tn
from collectives import AllReduce
from innet import DEFAULT_SCALE, error_bound

sizes = [int(x) for x in sys.argv[1].split(",")]
kill = len(sys.argv) > 2 and sys.argv[2] == "kill"

with tn.init(timeout=120) as ctx:
    ar = AllReduce(ctx, edge=3, op="sum", via="innet")
    path = None
    for i, size in enumerate(sizes):
        def value(r: int, size: int = size, i: int = i) -> np.ndarray:
            return (np.random.default_rng([r, size, i]).standard_normal(size) * 100).astype(np.float32)
        x = value(ctx.rank)
        got = ar.allreduce(x)
        ref = sum(value(r).astype(np.float64) for r in range(ctx.world))
        ok = got.shape == x.shape and bool((np.abs(got - ref) <= error_bound(ref, DEFAULT_SCALE, ctx.world)).all())
        path = ar._rank_allreduce.innet
        stats = path.last_stats
        print(f"RESULT rank={ctx.rank} call={i} size={size} ok={ok} fallback={stats.fallback}", flush=True)
        if kill and i == 0 and path.service is not None:
            print(f"KILLED switch pid={path.service.switch_proc.pid}", flush=True)
            path.kill_switch()
    if path is not None and path.service is not None:
        print(f"PIDS {path.service.switch_proc.pid} {path.service.ps_proc.pid}", flush=True)
    ar.close()
