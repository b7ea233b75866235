"""1 of N workers is 20x slower; a knee-released partial barrier lets the fast ones go."""

import sys
import time

import twisternet as tn
from collectives.barrier import CatchUp
from collectives.barrier.distributed import PartialBarrier

LATE = sys.argv[1] if len(sys.argv) > 1 else "pass"


def main(ctx) -> str:
    b = PartialBarrier(ctx, "phase", max=ctx.world, knee=True, percent=75, late=LATE, timeout=60)
    work = 0.1 * (20 if ctx.rank == ctx.world - 1 else 1)
    time.sleep(work)
    t = time.monotonic()
    try:
        rel = b.enter(f"task{ctx.rank}", wait=30)
        out = f"rank={ctx.rank} status={rel.status.name} passed={','.join(sorted(rel.fire.passed))}"
    except CatchUp:
        out = f"rank={ctx.rank} status=CATCHUP"
    return out + f" waited={time.monotonic() - t:.2f}"


if __name__ == "__main__":
    with tn.init() as ctx:
        print("PB " + main(ctx), flush=True)
