"""Run by ``twisternet worker`` (cluster mode): one in-network allreduce; rank 0 prints the pids of the
switch and PS it started and waits (the test kills it); the other ranks start a second call, which can
only end with rank 0's loss."""

import time

import numpy as np

import twisternet as tn
from collectives import AllReduce

with tn.init(timeout=60) as ctx:
    ar = AllReduce(ctx, edge=3, op="sum", via="innet")
    ar.allreduce(np.ones(100, np.float32))
    path = ar._rank_allreduce.innet
    if path.service is not None:
        print(f"PIDS {path.service.switch_proc.pid} {path.service.ps_proc.pid}", flush=True)
    print("READY", flush=True)
    if ctx.rank == 0:
        time.sleep(600)                           # killed here
    ar.allreduce(np.ones(100, np.float32))        # needs rank 0: PeerLostError
