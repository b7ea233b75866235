"""The FAILED line the emulated-cluster tests read from their worker scripts (same directory)."""

from __future__ import annotations

import time


def report_failure(rank: object, host: str, last: float, e: BaseException) -> int:
    """Print ``FAILED rank=R host=H after=S type=T: message`` (S: seconds since ``last``, the last
    completed step) and return the worker's exit status for a failure, 3."""
    msg = str(e).replace("\n", " | ")
    print(f"FAILED rank={rank} host={host} after={time.monotonic() - last:.2f} type={type(e).__name__}: {msg}",
          flush=True)
    return 3
