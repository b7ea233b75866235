"""Allreduce time vs size on the emulated cluster as an SVG chart and a markdown table, from the JSON of
``benchmarks/cluster.py --json OUT`` (no plotting library: the SVG text is written here).

    python benchmarks/cluster_chart.py OUT.json [--k 2] [--peers "tn auto,MPICH,torch gloo"]
                                       [--svg docs/img/cluster-allreduce.svg] [--md table.md]

Log-log axes: x the message size in bytes, y milliseconds per call (slowest rank, median over launches);
one polyline per peer plus the bandwidth bound 2(H-1)/H * S/B (dashed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from collections.abc import Sequence
from xml.sax.saxutils import escape

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def fmt_size(n: float) -> str:
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_ms(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def svg_chart(title: str, series: dict[str, list[tuple[float, float]]], dashed: Sequence[str] = (),
              width: int = 760, height: int = 460) -> str:
    """A log-log line chart of ``series`` ({label: [(x, y), ...]}) as SVG text."""
    pts = [p for s in series.values() for p in s if p[0] > 0 and p[1] > 0]
    if not pts:
        raise ValueError("nothing to plot")
    left, right, top, bottom = 70, 190, 40, 50
    pw, ph = width - left - right, height - top - bottom
    x0, x1 = math.floor(math.log10(min(p[0] for p in pts))), math.ceil(math.log10(max(p[0] for p in pts)))
    y0, y1 = math.floor(math.log10(min(p[1] for p in pts))), math.ceil(math.log10(max(p[1] for p in pts)))
    x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)

    def X(x: float) -> float:
        return left + (math.log10(x) - x0) / (x1 - x0) * pw

    def Y(y: float) -> float:
        return top + ph - (math.log10(y) - y0) / (y1 - y0) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left + pw / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for e in range(x0, x1 + 1):                     # vertical grid at powers of ten (and 2^k sizes labelled)
        x = X(10 ** e)
        out.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#ddd"/>')
    for e in range(y0, y1 + 1):
        y = Y(10 ** e)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{fmt_ms(10 ** e)}</text>')
    xs = sorted({p[0] for p in pts})
    for x in xs:
        out.append(f'<text x="{X(x):.1f}" y="{top + ph + 18}" text-anchor="middle">{fmt_size(x)}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 10}" text-anchor="middle">message size (log)</text>')
    out.append(f'<text x="16" y="{top + ph / 2}" text-anchor="middle" transform="rotate(-90 16 {top + ph / 2})">'
               'ms per call, slowest rank (log)</text>')
    for i, (label, s) in enumerate(series.items()):
        s = sorted(p for p in s if p[0] > 0 and p[1] > 0)
        color = "#555" if label in dashed else COLORS[i % len(COLORS)]
        dash = ' stroke-dasharray="6 4"' if label in dashed else ""
        path = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in s)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for x, y in s:
            out.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3" fill="{color}"/>')
        ly = top + 10 + 18 * i
        out.append(f'<line x1="{left + pw + 12}" y1="{ly}" x2="{left + pw + 36}" y2="{ly}" stroke="{color}" '
                   f'stroke-width="2"{dash}/>')
        out.append(f'<text x="{left + pw + 42}" y="{ly + 4}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def markdown(series: dict[str, list[tuple[float, float]]]) -> str:
    names = list(series)
    sizes = sorted({x for s in series.values() for x, _ in s})
    rows = ["| size | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for x in sizes:
        vals = [dict(series[n]).get(x) for n in names]
        rows.append(f"| {fmt_size(x)} | " + " | ".join("n/a" if v is None else fmt_ms(v) for v in vals) + " |")
    return "\n".join(rows) + "\n"


def series_from(result: dict, k: int, peers: Sequence[str] | None) -> tuple[str, dict[str, list[tuple[float, float]]]]:
    raw = result["raw"]
    med = raw["median_s"].get(str(k)) or raw["median_s"].get(k)
    if med is None:
        raise SystemExit(f"no results for {k} rank(s) per host in this file (have {list(raw['median_s'])})")
    names = [p for p in (peers or list(med)) if p in med]
    series = {n: [(float(s), v * 1e3) for s, v in med[n].items()] for n in names}
    series["bound"] = [(float(s), v * 1e3) for s, v in raw["bound_s"].items()]
    title = f"float32 allreduce, {raw['hosts']} hosts x {k} ranks, links {raw['rate']}"
    return title, series


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--k", type=int, default=2, help="ranks per host of the runs to draw")
    ap.add_argument("--peers", help="peer names separated by ';' (or ',' if no ';'), default: all in the file")
    ap.add_argument("--svg", default="cluster-allreduce.svg")
    ap.add_argument("--md")
    a = ap.parse_args(argv)
    result = json.loads(Path(a.json).read_text())
    if isinstance(result, list):
        result = next(r for r in result if r.get("suite") == "cluster")
    peers = a.peers.split(";" if ";" in (a.peers or "") else ",") if a.peers else None
    title, series = series_from(result, a.k, [p.strip() for p in peers] if peers else None)
    Path(a.svg).parent.mkdir(parents=True, exist_ok=True)
    Path(a.svg).write_text(svg_chart(title, series, dashed=["bound"]))
    table = markdown(series)
    if a.md:
        Path(a.md).write_text(table)
    sys.stdout.write(table)
    sys.stderr.write(f"cluster_chart: wrote {a.svg}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
