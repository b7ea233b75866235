"""Process-wide MPI set-up for the channel: importing mpi4py (initialising MPI if nobody has), the
``sys.excepthook`` that ends the job with ``MPI_Abort`` on an uncaught exception, and the exit hooks
that tear down channels never closed and end a job whose silent peers would never exit."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from twisternet.errors import ClosedError, ConfigError

if TYPE_CHECKING:  # pragma: no cover - typing only; importing mpi4py initialises MPI
    from .channel import MPIChannel

log = logging.getLogger(__name__)


#: Channels not yet closed. Holding them keeps their posted receive buffers alive: a channel dropped
#: without close() must not let MPI write into freed memory. Torn down at interpreter exit.
_OPEN_CHANNELS: set[MPIChannel] = set()
_ATEXIT_REGISTERED = False


def _close_leftover_channels() -> None:
    """atexit: tear down channels the program never closed, before mpi4py finalizes MPI."""
    for ch in list(_OPEN_CHANNELS):
        try:
            if ch._MPI.Is_finalized():
                _OPEN_CHANNELS.clear()
                return
            log.warning("rank %d: MPI channel was never closed; tearing it down at exit", ch.rank)
            ch._teardown()
        except Exception:  # exiting anyway; do not mask the program's own outcome
            log.exception("error tearing down an MPI channel at exit")
    _OPEN_CHANNELS.clear()


#: Ranks (of COMM_WORLD) this process lost by silence (heartbeat timeout), with the reason, while
#: ``mpi_abort_on_error`` was on. Such a rank may be alive but stopped: it never exits by itself, so
#: neither would ``mpiexec``; :func:`_abort_if_peers_froze` ends the job at exit instead.
_SILENT_LOST: dict[int, str] = {}


def _abort_if_peers_froze() -> None:
    """atexit: the program ends normally (or with SystemExit) after losing a silent peer: ``MPI_Abort``
    so that hydra kills the stopped rank and ``mpiexec`` ends, rather than waiting for it forever."""
    if not _SILENT_LOST:
        return
    from mpi4py import MPI
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    ranks = ", ".join(f"{r} ({why})" for r, why in sorted(_SILENT_LOST.items()))
    end_job(MPI, f"rank {MPI.COMM_WORLD.Get_rank()}: exiting after losing silent ranks {ranks}; ending the "
                 "MPI job (MPI_Abort), or they would never exit")


def end_job(MPI: Any, message: str, *, stacks: bool = False) -> None:
    """Write ``twisternet: message`` (and, with ``stacks``, every thread's stack) to stderr, then end the
    whole job with ``MPI_Abort``, MPICH's shared-memory files unlinked first. Nothing if MPI is not
    running (not initialised, or finalized)."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    try:
        sys.stdout.flush()
        sys.stderr.write(f"twisternet: {message}\n")
        if stacks:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - ending the job anyway
        pass
    _unlink_mpich_segments()
    MPI.COMM_WORLD.Abort(1)


#: Buffers of sends still unfinished when a channel was torn down. MPI may read them until the
#: matching receive happens (if ever), so they are kept for the life of the process.
_ORPHANED_SENDS: list[Any] = []

def _import_mpi() -> ModuleType:
    """Import mpi4py's MPI module, initialising MPI (asking for THREAD_MULTIPLE) if nobody has."""
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a declared extra
        raise ConfigError("channel", f"the MPI channel needs mpi4py (pip install 'twisternet[mpi]'): {e}") from e
    if MPI.Is_finalized():
        raise ClosedError("MPI has already been finalized in this process")
    if not MPI.Is_initialized():
        provided = MPI.Init_thread(MPI.THREAD_MULTIPLE)
        log.debug("initialised MPI ourselves; thread level %s", _level_name(MPI, provided))
        # mpi4py finalizes only what it initialised itself (rc.finalize defaults to rc.initialize),
        # so whoever initialises finalizes. Registered before the hook that closes leftover
        # channels, it runs after it (atexit is last-in first-out).
        import atexit

        def _finalize() -> None:
            if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.Is_thread_main():
                MPI.Finalize()
        atexit.register(_finalize)
    return MPI


_ABORT_HOOK_INSTALLED = False


def _unlink_mpich_segments() -> list[str]:
    """Unlink the MPICH shared-memory files (``/dev/shm/mpich_shm_*``) this process maps; returns them.

    MPICH removes them in ``MPI_Finalize``; a job that ends by ``MPI_Abort`` (every rank killed) leaves
    them in /dev/shm for good, a few MB per job. Unlinking is safe right before the abort: the other
    ranks of the host keep their mappings until hydra kills them, and nobody attaches any more."""
    removed: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if "/dev/shm/mpich_shm_" in line}
    except (OSError, IndexError):
        return removed
    for path in sorted(paths):
        if path.endswith(" (deleted)"):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def _install_abort_hook(MPI: Any) -> None:
    """Make an uncaught exception end the whole MPI job (``MPI_Abort``) once its traceback is printed.

    Without it the failed rank's interpreter exits (or hangs in ``MPI_Finalize``) while the others
    wait for it until their operation timeout, and ``mpiexec`` waits for all of them. With it, hydra
    kills every rank at once and ``mpiexec`` exits non-zero (1). Installed once per process."""
    global _ABORT_HOOK_INSTALLED
    if _ABORT_HOOK_INSTALLED:
        return
    _ABORT_HOOK_INSTALLED = True
    previous = sys.excepthook

    def abort_on_uncaught(exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            previous(exc_type, exc, tb)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
            if MPI.Is_initialized() and not MPI.Is_finalized():
                end_job(MPI, f"rank {MPI.COMM_WORLD.Get_rank()}: uncaught {exc_type.__name__}; ending the MPI "
                             "job (MPI_Abort)")

    sys.excepthook = abort_on_uncaught


def _level_name(MPI: Any, level: int) -> str:
    names = {MPI.THREAD_SINGLE: "THREAD_SINGLE", MPI.THREAD_FUNNELED: "THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "THREAD_SERIALIZED", MPI.THREAD_MULTIPLE: "THREAD_MULTIPLE"}
    return names.get(level, str(level))


def _register_exit_hooks() -> None:
    """Register (once per process) the exit hooks that close leftover channels and end a job whose
    silent peers would never exit. Registered after mpi4py's own exit hook, so they run first
    (atexit is last-in first-out)."""
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        import atexit
        atexit.register(_close_leftover_channels)
        atexit.register(_abort_if_peers_froze)
        _ATEXIT_REGISTERED = True
