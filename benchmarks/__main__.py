"""The benchmark entry point: ``python -m benchmarks`` (also ``twisternet bench``).

    python -m benchmarks [--suite NAME ...] [--quick] [--repeat N] [--workers 2,4] [--json PATH]
                         [--plot DIR] [--results PATH] [--set [SUITE.]key=value ...] [--list]

Runs the chosen suites in a fixed order, each with a progress bar on stderr, prints each suite's
tables (Markdown), targets and skipped peers, writes every raw number as JSON, draws the charts as
PNGs with ``--plot`` and, with ``--results``, writes the Markdown results page (machine, command,
tables, targets, charts). A suite that raises is reported as failed and the others still run; the
exit status is then 1.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import logging
import shlex
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any
from collections.abc import Sequence

if __package__ in (None, ""):          # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import report
from benchmarks.harness import Progress, SuiteOptions, SuiteResult

__all__ = ["SUITE_MODULES", "load_suite", "run_suites", "main"]

log = logging.getLogger(__name__)

#: Every suite, in the order they run. Each is ``benchmarks.<name>`` exposing NAME, DESCRIPTION, run().
SUITE_MODULES: list[str] = ["p2p", "allreduce", "records", "streaming", "wordcount", "sort", "stragglers",
                            "innet", "coflow", "cluster", "groupby", "torch_ddp"]

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "benchmarks" / "out" / "results.json"


class SuiteUnavailable(Exception):
    """The suite's module does not exist (yet) or does not implement the suite interface."""


class _ReadTracking(dict):
    """The ``--set`` overrides handed to a suite, remembering which keys it looked at (to flag typos)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)


def load_suite(name: str) -> ModuleType:
    """Import ``benchmarks.<name>`` and check it has NAME, DESCRIPTION and run(); raises SuiteUnavailable
    when the module itself is missing or incomplete (an ImportError *inside* it propagates)."""
    module_name = f"benchmarks.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name in (module_name, "benchmarks"):
            raise SuiteUnavailable(f"no module {module_name}") from None
        raise
    missing = [a for a in ("NAME", "DESCRIPTION", "run") if not hasattr(module, a)]
    if missing:
        raise SuiteUnavailable(f"{module_name} does not implement the suite interface "
                               f"(missing {', '.join(missing)})")
    return module


def _parse_sets(items: Sequence[str]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """``key=value`` applies to every suite; ``suite.key=value`` only to that suite."""
    common: dict[str, str] = {}
    per_suite: dict[str, dict[str, str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected key=value or suite.key=value")
        suite, dot, sub = key.partition(".")
        if dot:
            per_suite.setdefault(suite, {})[sub] = value
        else:
            common[key] = value
    return common, per_suite


def _parse_workers(text: str) -> list[int]:
    try:
        workers = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--workers {text!r}: expected a comma-separated list like 2,4") from None
    if not workers or any(w < 1 for w in workers):
        raise argparse.ArgumentTypeError(f"--workers {text!r}: worker counts must be >= 1")
    return workers


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description="Run the twisternet benchmark suites.")
    ap.add_argument("--list", action="store_true", help="list the suites with their descriptions and exit")
    ap.add_argument("--suite", action="append", default=[], metavar="NAME",
                    help="run only this suite (repeatable; comma-separated lists accepted); default: all")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repetition (the CI smoke run)")
    ap.add_argument("--repeat", type=_positive, help="repetitions per measurement (medians are reported); "
                    "default 3, or 1 with --quick")
    ap.add_argument("--workers", type=_parse_workers, default=[2, 4], help="worker counts, e.g. 2,4 (default)")
    ap.add_argument("--json", default=str(DEFAULT_JSON), metavar="PATH",
                    help=f"write the raw numbers here (default {DEFAULT_JSON.relative_to(ROOT)}; '-' for none)")
    ap.add_argument("--plot", metavar="DIR", help="draw the charts as PNGs into DIR (needs matplotlib)")
    ap.add_argument("--results", metavar="PATH", help="write the Markdown results page here (charts go to "
                    "a 'results' directory next to it unless --plot says otherwise)")
    ap.add_argument("--render", metavar="JSON", help="run nothing: re-render the charts and the --results page "
                    "from a results.json saved by an earlier run")
    ap.add_argument("--set", action="append", default=[], metavar="[SUITE.]KEY=VALUE",
                    help="suite-specific override, e.g. --set allreduce.sizes=1K,1M (repeatable)")
    ap.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    return ap


def _selected(requested: Sequence[str]) -> list[str]:
    names = [n.strip() for item in requested for n in item.split(",") if n.strip()]
    if not names:
        return list(SUITE_MODULES)
    unknown = [n for n in names if n not in SUITE_MODULES]
    if unknown:
        raise ValueError(f"unknown suite(s): {', '.join(unknown)}; known: {', '.join(SUITE_MODULES)}")
    return [n for n in SUITE_MODULES if n in names]   # always in the fixed order


def list_suites(stream: Any = None) -> None:
    """Print every suite with its description, or why it is not available."""
    stream = stream or sys.stdout
    for name in SUITE_MODULES:
        try:
            mod = load_suite(name)
            desc = str(mod.DESCRIPTION)
        except SuiteUnavailable as e:
            desc = f"(not available: {e})"
        except Exception as e:  # noqa: BLE001 - listing must not crash on one broken module
            desc = f"(fails to import: {type(e).__name__}: {e})"
        stream.write(f"{name:<12} {desc}\n")
    stream.flush()


def run_suites(names: Sequence[str], *, quick: bool, repeat: int | None, workers: list[int],
               common: dict[str, str], per_suite: dict[str, dict[str, str]],
               stream: Any = None, progress_stream: Any = None) -> list[SuiteResult]:
    """Run ``names`` in order; every suite yields a SuiteResult (failed/not available ones included)."""
    stream = stream or sys.stdout
    results: list[SuiteResult] = []
    for name in names:
        t0 = time.monotonic()
        extra = _ReadTracking({**common, **per_suite.get(name, {})})
        opts = SuiteOptions(quick=quick, workers=list(workers), repeat=repeat if repeat is not None else 3,
                            repeat_given=repeat is not None,
                            progress=Progress(name, stream=progress_stream), extra=extra)
        try:
            mod = load_suite(name)
        except SuiteUnavailable as e:
            res = SuiteResult(suite=name, status="not available", error=str(e))
            results.append(res)
            stream.write(report.render_suite_text(res) + "\n")
            stream.flush()
            continue
        except Exception:  # noqa: BLE001 - a broken module fails its suite, not the run
            res = SuiteResult(suite=name, status="failed", error=traceback.format_exc())
            results.append(res)
            stream.write(report.render_suite_text(res) + "\n")
            stream.flush()
            continue
        interrupted = False
        try:
            res = mod.run(opts)
            if not isinstance(res, SuiteResult):
                raise TypeError(f"{mod.__name__}.run() returned {type(res).__name__}, not SuiteResult")
        except KeyboardInterrupt:
            res = SuiteResult(suite=name, status="failed", error="interrupted (Ctrl-C); later suites not run")
            interrupted = True
        except Exception:  # noqa: BLE001 - report it, go on with the other suites
            res = SuiteResult(suite=name, status="failed", error=traceback.format_exc())
        finally:
            if opts.progress is not None:
                opts.progress.finish()
        ignored = sorted(k for k in per_suite.get(name, {}) if k not in opts.used and k not in extra.read)
        if ignored and res.status == "ok":
            msg = f"--set {', '.join(f'{name}.{k}' for k in ignored)} not used by this suite (misspelt?)"
            res.notes.append(msg)
            sys.stderr.write(f"bench: warning: {msg}\n")
        res.suite = res.suite or name
        res.description = res.description or str(getattr(mod, "DESCRIPTION", ""))
        if not res.seconds:
            res.seconds = time.monotonic() - t0
        results.append(res)
        stream.write(report.render_suite_text(res) + "\n")
        stream.flush()
        if interrupted:
            break
    return results


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the suites, write JSON/charts/results page; 1 if any suite failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING,
                        format="bench %(levelname)s %(name)s: %(message)s")
    if a.list:
        list_suites()
        return 0
    try:
        names = _selected(a.suite)
        common, per_suite = _parse_sets(a.set)
    except ValueError as e:
        ap.error(str(e))
    bad = sorted(set(per_suite) - set(SUITE_MODULES))
    if bad:
        ap.error(f"--set names unknown suite(s): {', '.join(bad)}")
    command = "python -m benchmarks " + " ".join(shlex.quote(x) for x in argv)
    started = _dt.datetime.now(_dt.timezone.utc)

    if a.render:
        try:
            saved = json.loads(Path(a.render).read_text())
            results = [report.suite_from_json(d) for d in saved["suites"]]
            command, machine = saved["command"], saved["machine"]
            started = _dt.datetime.fromisoformat(saved["started"])
            a.quick = bool(saved.get("quick", False))
        except (OSError, ValueError, KeyError, TypeError) as e:
            ap.error(f"--render {a.render}: not a results.json written by this entry point ({e})")
        for r in results:
            sys.stdout.write(report.render_suite_text(r) + "\n")
        if a.json == str(DEFAULT_JSON):
            a.json = "-"            # never overwrite the saved numbers with themselves by default
    else:
        results = run_suites(names, quick=a.quick, repeat=a.repeat, workers=a.workers, common=common,
                             per_suite=per_suite)
        machine = report.machine_info()
    explicit = bool(a.suite)
    failed = [r.suite for r in results if r.status == "failed"
              or (explicit and r.status == "not available")]

    charts: dict[tuple[str, str], Path] = {}
    chart_note = ""
    chart_dir = Path(a.plot) if a.plot else (Path(a.results).parent / "results" if a.results else None)
    if chart_dir is not None and any(r.charts for r in results):
        if report.have_matplotlib():
            charts = report.write_charts(results, chart_dir)
            sys.stderr.write(f"bench: wrote {len(charts)} chart(s) to {chart_dir}\n")
        else:
            chart_note = "No charts: matplotlib is not installed (pip install matplotlib)."
            sys.stderr.write("bench: --plot/--results charts need matplotlib, which is not installed "
                             "(pip install matplotlib); continuing without charts\n")

    if a.json and a.json != "-":
        path = Path(a.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"command": command, "started": started.isoformat(), "quick": a.quick, "workers": a.workers,
               "repeat": a.repeat, "machine": machine, "suites": [r.to_json() for r in results],
               "charts": {f"{s}/{c}": str(p) for (s, c), p in charts.items()}}
        path.write_text(json.dumps(doc, indent=1))
        sys.stderr.write(f"bench: wrote raw numbers to {path}\n")
    if a.results:
        page = Path(a.results)
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(report.render_results(results, machine=machine, command=command, charts=charts,
                                              page_dir=page.parent, when=started, chart_note=chart_note,
                                              quick=a.quick))
        sys.stderr.write(f"bench: wrote the results page {page}\n")

    missed = [f"{r.suite}: {t.name}" for r in results for t in r.targets if t.met is False]
    if missed:
        sys.stdout.write("Targets missed: " + "; ".join(missed) + "\n")
    if failed:
        sys.stdout.write(f"FAILED suites: {', '.join(failed)}\n")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
