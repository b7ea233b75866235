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
from typing import Any, Callable, TextIO


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


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

    def set_total(self, total: int) -> None:
        self.total = max(0, int(total))
        self.done = 0

    def step(self, label: str) -> None:
        """Announce the next run (counts the previous one as done)."""
        if self.done < self.total:
            self.done += 1
        self._draw(label)

    def finish(self) -> None:
        self.done = self.total
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

    def bar(self, suite: str) -> Progress:
        if self.progress is None:
            self.progress = Progress(suite)
        return self.progress


SuiteRun = Callable[[SuiteOptions], SuiteResult]
