"""AllReduce operations over overlapping subsets of four ranks, each finding out which of its ranks
share a host on its first call (``via="auto"``): X on 0,1,2, Y on 1,2,3, then Z on 0,1,3 and a ring
over 0,1,3 with two chunk sizes possible. With the argument ``exchange`` (MPI), the channel's host
table is dropped first, so that every operation exchanges host ids among its ranks. Prints
``SUBSET rank=R ok=N`` with the calls whose results were right, or ``SUBSET rank=R error=...``."""

from __future__ import annotations

import sys

import numpy as np

import collectives as C
import twisternet as tn

with tn.init() as ctx:
    if sys.argv[1:] == ["exchange"]:
        ctx.channel.host_ids = None     # as a channel with no host table: each operation exchanges ids
    ok = 0
    try:
        assert ctx.world == 4, ctx.world
        ops = [(C.AllReduce(ctx, sources=members, edge=edge, op="sum", via=via, timeout=30), members)
               for members, edge, via in (([0, 1, 2], 1, "auto"), ([1, 2, 3], 2, "auto"), ([0, 1, 3], 3, "auto"),
                                          ([0, 1, 3], 4, "ring"))]
        for op, members in ops:
            if ctx.rank in members:
                got = op.allreduce(np.full(300_000, ctx.rank + 1, np.float64))
                ok += bool(np.all(got == sum(r + 1 for r in members)))
        for op, _ in ops:
            op.close()
        print(f"SUBSET rank={ctx.rank} ok={ok}", flush=True)
    except Exception as e:
        print(f"SUBSET rank={ctx.rank} error={type(e).__name__}: {e}", flush=True)
        raise
