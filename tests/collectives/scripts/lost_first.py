"""Rank ``world - 1`` SIGKILLs itself in the middle of an operation (``argv[1]``: streaming gather /
reduce / keyed_reduce, or batch keyed_reduce, whose send() only buffers locally); every survivor must
raise PeerLostError at its next call, naming the killed rank (not a rank that failed in reaction), and
print ``PEERLOST rank=R lost=V after=S where=CALL``. Survivors exit at once (no waiting for the others)."""

import operator
import os
import signal
import sys
import time

import numpy as np

import collectives as C
import twisternet as tn
from twisternet.errors import PeerLostError

KIND = sys.argv[1]

with tn.init() as ctx:
    victim = ctx.world - 1
    dest = [0]
    if KIND == "gather":
        op = C.Gather(ctx, destinations=dest, edge=1, mode="streaming")
    elif KIND == "reduce":
        op = C.Reduce(ctx, destinations=dest, edge=1, mode="streaming", op="sum")
    elif KIND == "keyed_reduce":
        op = C.KeyedReduce(ctx, destinations=dest, edge=1, reduce=operator.add, key_type="int", mode="streaming")
    else:
        op = C.KeyedReduce(ctx, destinations=ctx.tasks, edge=1, reduce=operator.add, key_type="int", mode="batch")
    t0 = time.monotonic()
    where = "send"
    try:
        i = 0
        while True:
            if ctx.rank == victim and i == 200:
                os.kill(os.getpid(), signal.SIGKILL)
            where = "send"
            if KIND in ("keyed_reduce", "batch_keyed_reduce"):
                op.send(ctx.rank, i % 7, 1)
            else:
                op.send(ctx.rank, np.full(4, i))
            if ctx.rank == 0 and KIND != "batch_keyed_reduce":
                where = "drain"
                op.drain()
            i += 1
            if i % 50 == 0:
                time.sleep(0.001)
            if time.monotonic() - t0 > 60:
                print(f"HUNG rank={ctx.rank}", flush=True)
                raise SystemExit(4)
    except PeerLostError as e:
        print(f"PEERLOST rank={ctx.rank} lost={e.rank} after={time.monotonic() - t0:.2f} where={where} "
              f"msg={e}", flush=True)
        raise SystemExit(3) from None
