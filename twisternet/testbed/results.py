"""What a job on the testbed gives back: each process's exit and output, and the links' counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from .system import TestbedError


@dataclass
class LinkCounters:
    """Bytes and packets through a host's ``eth0`` (as the host sees them) since it was made."""

    rx_bytes: int
    tx_bytes: int
    rx_packets: int
    tx_packets: int


@dataclass
class ProcResult:
    """One process of a job: where it ran, how it ended, what it printed."""

    host: int
    role: str                   # "master", "worker", "mpiexec", "proxy"
    index: int                  # the worker's number on its host (0..k-1); 0 for others
    returncode: int | None      # as Popen's: -9 if the job had to kill it (then ended is None)
    stdout: str
    stderr: str
    ended: float | None = None  # time.monotonic() when it exited (None: killed by the job's stop)

    @property
    def label(self) -> str:
        return f"{self.role} {self.index} on host{self.host}"


@dataclass
class JobResult:
    """All processes of a job; ``timed_out`` if the job was stopped at its deadline."""

    procs: list[ProcResult]
    seconds: float
    timed_out: bool = False
    counters_before: dict[int, LinkCounters] = field(default_factory=dict)
    counters_after: dict[int, LinkCounters] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(p.returncode == 0 for p in self.procs)

    @property
    def workers(self) -> list[ProcResult]:
        return [p for p in self.procs if p.role in ("worker", "mpiexec")]

    @property
    def stdout(self) -> str:
        """Every process's stdout, in host order."""
        return "".join(p.stdout for p in self.procs)

    @property
    def stderr(self) -> str:
        return "".join(p.stderr for p in self.procs)

    def link_bytes(self) -> dict[int, int]:
        """Bytes each host's link carried during the job (both directions)."""
        out = {}
        for h, after in self.counters_after.items():
            before = self.counters_before.get(h, LinkCounters(0, 0, 0, 0))
            out[h] = (after.rx_bytes - before.rx_bytes) + (after.tx_bytes - before.tx_bytes)
        return out

    def describe(self, tail: int = 1500) -> str:
        """A readable account of every process (exit status and the tail of its output)."""
        parts = [f"job {'timed out' if self.timed_out else 'ended'} after {self.seconds:.1f} s"]
        for p in self.procs:
            parts.append(f"--- {p.label}: exit {p.returncode}\n[stdout] {p.stdout[-tail:]}\n"
                         f"[stderr] {p.stderr[-tail:]}")
        return "\n".join(parts)

    def check(self) -> JobResult:
        """Raise TestbedError with :meth:`describe` unless every process exited 0."""
        if not self.ok:
            raise TestbedError(self.describe())
        return self
