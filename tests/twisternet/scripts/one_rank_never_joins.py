"""Rank 1 never calls tn.init (it sleeps): the job cannot start."""

import os
import time

import twisternet as tn

if os.environ.get("TWISTERNET_RANK") == "1":
    time.sleep(600)
with tn.init() as ctx:
    print("JOINED", ctx.rank, flush=True)
