"""Worker of the bad-host tests: allreduce calls in a loop until ``seconds`` pass (or a failure).

    allreduce_loop.py SECONDS [ELEMENTS] [VIA]

Prints ``READY rank=R host=H`` once the job is up, ``STEP rank=R i=I`` after each call, ``DONE rank=R``
at the end, and on a failure ``FAILED rank=R host=H after=S type=T: message`` (seconds since the last
completed step) before exiting with status 3.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from collectives import AllReduce
from worker_report import run_reported


def main() -> int:
    seconds = float(sys.argv[1])
    size = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 16
    via = sys.argv[3] if len(sys.argv) > 3 else "auto"

    def body(ctx, host, step) -> None:
        with AllReduce(ctx, edge=1, op="sum", via=via) as ar:
            end = time.monotonic() + seconds
            i = 0
            while time.monotonic() < end:
                y = ar.allreduce(np.ones(size, np.float32))
                assert y[0] == ctx.world, y[:4]
                step()
                print(f"STEP rank={ctx.rank} i={i}", flush=True)
                i += 1
    return run_reported(body)


if __name__ == "__main__":
    sys.exit(main())
