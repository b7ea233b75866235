"""Run inside the worker namespace: one ATP worker per rank on fixed ports, several allreduces through the
switch in the other namespace, each checked against the float64 sum within the quantization bound."""

import sys
import threading

import numpy as np

from innet import DEFAULT_SCALE, InnetJob, error_bound

sw_host, my_host, sw_port, ps_port, first_port, world = (sys.argv[1], sys.argv[2], int(sys.argv[3]),
                                                          int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
jobs = [InnetJob(1, r, world, (sw_host, sw_port), (sw_host, ps_port), bind=(my_host, first_port + r),
                 fallback_timeout=30.0) for r in range(world)]
try:
    for size in (1, 1000, 40_000):
        inputs = [(np.random.default_rng([r, size]).standard_normal(size) * 20).astype(np.float32)
                  for r in range(world)]
        outs: list = [None] * world

        def run(r: int, outs: list = outs, inputs: list = inputs) -> None:
            try:
                outs[r] = jobs[r].allreduce(inputs[r])
            except BaseException as e:  # noqa: BLE001 - reported below
                outs[r] = e
        ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(240)
        ref = sum(a.astype(np.float64) for a in inputs)
        bound = error_bound(ref, DEFAULT_SCALE, world)
        ok = all(isinstance(o, np.ndarray) and (np.abs(o - ref) <= bound).all() for o in outs)
        retx = sum(j.last_stats.retransmits for j in jobs if j.last_stats is not None)
        print(f"RESULT size={size} ok={ok} retransmits={retx} "
              f"fallback={any(j.last_stats.fallback for j in jobs if j.last_stats)}", flush=True)
finally:
    for j in jobs:
        j.close()
