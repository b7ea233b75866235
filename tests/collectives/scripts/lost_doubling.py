"""Rank ``world - 1`` SIGKILLs itself before its 50th small allreduce by recursive doubling
(``via="doubling"``); every survivor must raise PeerLostError naming it and print
``PEERLOST rank=R lost=V after=S``."""

import os
import signal
import time

import numpy as np

import collectives as C
import twisternet as tn
from twisternet.errors import PeerLostError

with tn.init() as ctx:
    victim = ctx.world - 1
    op = C.AllReduce(ctx, edge=1, op="sum", via="doubling")
    x = np.ones(256, np.float32)
    t0 = time.monotonic()
    i = 0
    try:
        while True:
            if ctx.rank == victim and i == 50:
                os.kill(os.getpid(), signal.SIGKILL)
            r = op.allreduce(x)
            assert (r == ctx.world).all(), r[:4]
            i += 1
            if time.monotonic() - t0 > 60:
                print(f"HUNG rank={ctx.rank} calls={i}", flush=True)
                raise SystemExit(4)
    except PeerLostError as e:
        print(f"PEERLOST rank={ctx.rank} lost={e.rank} after={time.monotonic() - t0:.2f} calls={i} msg={e}",
              flush=True)
        raise SystemExit(3) from None
