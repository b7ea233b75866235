"""The benchmark suites' common interface: options in, tables/charts/targets/raw numbers out.

Every suite module under ``benchmarks/`` exposes ``NAME`` (short name used on the command line),
``DESCRIPTION`` (one line) and ``run(opts: SuiteOptions) -> SuiteResult``. The entry point
(``python -m benchmarks`` / ``twisternet bench``) runs the chosen suites, prints their tables, writes
the raw numbers as JSON, draws the charts with ``--plot`` and renders ``benchmarks/RESULTS.md``.
Suites measure their peers in the same run and report ratios against them; a peer that cannot run
here (not installed, no MPI) is listed in ``SuiteResult.skipped`` with the reason, never silently
dropped.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO
from collections.abc import Callable


@dataclass
class Table:
    """One result table: ``rows`` hold plain numbers/strings (formatted when rendered)."""

    title: str
    headers: list[str]
    rows: list[list[Any]]
    note: str = ""


@dataclass
class Chart:
    """A line chart: ``series`` maps a label to ``(x, y)`` points; drawn to ``<name>.png`` with --plot."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    series: dict[str, list[tuple[float, float]]]
    logx: bool = False
    logy: bool = False


@dataclass
class Target:
    """A stated performance target and what this run measured against it (``met`` None: not measured)."""

    name: str
    wanted: str
    measured: str
    met: bool | None


@dataclass
class SuiteResult:
    """Everything a suite reports."""

    suite: str
    tables: list[Table] = field(default_factory=list)
    charts: list[Chart] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)   # "peer: reason" for peers that could not run
    raw: dict[str, Any] = field(default_factory=dict)  # every measured sample, JSON-serialisable
    seconds: float = 0.0
    status: str = "ok"             # "ok", "failed" (the suite raised) or "not available" (no module)
    error: str = ""                # the traceback / reason when status is not "ok"
    description: str = ""          # the suite module's DESCRIPTION, filled in by the entry point
    notes: list[str] = field(default_factory=list)  # free-form remarks shown under the suite's tables

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field (tuples become lists, odd objects become strings)."""
        return _jsonable(asdict(self))

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal).

    Suites call :meth:`set_total` once they know how many runs they will do, then :meth:`step` before
    each run with a short label.
    """

    def __init__(self, suite: str, stream: TextIO | None = None, width: int = 30) -> None:
        self.suite = suite
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.total = 0
        self.done = 0
        self.t0 = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._running = False      # a run was announced and has not been counted yet

    def set_total(self, total: int) -> None:
        self.total = max(0, int(total))
        self.done = 0
        self._running = False

    def step(self, label: str) -> None:
        """Announce the next run (counts the previous one as done)."""
        if self._running and self.done < self.total:
            self.done += 1
        self._running = True
        self._draw(label)

    def finish(self) -> None:
        self.done = self.total
        self._running = False
        self._draw("done")
        if self._tty:
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, label: str) -> None:
        total = max(self.total, 1)
        filled = int(self.width * min(self.done, total) / total)
        bar = "#" * filled + "-" * (self.width - filled)
        line = (f"[{self.suite}] [{bar}] {min(self.done, total)}/{self.total} "
                f"{time.monotonic() - self.t0:6.1f}s {label}")
        if self._tty:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


@dataclass
class SuiteOptions:
    """What the entry point passes to every suite."""

    quick: bool = False            # tiny sizes, one repetition: the CI smoke run
    workers: list[int] = field(default_factory=lambda: [2, 4])
    repeat: int = 3                # repetitions; suites report medians
    progress: Progress | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # suite-specific overrides (--set key=value)
    repeat_given: bool = False     # --repeat was given explicitly (then it applies to --quick runs too)
    used: set[str] = field(default_factory=set, repr=False)  # the extra keys the suite asked for via get()

    def bar(self, suite: str) -> Progress:
        if self.progress is None:
            self.progress = Progress(suite)
        return self.progress

    def get(self, key: str, default: Any) -> Any:
        """The ``--set key=value`` override of ``key`` converted to the type of ``default``, else ``default``.

        Lists are given comma-separated (``sizes=1K,64K``); byte sizes accept K/M/G suffixes when the
        default holds ints. A value that does not convert raises ValueError naming the key.
        """
        self.used.add(key)
        if key not in self.extra:
            return default
        value = self.extra[key]
        if not isinstance(value, str) or isinstance(default, str) or default is None:
            return value
        try:
            if isinstance(default, bool):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            if isinstance(default, int):
                return parse_size(value)
            if isinstance(default, float):
                return float(value)
            if isinstance(default, (list, tuple)):
                items = [t for t in value.split(",") if t.strip()]
                if default and isinstance(default[0], float):
                    return [float(t) for t in items]
                if default and isinstance(default[0], str):
                    return [t.strip() for t in items]
                return [parse_size(t) for t in items]
        except ValueError:
            raise ValueError(f"--set {key}={value}: expected a value like {default!r}") from None
        return value

    def repeats(self, default: int | None = None) -> int:
        """How many repetitions to run: 1 in quick mode unless --repeat was given explicitly."""
        if self.repeat_given:
            return max(1, self.repeat)
        if self.quick:
            return 1
        return max(1, default if default is not None else self.repeat)


_SIZE_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64K"`` -> 65536, ``"1M"`` -> 1048576, ``"123"`` -> 123 (binary units, case-insensitive)."""
    tok = text.strip().upper().removesuffix("B")
    mult = _SIZE_SUFFIX.get(tok[-1:], 1)
    number = tok[:-1] if mult > 1 else tok
    try:
        value = int(number) * mult
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 1024, 64K, 16M, 1G)") from None
    if value < 0:
        raise ValueError(f"not a size: {text!r} (negative)")
    return value


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either side was not measured (so tables show n/a, never a fake number)."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "item"):          # numpy scalars
        return obj.item()
    return str(obj)


SuiteRun = Callable[[SuiteOptions], SuiteResult]
