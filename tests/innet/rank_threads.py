"""Run one callable per rank on threads (the innet tests' ranks share one process; not a test module)."""

from __future__ import annotations

import threading
from typing import Any
from collections.abc import Callable, Sequence


def run_ranks(fns: Sequence[Callable[[], Any]], timeout: float = 90.0) -> list[Any]:
    """Run one callable per rank in threads; return their results, re-raise the first error."""
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"ranks did not finish within {timeout} s")
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results
