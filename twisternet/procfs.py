"""What Linux's ``/proc`` says about processes and CPU demand: the process tree, which threads are
runnable, and how many threads of other programs want a CPU now (the busy-poll rule of
``busy_poll_us``, see :func:`twisternet.config.busy_poll_seconds`). Off Linux the readers find
nothing (empty tree, no runnable thread) and :func:`runnable_elsewhere` falls back to the load
average."""

from __future__ import annotations

import os
import time

#: (when, value) of the last :func:`runnable_elsewhere` reading: a context and its MPI channel ask
#: within milliseconds of each other.
_RUNNABLE_CACHE: list[float] = []


def _stat_fields(path: str) -> list[bytes] | None:
    """The fields of a ``stat`` file after the command name (state first), or None if unreadable."""
    try:
        with open(path, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2:].split()


def children_by_parent() -> dict[int, list[int]]:
    """Every process's pid under its parent's (one pass over the process table)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return children
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _stat_fields(f"/proc/{entry}/stat")
        if fields is None or len(fields) < 2:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def runnable_threads(pid: int) -> int:
    """Threads of ``pid`` running or waiting for a CPU (state R); 0 once it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    n = 0
    for tid in tasks:
        fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if fields and fields[0] == b"R":
            n += 1
    return n


def runnable_elsewhere(samples: int = 5, gap: float = 0.001) -> float:
    """How many threads of other programs want a CPU right now: the median of ``samples`` readings,
    ``gap`` seconds apart, of the running count in ``/proc/loadavg`` less the running threads of this
    process and of its siblings (the processes with the same parent: the other ranks a launcher,
    mpiexec's proxy or torchrun started on this host, which poll while they wait in MPI_Init or the
    bootstrap). The median, so that something busy for a moment is not counted, while a program that
    keeps a core busy is; not the least: the two readings of a sample are not taken at one instant, so
    a sibling polling in MPI_Init can be subtracted without having been counted, and the least of five
    such samples missed a CPU hog in 3 of 12 readings under mpiexec. Not the load average: that is a
    minute's memory, which after one job (a benchmark's previous run, say) would keep the next from
    polling on an idle machine. Where ``/proc/loadavg`` has no running count, the 1-minute load
    average. Cached for a second."""
    now = time.monotonic()
    if _RUNNABLE_CACHE and now - _RUNNABLE_CACHE[0] < 1.0:
        return _RUNNABLE_CACHE[1]
    counts: list[int] = []
    try:
        ours = _job_processes()
        for i in range(samples):
            if i:
                time.sleep(gap)
            with open("/proc/loadavg", encoding="ascii") as f:
                running = int(f.read().split()[3].partition("/")[0])
            # (this thread runs, whatever its stat said)
            counts.append(running - max(1, sum(runnable_threads(pid) for pid in ours)))
    except (OSError, ValueError, IndexError):
        counts = []
    if counts:
        value = float(max(0, sorted(counts)[len(counts) // 2]))
    else:
        try:
            value = os.getloadavg()[0]
        except (AttributeError, OSError):
            value = 0.0
    _RUNNABLE_CACHE[:] = [time.monotonic(), value]
    return value


def _job_processes() -> list[int]:
    """This process and its siblings (same parent, unless the parent is pid 1, whose children are
    everybody's orphans)."""
    me, parent = os.getpid(), os.getppid()
    if parent <= 1:
        return [me]
    return [me, *(pid for pid in children_by_parent().get(parent, []) if pid != me)]
