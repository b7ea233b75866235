"""The last rank SIGKILLs itself in the middle of a large transfer; survivors must raise PeerLostError."""

import os
import signal
import threading
import time

import numpy as np

import twisternet as tn
from twisternet.errors import PeerLostError

with tn.init() as ctx:
    victim = ctx.world - 1
    got = []
    ctx.register(1, lambda s, o: got.append(o) or True)
    if ctx.rank == victim:
        big = np.ones(64 << 20, np.uint8)

        def die():
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=die, daemon=True).start()
        while True:
            ctx.send(0, 1, big)   # mid-transfer when the kill lands
    else:
        t0 = time.monotonic()
        try:
            if ctx.rank == 0:
                ctx.wait_until(lambda: False, timeout=60)
            else:
                big = np.ones(64 << 20, np.uint8)
                while True:
                    ctx.send(victim, 1, big)   # blocked sending to the victim
        except PeerLostError as e:
            print(f"PEERLOST rank={ctx.rank} lost={e.rank} after={time.monotonic() - t0:.2f}", flush=True)
            time.sleep(3)   # let the other survivor see the victim's death before it sees ours
            raise SystemExit(3) from None
