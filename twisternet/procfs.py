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


def cpu_seconds(pid: int) -> float | None:
    """CPU time ``pid`` has used, all its threads: the nanoseconds of ``task/*/schedstat``, else the
    clock ticks (user + system) of ``stat``; None once it is gone (or off Linux)."""
    try:
        total = 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        pass
    fields = _stat_fields(f"/proc/{pid}/stat")
    if fields is None or len(fields) < 13:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def runnable_threads(pid: int) -> int:
    """Threads of ``pid`` running or waiting for a CPU (state R); 0 once it is gone."""
    return len(_runnable_tids(pid))


def _runnable_tids(pid: int | str) -> list[int]:
    """The thread ids of ``pid`` in state R; [] once it is gone."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for tid in tasks:
        fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if fields and fields[0] == b"R":
            found.append(int(tid))
    return found


def runnable_elsewhere(samples: int = 5, gap: float = 0.001) -> float:
    """How many threads of other programs want a CPU right now: the median of ``samples`` readings,
    ``gap`` seconds apart, of the runnable threads (state R) outside this job (see
    :func:`foreign_runnable`). The median, so that something busy for a moment is not counted, while
    a program that keeps a core busy is. Each reading names the threads it counts, rather than
    subtracting this job's running threads from the machine's running count (``/proc/loadavg``):
    those two numbers are not read at one instant, and a sibling rank that flips between running
    and waiting while it polls (in MPI_Init, the bootstrap, a channel's first exchange) was then
    subtracted without having been counted often enough that in 8 of 12 2-rank mpiexec launches on
    an idle machine one rank turned busy polling off (one-way latency 85 us instead of 33). Not the load
    average: that is a minute's memory, which after one job (a benchmark's previous run, say) would
    keep the next from polling on an idle machine. Without ``/proc``, the 1-minute load average.
    Cached for a second."""
    now = time.monotonic()
    if _RUNNABLE_CACHE and now - _RUNNABLE_CACHE[0] < 1.0:
        return _RUNNABLE_CACHE[1]
    counts: list[int] = []
    if os.path.isdir("/proc/self/task"):
        ours = set(_job_processes())
        for i in range(samples):
            if i:
                time.sleep(gap)
            # (the machine's running count includes this thread: at most 1, nothing else wants a CPU,
            # and the scan, ~20 us a thread, can be skipped)
            counts.append(0 if _running_count() <= 1 else len(foreign_runnable(ours)))
    if counts:
        value = float(sorted(counts)[len(counts) // 2])
    else:
        try:
            value = os.getloadavg()[0]
        except (AttributeError, OSError):
            value = 0.0
    _RUNNABLE_CACHE[:] = [time.monotonic(), value]
    return value


def foreign_runnable(ours: set[int]) -> list[tuple[int, int]]:
    """The threads, ``(pid, tid)``, in state R (running or waiting for a CPU) of every process whose
    pid is not in ``ours``: one pass over ``/proc/*/task/*/stat`` (about 20 us a thread)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    return [(int(entry), tid) for entry in entries if entry.isdigit() and int(entry) not in ours
            for tid in _runnable_tids(entry)]


def _job_processes() -> list[int]:
    """This process, its siblings that run the same command line (the other ranks a launcher,
    mpiexec's proxy or torchrun started on this host; not a program that the same shell started
    beside the job) and its ancestors (the launchers themselves, which work while the ranks start),
    up to but not including pid 1, whose children are everybody's orphans."""
    me, parent = os.getpid(), os.getppid()
    if parent <= 1:
        return [me]
    mine = _cmdline(me)
    ours = [me, *(pid for pid in children_by_parent().get(parent, [])
                  if pid != me and mine is not None and _cmdline(pid) == mine)]
    up = parent
    while up > 1 and up not in ours:
        ours.append(up)
        fields = _stat_fields(f"/proc/{up}/stat")
        if fields is None or len(fields) < 2:
            break
        up = int(fields[1])
    return ours


def _cmdline(pid: int) -> bytes | None:
    """The command line of ``pid`` (NUL-separated), or None if unreadable."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def _running_count() -> int:
    """Threads running or runnable on the machine now (``/proc/loadavg``'s fourth field), or a large
    number if unreadable (then the scan decides)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return int(f.read().split()[3].partition("/")[0])
    except (OSError, ValueError, IndexError):
        return 1 << 30
