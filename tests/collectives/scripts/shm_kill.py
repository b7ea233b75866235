"""The last rank SIGKILLs itself while every rank loops on shared-memory allreduce calls; the survivors,
spinning on the segment, must raise PeerLostError naming it instead of waiting forever."""

import os
import signal
import threading
import time

import numpy as np

import twisternet as tn
from collectives import AllReduce
from twisternet.errors import PeerLostError

with tn.init() as ctx:
    victim = ctx.world - 1
    op = AllReduce(ctx, edge=1, op="sum")
    x = np.ones(1 << 16, np.float32)
    op.allreduce(x)                       # sets the segment up
    print(f"SHM rank={ctx.rank} used={op._rank_allreduce.shm is not None}", flush=True)
    if ctx.rank == victim:
        def die() -> None:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=die, daemon=True).start()
    t0 = time.monotonic()
    try:
        while True:
            op.allreduce(x)
            if ctx.rank != victim and time.monotonic() - t0 > 60:
                print(f"HUNG rank={ctx.rank}", flush=True)
                raise SystemExit(4)
    except PeerLostError as e:
        print(f"PEERLOST rank={ctx.rank} lost={e.rank} after={time.monotonic() - t0:.2f}", flush=True)
        time.sleep(3)   # let the other survivor see the victim's death before it sees ours
        raise SystemExit(3) from None
