"""Rendering of benchmark results: Markdown tables for the terminal, PNG charts and ``RESULTS.md``.

Everything here works on :class:`~benchmarks.harness.SuiteResult` objects (or their JSON form), so a
results page can be regenerated from a saved ``results.json`` without re-running anything.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Sequence

from benchmarks.harness import Chart, SuiteResult, Table, Target

__all__ = ["format_cell", "markdown_table", "render_table", "render_targets", "render_suite_text",
           "machine_info", "render_results", "write_charts", "have_matplotlib", "suite_from_json"]

log = logging.getLogger(__name__)

#: Packages whose versions the results page states (read at run time, absent ones shown as such).
VERSIONED_PACKAGES = ("numpy", "msgpack", "mpi4py", "mpich", "torch", "ray", "matplotlib")


def format_cell(value: Any) -> str:
    """A table cell: None -> ``n/a``; floats to 3 significant figures (no exponent above 1)."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:          # NaN
            return "n/a"
        a = abs(value)
        if a == 0:
            return "0"
        if a >= 1000:
            return f"{value:,.0f}"
        if a >= 100:
            return f"{value:.0f}"
        if a >= 10:
            return f"{value:.1f}"
        if a >= 0.01:
            return f"{value:.2f}" if a >= 1 else f"{value:.3f}"
        return f"{value:.3g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A Markdown table with aligned columns; cells go through :func:`format_cell`."""
    cells = [[format_cell(c) for c in r] for r in rows]
    heads = [format_cell(h) for h in headers]
    for r in cells:
        if len(r) != len(heads):
            raise ValueError(f"table row has {len(r)} cells, the header {len(heads)}: {r}")
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(heads)]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(heads), sep, *map(line, cells)])


def render_table(t: Table) -> str:
    """A titled Markdown table (title in bold, the note in italics underneath)."""
    out = [f"**{t.title}**", "", markdown_table(t.headers, t.rows)]
    if t.note:
        out += ["", f"_{t.note}_"]
    return "\n".join(out)


def _target_word(met: bool | None) -> str:
    return "MET" if met is True else "MISSED" if met is False else "NOT MEASURED"


def render_targets(targets: Sequence[Target]) -> str:
    """One line per target, saying plainly whether it was met."""
    return "\n".join(f"- **{_target_word(t.met)}**: {t.name}: wanted {t.wanted}; measured {t.measured}"
                     for t in targets)


def render_suite_text(r: SuiteResult) -> str:
    """What the entry point prints for one suite: tables, targets, skipped peers, notes or the error."""
    head = f"## {r.suite}" + (f" — {r.description}" if r.description else "")
    out = [head, ""]
    if r.status == "not available":
        out.append(f"not available: {r.error}")
        return "\n".join(out)
    for t in r.tables:
        out += [render_table(t), ""]
    if r.targets:
        out += ["Targets:", render_targets(r.targets), ""]
    if r.skipped:
        out += ["Skipped peers:", *(f"- {s}" for s in r.skipped), ""]
    for n in r.notes:
        out.append(f"Note: {n}")
    if r.status == "failed":
        out += [f"FAILED after {r.seconds:.1f} s:", "", _indent(r.error)]
    else:
        out.append(f"({r.seconds:.1f} s)")
    return "\n".join(out).rstrip() + "\n"


def run_standalone(name: str, run: Any, opts: Any, json_path: str | None = None) -> SuiteResult:
    """A suite's own command line: run it, close its progress bar, print its text report, and write its
    JSON when asked (what ``python benchmarks/<suite>.py`` does; the entry point does more)."""
    import json
    res = run(opts)
    opts.bar(name).finish()
    print(render_suite_text(res))
    if json_path:
        Path(json_path).write_text(json.dumps(res.to_json(), indent=1))
    return res


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


# --------------------------------------------------------------------------------------- machine

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _ram_bytes() -> int | None:
    try:
        import psutil
        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - psutil is optional here
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _physical_cores() -> int | None:
    try:
        import psutil
        return psutil.cpu_count(logical=False)
    except Exception:  # noqa: BLE001
        return None


def _mpi_library() -> str | None:
    """The MPI library's own version string, asked of a child process (so MPI is never initialised here)."""
    code = ("import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
            "print(' '.join(MPI.Get_library_version().split('\\n')[0].split()))")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() or None if p.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    """The machine the numbers were measured on, read at run time: CPU, cores, RAM, OS, Python, packages."""
    versions: dict[str, str | None] = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    ram = _ram_bytes()
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": _physical_cores(),
        "usable_cores": affinity,
        "ram_gb": round(ram / (1 << 30), 1) if ram else None,
        "os": platform.platform(),
        "kernel": platform.release(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "packages": versions,
        "mpi_library": _mpi_library() if versions.get("mpi4py") else None,
    }


def _machine_lines(m: dict[str, Any]) -> list[str]:
    pk = m.get("packages", {})
    pkgs = ", ".join(f"{k} {v}" if v else f"{k} (not installed)" for k, v in pk.items())
    cores = f"{m.get('logical_cores')} logical"
    if m.get("physical_cores"):
        cores += f", {m['physical_cores']} physical"
    if m.get("usable_cores") and m.get("usable_cores") != m.get("logical_cores"):
        cores += f", {m['usable_cores']} usable by this process"
    lines = [f"- CPU: {m.get('cpu')} ({cores})",
             f"- RAM: {m.get('ram_gb')} GB" if m.get("ram_gb") else "- RAM: unknown",
             f"- OS: {m.get('os')}",
             f"- Python: {m.get('python')}",
             f"- Packages: {pkgs}"]
    if m.get("mpi_library"):
        lines.append(f"- MPI library: {m['mpi_library']}")
    return lines


# --------------------------------------------------------------------------------------- charts

def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (``--plot`` and the results page's charts need it)."""
    import importlib.util
    return importlib.util.find_spec("matplotlib") is not None


def chart_filename(suite: str, chart: Chart) -> str:
    """The PNG file name of ``chart``: the suite name prefixes it unless the chart name already does."""
    base = chart.name if chart.name.startswith(suite) else f"{suite}_{chart.name}"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in base) + ".png"


def _human_bytes(v: float) -> str:
    for unit, k in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if v >= k:
            return f"{v / k:g}{unit}"
    return f"{v:g}"


def write_charts(results: Sequence[SuiteResult], directory: str | os.PathLike[str]) -> dict[tuple[str, str], Path]:
    """Draw every chart of ``results`` as a PNG in ``directory``; returns (suite, chart name) -> path.

    Raises ImportError (with an install hint) when matplotlib is absent; a chart without points is
    skipped with a log message.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, MaxNLocator
    except ImportError as e:
        raise ImportError("charts need matplotlib: pip install matplotlib "
                          "(or the 'bench' extra: pip install '.[bench]')") from e
    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: dict[tuple[str, str], Path] = {}
    for r in results:
        for c in r.charts:
            points = {label: sorted((float(x), float(y)) for x, y in pts if y is not None)
                      for label, pts in c.series.items()}
            points = {k: v for k, v in points.items() if v}
            if not points:
                log.info("chart %s/%s has no points; not drawn", r.suite, c.name)
                continue
            fig, ax = plt.subplots(figsize=(7, 4.2))
            for label, pts in points.items():
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            if c.logx:
                ax.set_xscale("log", base=2)
                if "byte" in c.xlabel:
                    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _human_bytes(v)))
            elif all(float(x).is_integer() for pts in points.values() for x, _ in pts):
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))   # e.g. worker counts
            if c.logy:
                ax.set_yscale("log")
            ax.set_xlabel(c.xlabel)
            ax.set_ylabel(c.ylabel)
            ax.set_title(c.title)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
            fig.tight_layout()
            path = out_dir / chart_filename(r.suite, c)
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written[(r.suite, c.name)] = path
    return written


# --------------------------------------------------------------------------------------- page

def render_results(results: Sequence[SuiteResult], *, machine: dict[str, Any], command: str,
                   charts: dict[tuple[str, str], Path] | None = None, page_dir: str | os.PathLike[str] = ".",
                   when: _dt.datetime | None = None, chart_note: str = "", quick: bool = False) -> str:
    """The Markdown results page: machine, command, a summary, then per suite tables, targets,
    skipped peers and charts (relative links from ``page_dir``)."""
    when = when or _dt.datetime.now(_dt.timezone.utc)
    charts = charts or {}
    out = ["# twisternet benchmark results", "",
           "_Generated by the benchmark entry point; do not edit by hand — re-run the command below._", "",
           f"Produced {when.strftime('%Y-%m-%d %H:%M UTC')} by:", "", "```", command, "```", "",
           "## Machine", "", *_machine_lines(machine), ""]
    if quick:
        out += ["**This is a quick (smoke) run: tiny sizes, one repetition; the figures are not "
                "representative and targets at large sizes are not measured.**", ""]
    out += ["## Summary", "", markdown_table(
        ["suite", "status", "targets met", "targets missed", "peers skipped", "seconds"],
        [[r.suite, r.status, sum(t.met is True for t in r.targets), sum(t.met is False for t in r.targets),
          len(r.skipped), round(r.seconds, 1)] for r in results]), ""]
    missed = [(r.suite, t) for r in results for t in r.targets if t.met is False]
    if missed:
        out += ["**Targets missed in this run:**", "",
                *(f"- {s}: {t.name}: wanted {t.wanted}; measured {t.measured}" for s, t in missed), ""]
    elif any(r.targets for r in results):
        out += ["Every measured target was met in this run.", ""]
    if chart_note:
        out += [f"_{chart_note}_", ""]
    for r in results:
        out += [f"## {r.suite}", ""]
        if r.description:
            out += [r.description, ""]
        if r.status == "not available":
            out += [f"Not available: {r.error}", ""]
            continue
        if r.status == "failed":
            out += [f"**FAILED** after {r.seconds:.1f} s; partial results (if any) follow.", "",
                    "```", r.error.rstrip(), "```", ""]
        for t in r.tables:
            out += [render_table(t), ""]
        if r.targets:
            out += ["Targets:", "", render_targets(r.targets), ""]
        if r.skipped:
            out += ["Peers skipped:", "", *(f"- {s}" for s in r.skipped), ""]
        for n in r.notes:
            out += [f"Note: {n}", ""]
        for c in r.charts:
            path = charts.get((r.suite, c.name))
            if path is not None:
                rel = os.path.relpath(path, page_dir).replace(os.sep, "/")
                out += [f"![{c.title}]({rel})", ""]
    return "\n".join(out).rstrip() + "\n"


def suite_from_json(d: dict[str, Any]) -> SuiteResult:
    """Rebuild a SuiteResult from :meth:`SuiteResult.to_json` output (to re-render a saved run)."""
    d = dict(d)
    d["tables"] = [Table(**t) for t in d.get("tables", [])]
    d["charts"] = [Chart(**{**c, "series": {k: [tuple(p) for p in v] for k, v in c["series"].items()}})
                   for c in d.get("charts", [])]
    d["targets"] = [Target(**t) for t in d.get("targets", [])]
    known = SuiteResult.__dataclass_fields__
    return SuiteResult(**{k: v for k, v in d.items() if k in known})
