"""The public coflow-benchmark trace format (as in FB2010-1Hr-150-0.txt): parsing and writing.

Format (whitespace separated; blank lines and trailing whitespace are ignored)::

    <num_ports> <num_coflows>
    <coflow id> <arrival ms> <num mappers> <mapper port>... <num reducers> <reducer port>:<MB>...

One line per coflow. A reducer's ``MB`` (a float, 1 MB = 2**20 bytes) is the total shuffle input it
receives, spread equally over the mappers, so the flow mapper -> reducer carries ``MB / num_mappers``.
Ports are 0-based and must be below ``num_ports``; a mapper port listed twice means two flows from it.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from collections.abc import Iterable

import numpy as np

from .errors import CoflowError, TraceFormatError
from .model import MB, Coflow, PortCapacities
from .rate_allocation import effective_bottleneck

__all__ = ["TraceCoflow", "Trace", "parse_trace", "read_trace", "format_trace", "write_trace",
           "published_trace_path", "PUBLISHED_TRACE_NAME", "PUBLISHED_TRACE_ENV"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceCoflow:
    """One coflow line of a trace: id, arrival (ms), mapper ports and (reducer port, MB) pairs."""

    id: int
    arrival_ms: float
    mappers: tuple[int, ...]
    reducers: tuple[tuple[int, float], ...]

    @property
    def total_mb(self) -> float:
        """Total shuffle MB of the coflow (sum over reducers)."""
        return float(sum(mb for _, mb in self.reducers))

    @property
    def num_flows(self) -> int:
        """Number of flows: mappers x reducers with bytes."""
        return len(self.mappers) * sum(1 for _, mb in self.reducers if mb > 0)

    def to_coflow(self, deadline: float | None = None) -> Coflow:
        """The coflow (arrival in seconds, bytes per flow = MB * 2**20 / num mappers)."""
        m = np.asarray(self.mappers, dtype=np.int64)
        red = [(p, mb) for p, mb in self.reducers if mb > 0]
        rp = np.asarray([p for p, _ in red], dtype=np.int64)
        rb = np.asarray([mb for _, mb in red], dtype=np.float64) * MB / len(m)
        src = np.tile(m, len(rp))
        dst = np.repeat(rp, len(m))
        size = np.repeat(rb, len(m))
        return Coflow(self.id, self.arrival_ms / 1000.0, deadline=deadline, src=src, dst=dst, size=size)

    def format(self) -> str:
        """This coflow as one trace line."""
        parts = [str(self.id), _fmt_num(self.arrival_ms), str(len(self.mappers))]
        parts += [str(p) for p in self.mappers]
        parts.append(str(len(self.reducers)))
        parts += [f"{p}:{_fmt_num(mb)}" for p, mb in self.reducers]
        return " ".join(parts)


@dataclass
class Trace:
    """A parsed trace: the fabric's port count and the coflow lines in file order."""

    num_ports: int
    coflows: list[TraceCoflow] = field(default_factory=list)

    def capacities(self, rate: float) -> PortCapacities:
        """``num_ports`` ingress and egress ports of ``rate`` bytes/s."""
        return PortCapacities.uniform(self.num_ports, rate)

    def to_coflows(self, capacities: PortCapacities | None = None,
                   deadline_slack: float | None = None) -> list[Coflow]:
        """Coflows of the trace; with ``deadline_slack`` each gets deadline = slack * its isolated minimum
        CCT (Γ over ``capacities``, i.e. the time it would take alone on an idle fabric). Coflows with no
        bytes at all are skipped (logged)."""
        out: list[Coflow] = []
        for tc in self.coflows:
            if tc.total_mb <= 0:
                log.warning("trace coflow %s has no bytes; skipped", tc.id)
                continue
            c = tc.to_coflow()
            if deadline_slack is not None:
                if capacities is None:
                    raise CoflowError("deadline_slack needs capacities")
                if not (deadline_slack > 0):
                    raise CoflowError(f"deadline_slack must be > 0, got {deadline_slack!r}")
                g = effective_bottleneck(c, capacities.ingress, capacities.egress)
                c.deadline = deadline_slack * g
            out.append(c)
        return out


def _fmt_num(x: float) -> str:
    if float(x).is_integer() and abs(x) < 2 ** 53:
        return str(int(x))
    return repr(float(x))


def _int(tok: str, what: str, line_no: int, source: str) -> int:
    try:
        v = int(tok)
    except ValueError:
        raise TraceFormatError(line_no, f"{what} must be an integer, got {tok!r}", source) from None
    return v


def _float(tok: str, what: str, line_no: int, source: str) -> float:
    try:
        v = float(tok)
    except ValueError:
        raise TraceFormatError(line_no, f"{what} must be a number, got {tok!r}", source) from None
    if not math.isfinite(v):
        raise TraceFormatError(line_no, f"{what} must be finite, got {tok!r}", source)
    return v


def _parse_line(toks: list[str], line_no: int, num_ports: int, source: str) -> TraceCoflow:
    if len(toks) < 5:
        raise TraceFormatError(line_no, f"coflow line needs at least 5 fields, got {len(toks)}", source)
    cid = _int(toks[0], "coflow id", line_no, source)
    arrival = _float(toks[1], "arrival time (ms)", line_no, source)
    if arrival < 0:
        raise TraceFormatError(line_no, f"arrival time must be >= 0, got {toks[1]}", source)
    nm = _int(toks[2], "number of mappers", line_no, source)
    if nm < 1:
        raise TraceFormatError(line_no, f"number of mappers must be >= 1, got {nm}", source)
    if len(toks) < 3 + nm + 1:
        raise TraceFormatError(line_no, f"line ends before its {nm} mapper ports and reducer count", source)
    mappers = []
    for tok in toks[3:3 + nm]:
        p = _int(tok, "mapper port", line_no, source)
        if not 0 <= p < num_ports:
            raise TraceFormatError(line_no, f"mapper port {p} outside 0..{num_ports - 1}", source)
        mappers.append(p)
    nr = _int(toks[3 + nm], "number of reducers", line_no, source)
    if nr < 1:
        raise TraceFormatError(line_no, f"number of reducers must be >= 1, got {nr}", source)
    rtoks = toks[4 + nm:]
    if len(rtoks) != nr:
        raise TraceFormatError(line_no, f"expected {nr} reducer fields 'port:MB', got {len(rtoks)}", source)
    reducers = []
    for tok in rtoks:
        port_s, sep, mb_s = tok.partition(":")
        if not sep:
            raise TraceFormatError(line_no, f"reducer field must be 'port:MB', got {tok!r}", source)
        p = _int(port_s, "reducer port", line_no, source)
        if not 0 <= p < num_ports:
            raise TraceFormatError(line_no, f"reducer port {p} outside 0..{num_ports - 1}", source)
        mb = _float(mb_s, "reducer MB", line_no, source)
        if mb < 0:
            raise TraceFormatError(line_no, f"reducer MB must be >= 0, got {mb_s}", source)
        reducers.append((p, mb))
    return TraceCoflow(cid, arrival, tuple(mappers), tuple(reducers))


def parse_trace(text: str | Iterable[str], source: str = "<trace>") -> Trace:
    """Parse trace text (a string or an iterable of lines); errors name the offending line number."""
    lines = text.splitlines() if isinstance(text, str) else list(text)
    header: tuple[int, int] | None = None
    header_line = 0
    coflows: list[TraceCoflow] = []
    seen: dict[int, int] = {}
    for line_no, raw in enumerate(lines, start=1):
        toks = raw.split()
        if not toks:
            continue
        if header is None:
            if len(toks) != 2:
                raise TraceFormatError(line_no, "header must be '<num_ports> <num_coflows>'", source)
            np_ = _int(toks[0], "number of ports", line_no, source)
            nc = _int(toks[1], "number of coflows", line_no, source)
            if np_ < 1 or nc < 0:
                raise TraceFormatError(line_no, "need num_ports >= 1 and num_coflows >= 0", source)
            header = (np_, nc)
            header_line = line_no
            continue
        if len(coflows) == header[1]:
            raise TraceFormatError(line_no, f"more coflow lines than the {header[1]} announced on line "
                                            f"{header_line}", source)
        tc = _parse_line(toks, line_no, header[0], source)
        if tc.id in seen:
            raise TraceFormatError(line_no, f"duplicate coflow id {tc.id} (first on line {seen[tc.id]})",
                                   source)
        seen[tc.id] = line_no
        coflows.append(tc)
    if header is None:
        raise TraceFormatError(1, "empty trace: missing header '<num_ports> <num_coflows>'", source)
    if len(coflows) != header[1]:
        raise TraceFormatError(len(lines), f"header announces {header[1]} coflows but {len(coflows)} "
                                           f"were found", source)
    return Trace(header[0], coflows)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    """Read and parse a trace file."""
    with open(path, encoding="utf-8") as fh:
        return parse_trace(fh.read(), source=os.fspath(path))


def format_trace(trace: Trace) -> str:
    """The trace as text in the benchmark format (newline-terminated)."""
    out = [f"{trace.num_ports} {len(trace.coflows)}"]
    out += [tc.format() for tc in trace.coflows]
    return "\n".join(out) + "\n"


def write_trace(trace: Trace, path: str | os.PathLike[str]) -> None:
    """Write ``trace`` to ``path`` in the benchmark format."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(format_trace(trace))


#: File name of the published Facebook trace in the public ``coflow/coflow-benchmark`` repository.
PUBLISHED_TRACE_NAME = "FB2010-1Hr-150-0.txt"
#: Environment variable naming the published trace's path.
PUBLISHED_TRACE_ENV = "TWISTERNET_COFLOW_TRACE"


def published_trace_path() -> str:
    """Where the published trace is looked for: ``$TWISTERNET_COFLOW_TRACE`` if set, else
    ``~/.cache/twisternet/FB2010-1Hr-150-0.txt``. The file is not shipped; see docs/coflow-simulator.md
    for how to fetch it from the public coflow-benchmark repository."""
    env = os.environ.get(PUBLISHED_TRACE_ENV)
    if env:
        return os.path.expanduser(env)
    return os.path.join(os.path.expanduser("~"), ".cache", "twisternet", PUBLISHED_TRACE_NAME)
