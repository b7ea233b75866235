"""A job's processes: their output collected in threads, killing their process groups, and the
:class:`Job` that waits for them."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import threading
import time
from typing import IO, TYPE_CHECKING
from collections.abc import Sequence

from ..procfs import children_by_parent, runnable_threads
from .results import JobResult, ProcResult
from .system import TestbedError

if TYPE_CHECKING:
    from .cluster import Testbed

log = logging.getLogger(__name__)


class OutputCollector:
    """Reads a process's stdout/stderr into strings in threads (so pipes never fill up)."""

    def __init__(self, proc: subprocess.Popen, host: int, role: str, index: int) -> None:
        self.proc, self.host, self.role, self.index = proc, host, role, index
        self.out: list[str] = []
        self.err: list[str] = []
        self.lines: list[str] = []                  # stdout lines, for waiters (see wait_for_line)
        self.cond = threading.Condition()
        self.ended: float | None = None
        self.killed = False
        self.threads = [threading.Thread(target=self._pump, args=(proc.stdout, self.out), daemon=True),
                        threading.Thread(target=self._pump, args=(proc.stderr, self.err), daemon=True)]
        for t in self.threads:
            t.start()
        threading.Thread(target=self._reap, daemon=True).start()

    def _reap(self) -> None:
        self.proc.wait()
        self.ended = time.monotonic()

    def _pump(self, stream: IO[str] | None, into: list[str]) -> None:
        if stream is None:
            return
        for line in iter(stream.readline, ""):
            with self.cond:
                into.append(line)
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def wait_for_line(self, pattern: re.Pattern[str], timeout: float, start: int = 0) -> tuple[re.Match[str], int]:
        """The first output line (stdout or stderr) at index >= ``start`` matching ``pattern``."""
        deadline = time.monotonic() + timeout
        with self.cond:
            i = start
            while True:
                while i < len(self.lines):
                    m = pattern.search(self.lines[i])
                    i += 1
                    if m:
                        return m, i
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and all(not t.is_alive() for t in self.threads)):
                    raise TestbedError(f"{self.role} on host{self.host} printed no line matching "
                                       f"{pattern.pattern!r} within {timeout:.0f} s (exit {self.proc.poll()}):\n"
                                       + "".join(self.lines)[-3000:])
                self.cond.wait(min(left, 0.5))

    def result(self) -> ProcResult:
        for t in self.threads:
            t.join(10)
        with self.cond:
            return ProcResult(self.host, self.role, self.index, self.proc.returncode, "".join(self.out),
                              "".join(self.err), None if self.killed else self.ended)


#: Seconds :meth:`Job.wait` gives the stack dumps of a timed-out job to reach its collectors.
DUMP_GRACE = 5.0
#: Seconds without output after which the dump of a process that keeps running is taken as whole.
DUMP_QUIET = 0.5


def _descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (namespaces share the process table here)."""
    children = children_by_parent()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _catches(pid: int, signum: int) -> bool:
    """Whether ``pid`` is a Python process with a handler for ``signum`` (SigCgt in /proc/PID/status)."""
    try:
        if "python" not in os.path.basename(os.readlink(f"/proc/{pid}/exe")):
            return False
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads (every job process is started in its own group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        log.warning("process %d did not die after SIGKILL", proc.pid)


class Job:
    """Processes started across the testbed as one job; :meth:`wait` collects a :class:`JobResult`."""

    def __init__(self, testbed: Testbed, main: Sequence[OutputCollector],
                 helpers: Sequence[OutputCollector] = ()) -> None:
        self.testbed = testbed
        self.main = list(main)          # the job ends when these end
        self.helpers = list(helpers)    # stopped when the main ones ended (a master, MPI proxies)
        self.started = time.monotonic()
        self.before = testbed.counters()

    @property
    def collectors(self) -> list[OutputCollector]:
        """Every process of the job, helpers (master / mpiexec's proxies) first."""
        return self.helpers + self.main

    def wait(self, timeout: float, *, dump_signal: int | None = None) -> JobResult:
        """Wait up to ``timeout`` s for the main processes; then stop everything and report.

        ``dump_signal``: when the job times out, first send this signal to every process of the job
        whose program registered a stack dump for it (``faulthandler.register``), and give their
        output up to :data:`DUMP_GRACE` s to arrive, so the report shows where each one was stuck."""
        deadline = self.started + timeout
        timed_out = False
        for c in self.main:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        seconds = time.monotonic() - self.started
        if timed_out and dump_signal is not None:
            self._dump_stacks(dump_signal)
        after = self.testbed.counters()
        for c in self.helpers:          # a master ends by itself once its workers are gone
            try:
                c.proc.wait(max(0.5, min(5.0, deadline + 5 - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        return JobResult([c.result() for c in self.collectors], seconds, timed_out, self.before, after)

    def _dump_stacks(self, signum: int) -> None:
        """Signal the job's processes that catch ``signum`` to dump their stacks; wait for the dumps."""
        pids = [pid for c in self.collectors for pid in _descendants(c.proc.pid) if _catches(pid, signum)]
        for pid in pids:
            try:
                os.kill(pid, signum)
            except (ProcessLookupError, PermissionError):
                pass
        if not pids:
            return
        # Each faulthandler dump names the thread that ran the handler once ("Current thread 0x...",
        # the others "Thread 0x..."): wait until there are as many dumps as signalled processes, and
        # until they are whole. The handler writes a dump piece by piece, and on a busy machine it can
        # be preempted after the header: a dump is whole once no thread of those processes is still
        # runnable (each is blocked again where it was stuck) and no more output came in the last
        # round; for a process that keeps a thread busy anyway, once no output came for DUMP_QUIET s.
        header = re.compile(r"^Current thread 0x", re.M)
        deadline = time.monotonic() + DUMP_GRACE
        size, changed = -1, time.monotonic()
        while time.monotonic() < deadline:
            text = "".join("".join(c.err) + "".join(c.out) for c in self.collectors)
            now = time.monotonic()
            if len(text) != size:
                size, changed = len(text), now
            elif len(header.findall(text)) >= len(pids) and (
                    not any(runnable_threads(pid) for pid in pids) or now - changed >= DUMP_QUIET):
                break
            with self.collectors[0].cond:
                self.collectors[0].cond.wait(0.05)  # woken by new output of the first collector

    def stop(self) -> None:
        """Kill every process of the job that still runs (their ``ended`` stays None: they did not exit)."""
        for c in self.main + self.helpers:
            if c.proc.poll() is None:
                kill_tree(c.proc)
                # poll() can miss an exit that another thread is reaping right then: only a SIGKILL is ours
                c.killed = c.proc.returncode == -signal.SIGKILL
        self.testbed._job_ended(self)
