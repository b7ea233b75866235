"""Run under ``twisternet run --innet``: two AllReduce(via="innet") operations place two jobs on the one
switch the launcher started (through P4Runtime); results are checked against the float64 sum, and rank 0
checks through its own controller that the jobs' entries appear and go away with their operations."""

import numpy as np

import twisternet as tn
from collectives import AllReduce
from innet import DEFAULT_SCALE, error_bound
from innet.controller import P4RuntimeController

with tn.init(timeout=120) as ctx:
    cfg = ctx.config
    assert cfg.innet_switch and cfg.innet_p4runtime, "twisternet run --innet did not set the switch keys"
    ops = [AllReduce(ctx, edge=10 + i, op="sum", via="innet") for i in range(2)]
    for i, ar in enumerate(ops):
        for size in (5, 30_000):
            def value(r: int, size: int = size, i: int = i) -> np.ndarray:
                return (np.random.default_rng([r, size, i]).standard_normal(size) * 50).astype(np.float32)
            got = ar.allreduce(value(ctx.rank))
            ref = sum(value(r).astype(np.float64) for r in range(ctx.world))
            ok = bool((np.abs(got - ref) <= error_bound(ref, DEFAULT_SCALE, ctx.world)).all())
            path = ar._rank_allreduce.innet
            print(f"RESULT rank={ctx.rank} op={i} size={size} ok={ok} fallback={path.last_stats.fallback} "
                  f"own_switch={path.service is not None} job={path.job.job_id}", flush=True)
    from innet.p4runtime.auth import p4runtime_token
    ctl = P4RuntimeController(cfg.innet_p4runtime, token=p4runtime_token(cfg.token_bytes))
    ids = sorted(ar._rank_allreduce.innet.job.job_id for ar in ops)
    if ctx.rank == 0:
        print(f"JOBS {ids} on_switch={sorted(ctl.job_ids())}", flush=True)
    ops[0].close()
    ops[1].close()
    if ctx.rank == 0:
        print(f"AFTER on_switch={sorted(ctl.job_ids())}", flush=True)
