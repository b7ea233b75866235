"""Creation parameters of barriers, semaphores and throttles, validated once, comparable, and msgpack-able.

The service compares the spec carried by every enter message of a named object with the one it was created
with: all participants must agree, and a mismatch is reported to the offender.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any
from collections.abc import Mapping

from .errors import BarrierSpecError

LATE_MODES = ("pass", "catch_up")
Number = int | float


def _opt_positive(param: str, value: Number | None, *, allow_zero: bool = False) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or math.isinf(value):
        raise BarrierSpecError(param, f"must be a finite number or None, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise BarrierSpecError(param, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _positive_int(param: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BarrierSpecError(param, f"must be an int >= 1, got {value!r}")
    return value


def _opt_percent(param: str, value: Number | None) -> float | None:
    if value is None:
        return None
    v = _opt_positive(param, value)
    assert v is not None
    if v > 100:
        raise BarrierSpecError(param, f"must be in (0, 100], got {value!r}")
    return v


def percent_count(percent: float, total: int) -> int:
    """The smallest count that is at least ``percent``% of ``total`` (never below 1).

    Computed as ceil(percent * total / 100) on a value rounded to 9 decimals, so that 10% of 30 is exactly 3
    and not 4 because of binary floating point.
    """
    return max(1, math.ceil(round(percent * total / 100.0, 9)))


@dataclass(frozen=True)
class BarrierSpec:
    """Parameters of a (partial) barrier; see ``PartialBarrierMachine`` for their exact semantics."""

    max: int
    timeout: float | None = None
    percent: float | None = None
    min_wait: float | None = None
    late: str = "pass"
    knee: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "max", _positive_int("max", self.max))
        object.__setattr__(self, "timeout", _opt_positive("timeout", self.timeout))
        object.__setattr__(self, "percent", _opt_percent("percent", self.percent))
        object.__setattr__(self, "min_wait", _opt_positive("min_wait", self.min_wait, allow_zero=True))
        if self.late not in LATE_MODES:
            raise BarrierSpecError("late", f"must be one of {LATE_MODES}, got {self.late!r}")
        if not isinstance(self.knee, bool):
            raise BarrierSpecError("knee", f"must be a bool, got {self.knee!r}")

    @property
    def classic(self) -> bool:
        """True when no relaxation is set: the barrier fires only when all ``max`` labels entered."""
        return self.timeout is None and self.percent is None and self.min_wait is None and not self.knee

    @property
    def percent_threshold(self) -> int | None:
        """Unique labels needed by the percent rule (None when ``percent`` is unset)."""
        return None if self.percent is None else percent_count(self.percent, self.max)

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-able dict, tagged with ``kind``."""
        return {"kind": "barrier", **asdict(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BarrierSpec:
        """Inverse of ``to_dict``; raises BarrierSpecError naming a bad or unknown key."""
        return _from_dict(cls, "barrier", d)


@dataclass(frozen=True)
class SemaphoreSpec:
    """Parameters of a ``SemaphoreBarrierMachine``: ``n`` initial holders, hold timeout, optional adaptive window."""

    n: int
    hold_timeout: float | None = None
    adaptive_window: int | None = None
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", _positive_int("n", self.n))
        object.__setattr__(self, "hold_timeout", _opt_positive("hold_timeout", self.hold_timeout))
        if self.adaptive_window is not None:
            _positive_int("adaptive_window", self.adaptive_window)
        if self.max_concurrency is not None:
            _positive_int("max_concurrency", self.max_concurrency)
            if self.max_concurrency < self.n:
                raise BarrierSpecError("max_concurrency", f"must be >= n={self.n}, got {self.max_concurrency}")

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-able dict, tagged with ``kind``."""
        return {"kind": "semaphore", **asdict(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SemaphoreSpec:
        """Inverse of ``to_dict``; raises BarrierSpecError naming a bad or unknown key."""
        return _from_dict(cls, "semaphore", d)


@dataclass(frozen=True)
class ThrottleSpec:
    """Parameters of a ``ThrottledRelease``: per ``period``, release ``count`` or ``percent``% of ``max``."""

    period: float
    count: int | None = None
    percent: float | None = None
    max: int | None = None
    adaptive_window: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "period", _opt_positive("period", self.period))
        if self.period is None:
            raise BarrierSpecError("period", "is required")
        if (self.count is None) == (self.percent is None):
            raise BarrierSpecError("count", "give exactly one of count and percent")
        if self.count is not None:
            _positive_int("count", self.count)
        object.__setattr__(self, "percent", _opt_percent("percent", self.percent))
        if self.max is not None:
            _positive_int("max", self.max)
        if self.percent is not None and self.max is None:
            raise BarrierSpecError("max", "is required with percent (the percentage is of max)")
        if self.adaptive_window is not None:
            _positive_int("adaptive_window", self.adaptive_window)

    @property
    def per_period(self) -> int:
        """How many entrants one period releases initially."""
        if self.count is not None:
            return self.count
        assert self.percent is not None and self.max is not None
        return percent_count(self.percent, self.max)

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-able dict, tagged with ``kind``."""
        return {"kind": "throttle", **asdict(self)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ThrottleSpec:
        """Inverse of ``to_dict``; raises BarrierSpecError naming a bad or unknown key."""
        return _from_dict(cls, "throttle", d)


AnySpec = BarrierSpec | SemaphoreSpec | ThrottleSpec
_KINDS: dict[str, Any] = {"barrier": BarrierSpec, "semaphore": SemaphoreSpec, "throttle": ThrottleSpec}


def _from_dict(cls: Any, kind: str, d: Mapping[str, Any]) -> Any:
    if not isinstance(d, Mapping):
        raise BarrierSpecError("spec", f"must be a dict, got {type(d).__name__}")
    if d.get("kind", kind) != kind:
        raise BarrierSpecError("kind", f"expected {kind!r}, got {d.get('kind')!r}")
    fields = {k: v for k, v in d.items() if k != "kind"}
    unknown = set(fields) - set(cls.__dataclass_fields__)
    if unknown:
        raise BarrierSpecError(sorted(unknown)[0], f"unknown {kind} parameter")
    try:
        return cls(**fields)
    except TypeError as exc:
        raise BarrierSpecError("spec", str(exc)) from None


def spec_from_dict(d: Mapping[str, Any]) -> AnySpec:
    """Build the spec a ``kind``-tagged dict describes."""
    if not isinstance(d, Mapping):
        raise BarrierSpecError("spec", f"must be a dict, got {type(d).__name__}")
    if d.get("kind") not in _KINDS:
        raise BarrierSpecError("kind", f"must be one of {sorted(_KINDS)}, got {d.get('kind')!r}")
    return _KINDS[d["kind"]].from_dict(d)
