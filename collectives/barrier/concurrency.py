"""Admission policies for semaphores and throttles, including the paper's adaptive concurrency rule.

After each completion a policy says how many waiting entrants to admit *in place of* the one that finished:
0 shrinks the concurrency by one, 1 keeps it, 2 grows it by one.

``AdaptiveConcurrency`` (Albrecht et al., ATC 2006) keeps every completion time (how long a holder held
its slot) and compares the median of the last ``window`` (C) with the median of all of them:

* recent median more than 50% slower than the overall median -> admit 0;
* from 10% up to and including 50% slower                    -> admit 1;
* otherwise (less than 10% slower, or faster)                -> admit 2.

The comparisons are exact (rational arithmetic), so the 10% and 50% boundaries behave as written. With
fewer than ``window`` completions the recent window is all of them, the medians agree and the policy admits
2 (it grows until completions slow down, like a slow start).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Protocol, runtime_checkable


@runtime_checkable
class ConcurrencyPolicy(Protocol):
    """Decides, after a completion, how many waiting entrants replace the one that completed."""

    def record(self, duration: float) -> None:
        """Note one completion that took ``duration`` seconds."""
        ...

    def admit_count(self) -> int:
        """How many to admit now (>= 0)."""
        ...


def exact_median(values: list[float]) -> Fraction:
    """The median of ``values`` as an exact fraction (the mean of the two middle ones for an even count)."""
    xs = sorted(Fraction(v) for v in values)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


class FixedConcurrency:
    """The plain semaphore rule: every completion frees exactly one slot (admit 1)."""

    def record(self, duration: float) -> None:
        """Completion times do not matter to a fixed policy."""

    def admit_count(self) -> int:
        """Always 1."""
        return 1


class AdaptiveConcurrency:
    """The paper's rule: median of the last ``window`` completion times against the median of all."""

    def __init__(self, window: int = 8) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        self.window = window
        self._durations: list[float] = []

    @property
    def durations(self) -> list[float]:
        """Every completion time recorded, oldest first."""
        return list(self._durations)

    def record(self, duration: float) -> None:
        """Note one completion that took ``duration`` (>= 0) seconds."""
        if duration < 0:
            raise ValueError(f"a completion time cannot be negative, got {duration!r}")
        self._durations.append(float(duration))

    def slowdown(self) -> Fraction:
        """(median of the last window) / (median of all) - 1, exactly; 0 before any completion."""
        if not self._durations:
            return Fraction(0)
        recent = exact_median(self._durations[-self.window:])
        overall = exact_median(self._durations)
        if overall == 0:
            return Fraction(0) if recent == 0 else Fraction(10**9)
        return recent / overall - 1

    def admit_count(self) -> int:
        """0, 1 or 2 as the module docstring says."""
        s = self.slowdown()
        if s > Fraction(1, 2):
            return 0
        if s >= Fraction(1, 10):
            return 1
        return 2
