"""1 of N workers is much slower; a knee-released partial barrier lets the fast ones go.

    straggler.py [LATE] [SIGNAL_DIR]

"Not held for the slow one" is checked as an order of events, not a time: the straggler enters only
once every fast worker was released (each leaves a file in ``SIGNAL_DIR``), or after ``STRAGGLER_CAP``
seconds. A barrier that held the fast workers for it would see it enter only after that cap, and the
fast workers' fire would then include it."""

import sys
import time
from pathlib import Path

import twisternet as tn
from collectives.barrier import CatchUp
from collectives.barrier.distributed import PartialBarrier

LATE = sys.argv[1] if len(sys.argv) > 1 else "pass"
SIGNAL_DIR: str | None = sys.argv[2] if len(sys.argv) > 2 else None
#: Longest the straggler waits for the fast workers' release files.
STRAGGLER_CAP = 45.0


def _wait_for_fast_ones(ctx) -> None:
    """Block the straggler until every fast worker left its release file (or the cap passed)."""
    if SIGNAL_DIR is None:
        time.sleep(2.0)
        return
    want = [Path(SIGNAL_DIR) / f"released-{r}" for r in range(ctx.world - 1)]
    end = time.monotonic() + STRAGGLER_CAP
    while not all(p.exists() for p in want) and time.monotonic() < end:
        time.sleep(0.02)  # polling files written by other processes: the event is the file


def main(ctx) -> str:
    b = PartialBarrier(ctx, "phase", max=ctx.world, knee=True, percent=75, late=LATE, timeout=60)
    slow = ctx.rank == ctx.world - 1
    if slow:
        _wait_for_fast_ones(ctx)
    else:
        time.sleep(0.1)
    t = time.monotonic()
    try:
        rel = b.enter(f"task{ctx.rank}", wait=STRAGGLER_CAP + 15)
        out = f"rank={ctx.rank} status={rel.status.name} passed={','.join(sorted(rel.fire.passed))}"
    except CatchUp:
        out = f"rank={ctx.rank} status=CATCHUP"
    if not slow and SIGNAL_DIR is not None:
        (Path(SIGNAL_DIR) / f"released-{ctx.rank}").touch()
    return out + f" waited={time.monotonic() - t:.2f}"


if __name__ == "__main__":
    with tn.init() as ctx:
        print("PB " + main(ctx), flush=True)
