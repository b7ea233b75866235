"""Rate-limited logging for events an outsider can trigger at will (refused connections, accept errors),
so a flood of them cannot fill the disk or burn a core on log formatting."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

__all__ = ["LogThrottle"]


class LogThrottle:
    """Logs at most ``burst`` records per ``key`` in every ``period`` seconds; counts the rest and
    reports how many were suppressed with the first record of the next period. Thread-safe."""

    def __init__(self, logger: logging.Logger, period: float = 10.0, burst: int = 5) -> None:
        if period <= 0 or burst < 1:
            raise ValueError("period must be > 0 and burst >= 1")
        self.logger = logger
        self.period = period
        self.burst = burst
        self._lock = threading.Lock()
        self._state: dict[str, list[float]] = {}   # key -> [window start, logged, suppressed]
        #: Records suppressed so far, over all keys (for tests and diagnostics).
        self.suppressed = 0

    def log(self, level: int, key: str, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` at ``level`` unless ``key`` used up its burst; True if it was logged."""
        now = time.monotonic()
        with self._lock:
            st = self._state.get(key)
            if st is None or now - st[0] >= self.period:
                dropped = int(st[2]) if st is not None else 0
                st = self._state[key] = [now, 0, 0]
            else:
                dropped = 0
            if st[1] >= self.burst:
                st[2] += 1
                self.suppressed += 1
                return False
            st[1] += 1
        if dropped:
            self.logger.log(level, "(%d more like the next one in the last %.0fs were not logged)",
                            dropped, self.period)
        self.logger.log(level, msg, *args)
        return True

    def warning(self, key: str, msg: str, *args: Any) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, key, msg, *args)
