"""The frame of the emulated-cluster tests' worker scripts (same directory): the READY, DONE and FAILED
lines the tests read, and a stack dump on SIGUSR1 for a test that timed out."""

from __future__ import annotations

import faulthandler
import signal
import socket
import time
from typing import Any
from collections.abc import Callable


def report_failure(rank: object, host: str, last: float, e: BaseException) -> int:
    """Print ``FAILED rank=R host=H after=S type=T: message`` (S: seconds since ``last``, the last
    completed step) and return the worker's exit status for a failure, 3."""
    msg = str(e).replace("\n", " | ")
    print(f"FAILED rank={rank} host={host} after={time.monotonic() - last:.2f} type={type(e).__name__}: {msg}",
          flush=True)
    return 3


def run_reported(body: Callable[[Any, str, Callable[[], None]], None]) -> int:
    """Join the job, print ``READY rank=R host=H``, run ``body(ctx, host, step)`` (``step()`` after each
    completed step), print ``DONE rank=R``; on an exception print the FAILED line (seconds since the
    last step) and return 3, else 0. A timed-out test's SIGUSR1 dumps every thread's stack."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import twisternet as tn
    host = socket.gethostname()
    rank: object = "?"
    last = [time.monotonic()]

    def step() -> None:
        last[0] = time.monotonic()
    try:
        with tn.init() as ctx:
            rank = ctx.rank
            print(f"READY rank={rank} host={host}", flush=True)
            body(ctx, host, step)
            print(f"DONE rank={rank}", flush=True)
    except Exception as e:  # noqa: BLE001 - reported for the test to read
        return report_failure(rank, host, last[0], e)
    return 0
