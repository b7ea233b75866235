"""Throttled release: let waiting entrants through at most ``per_period`` per period, in FIFO order.

Time is cut into periods ``[t0 + k*period, t0 + (k+1)*period)`` from the first entry ``t0``. Each period
may release ``count`` entrants (or ``percent``% of ``max``, rounded up). An entrant that arrives while the
current period still has budget and nobody is queued passes at once; otherwise it queues and is released at
the start of a later period, oldest first. With a ``policy`` (e.g. ``AdaptiveConcurrency``) entrants report
``complete(label, now)`` and, at each period start after at least one new completion, the budget becomes
``max(1, budget + admit_count() - 1)``.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict

from .concurrency import ConcurrencyPolicy
from .errors import BarrierProtocolError, BarrierSpecError
from .partial import check_label_rank
from .records import Admission, AdmitReason
from .semaphore import AdmitOutcome
from .specs import ThrottleSpec

log = logging.getLogger(__name__)


class ThrottledRelease:
    """Rate-limited FIFO release of entrants: ``count`` (or ``percent``% of ``max``) per ``period``."""

    def __init__(self, name: str, period: float, count: int | None = None, percent: float | None = None,
                 max: int | None = None, *, policy: ConcurrencyPolicy | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise BarrierSpecError("name", f"must be a non-empty str, got {name!r}")
        self.spec = ThrottleSpec(period=period, count=count, percent=percent, max=max)
        self.name = name
        self.policy = policy
        self.per_period = self.spec.per_period
        self._t0: float | None = None
        self._window = 0
        self._used = 0
        self._queue: OrderedDict[str, int] = OrderedDict()
        self._released: dict[str, Admission] = {}
        self._completed: dict[str, float] = {}
        self._new_completions = 0
        self._last_now = -math.inf

    @property
    def waiting(self) -> list[str]:
        """Labels waiting, in FIFO order."""
        return list(self._queue)

    @property
    def released(self) -> list[str]:
        """Labels released so far, in release order."""
        return list(self._released)

    def enter(self, label: str, rank: int, now: float) -> AdmitOutcome:
        """``label`` from ``rank`` asks to pass at ``now``."""
        check_label_rank(label, rank)
        now = self._clamp(now)
        if self._t0 is None:
            self._t0 = now
        out = self._advance(now)
        if label in self._released:
            return AdmitOutcome(self._released[label], tuple(out))
        if label in self._queue:
            return AdmitOutcome(None, tuple(out))
        own: Admission | None = None
        if not self._queue and self._used < self.per_period:
            own = self._release(label, rank, now, AdmitReason.FREE)
            out.append(own)
        else:
            self._queue[label] = rank
        return AdmitOutcome(own, tuple(out))

    def complete(self, label: str, now: float) -> None:
        """``label`` finished the work it was released for (feeds the policy its completion time)."""
        now = self._clamp(now)
        adm = self._released.get(label)
        if adm is None:
            raise BarrierProtocolError(f"throttle {self.name!r}: {label!r} completed without being released")
        if label in self._completed:
            return
        self._completed[label] = now
        if self.policy is not None:
            self.policy.record(now - adm.time)
            self._new_completions += 1

    def drop_rank(self, rank: int, now: float) -> list[Admission]:
        """Rank ``rank`` died: withdraw its waiting labels (nothing else changes)."""
        self._clamp(now)
        for label in [lab for lab, r in self._queue.items() if r == rank]:
            del self._queue[label]
        return []

    def tick(self, now: float) -> list[Admission]:
        """Start every period due by ``now``; return the releases that causes."""
        now = self._clamp(now)
        return [] if self._t0 is None else self._advance(now)

    def next_deadline(self) -> float | None:
        """Start of the next period when somebody waits, else None."""
        if self._t0 is None or not self._queue:
            return None
        return self._t0 + (self._window + 1) * self.spec.period

    # ------------------------------------------------------------------
    def _release(self, label: str, rank: int, t: float, reason: AdmitReason) -> Admission:
        adm = Admission(self.name, label, rank, reason, t)
        self._released[label] = adm
        self._used += 1
        log.debug("throttle %r: released %r (rank %d) at %g, %d/%d this period", self.name, label, rank, t,
                  self._used, self.per_period)
        return adm

    def _advance(self, now: float) -> list[Admission]:
        assert self._t0 is not None
        out: list[Admission] = []
        period = self.spec.period
        while self._t0 + (self._window + 1) * period <= now:
            if not self._queue:  # nothing to release: jump straight to the period containing now
                self._window = max(self._window + 1, int((now - self._t0) // period))
                while self._t0 + (self._window + 1) * period <= now:
                    self._window += 1
                while self._t0 + self._window * period > now:
                    self._window -= 1
                self._start_period()
                break
            self._window += 1
            self._start_period()
            start = self._t0 + self._window * period
            while self._queue and self._used < self.per_period:
                label, rank = self._queue.popitem(last=False)
                out.append(self._release(label, rank, start, AdmitReason.PERIOD))
        return out

    def _start_period(self) -> None:
        self._used = 0
        if self.policy is not None and self._new_completions:
            k = self.policy.admit_count()
            self.per_period = max(1, self.per_period + k - 1)
            self._new_completions = 0

    def _clamp(self, now: float) -> float:
        if not isinstance(now, (int, float)) or isinstance(now, bool) or math.isnan(now):
            raise TypeError(f"now must be a number, got {now!r}")
        self._last_now = max(self._last_now, float(now))
        return self._last_now
