"""A job started by hand with a cluster launcher's variables: every rank reduces its rank + 1."""

import numpy as np

import twisternet as tn
from collectives import AllReduce

with tn.init(timeout=60, connect_timeout=30) as ctx:
    total = AllReduce(ctx, edge=1, op="sum").allreduce(np.full(4, ctx.rank + 1, np.int64))
    print(f"RESULT rank={ctx.rank} world={ctx.world} total={int(total[0])}", flush=True)
