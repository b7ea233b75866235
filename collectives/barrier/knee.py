"""Knee detection in an arrival process, for the adaptive release of partial barriers.

The estimator is the one of Albrecht et al. (ATC 2006), which borrows TCP's retransmission-timer
arithmetic: for every inter-arrival time ``s`` (time between two consecutive *new* labels)

    arr    <- 0.7 * arr    + 0.3 * s
    arrvar <- 0.75 * arrvar + 0.25 * |s - arr|        (using the arr just updated)

and a *knee* is declared when no new label has arrived by ``last_arrival + arr + 4 * arrvar``.

Initialisation (as TCP does for its first RTT sample, which the paper's estimator mirrors): the first
arrival only records a time; the first sample ``s1`` (second arrival) sets ``arr = s1`` and
``arrvar = s1 / 2``, so the first deadline is ``last + 3 * s1``. Before the second arrival there is no
deadline and so no knee: an adaptive barrier that only ever sees one arrival needs ``timeout`` (or ``max``)
to release.
"""

from __future__ import annotations


#: Weights and multiplier of the estimator (fixed by the paper).
ARR_KEEP, ARR_GAIN = 0.7, 0.3
ARRVAR_KEEP, ARRVAR_GAIN = 0.75, 0.25
DEVIATIONS = 4.0


class KneeDetector:
    """EWMA of inter-arrival times and their mean deviation; reports when the arrival stream has a knee."""

    def __init__(self) -> None:
        self.arr: float | None = None
        self.arrvar: float | None = None
        self.last_arrival: float | None = None
        self.samples = 0
        #: Knees detected so far, as (time of detection, number of arrivals before it).
        self.knees: list[tuple[float, int]] = []
        self._arrivals = 0
        self._knee_pending = False  # a knee was declared and no arrival has come since

    @property
    def arrivals(self) -> int:
        """Arrivals observed (new labels only)."""
        return self._arrivals

    @property
    def in_knee(self) -> bool:
        """True from a detected knee until the next arrival."""
        return self._knee_pending

    def observe(self, now: float) -> None:
        """Record one arrival at ``now`` (times must not decrease)."""
        if self.last_arrival is not None:
            if now < self.last_arrival:
                raise ValueError(f"arrival at {now!r} precedes the previous one at {self.last_arrival!r}")
            s = now - self.last_arrival
            if self.arr is None or self.arrvar is None:
                self.arr, self.arrvar = s, s / 2.0
            else:
                self.arr = ARR_KEEP * self.arr + ARR_GAIN * s
                self.arrvar = ARRVAR_KEEP * self.arrvar + ARRVAR_GAIN * abs(s - self.arr)
            self.samples += 1
        self.last_arrival = now
        self._arrivals += 1
        self._knee_pending = False

    def deadline(self) -> float | None:
        """When a knee will be declared if nobody arrives first (None: no estimate yet, or already declared)."""
        if self._knee_pending or self.arr is None or self.arrvar is None or self.last_arrival is None:
            return None
        return self.last_arrival + self.arr + DEVIATIONS * self.arrvar

    def check(self, now: float) -> float | None:
        """Declare a knee if its deadline has passed by ``now``; return the knee's time (the deadline) or None."""
        d = self.deadline()
        if d is None or now < d:
            return None
        self._knee_pending = True
        self.knees.append((d, self._arrivals))
        return d
