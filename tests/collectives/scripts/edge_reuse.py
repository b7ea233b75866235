"""A training loop that makes a new AllReduce on one edge per epoch (closing the previous one) and
reduces a numpy array and a Python scalar with it; prints ``REUSE rank=R ok=E`` with the epochs whose
results were right, or ``REUSE rank=R error=...``."""

from __future__ import annotations

import sys

import numpy as np

import collectives as C
import twisternet as tn

EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
VIA = sys.argv[2] if len(sys.argv) > 2 else "auto"

with tn.init() as ctx:
    ok = 0
    try:
        for epoch in range(EPOCHS):
            op = C.AllReduce(ctx, edge=5, op="sum", via=VIA, timeout=30, ring_threshold=1024)
            grad = np.full(4096, ctx.rank + epoch, np.float64)
            total = op.allreduce(grad)
            # via="ring" and "doubling" take arrays only: a second array stands in for the scalar
            loss = (op.allreduce(np.full(8, float(ctx.rank * epoch)))[0] if VIA in ("ring", "doubling")
                    else op.allreduce(float(ctx.rank * epoch)))
            op.close()
            want = sum(r + epoch for r in range(ctx.world))
            if np.all(total == want) and loss == sum(r * epoch for r in range(ctx.world)):
                ok += 1
        print(f"REUSE rank={ctx.rank} ok={ok}", flush=True)
    except Exception as e:  # the test reads what went wrong
        print(f"REUSE rank={ctx.rank} epoch={epoch} error={type(e).__name__}: {e}", flush=True)
        raise
