"""The MPI channel's watchdog: ends the job when the channel's progress is stuck, e.g. inside MPI.

The channel notices silent peers in its own progress pass (:mod:`.liveness`). That pass cannot run
while a thread is stuck in an MPI call that never returns: MPICH's OFI netmod retries a send for as
long as the provider has no room for it, which is forever once a peer's host is cut off and the
TCP buffers towards it are full. The rank then neither raises nor sends heartbeats, and since the
cut-off ranks' own aborts cannot reach ``mpiexec`` over the dead link, the job would hang.

A daemon thread per channel checks that the liveness pass ran within ``2 x peer_timeout``. If it did
not (and the watchdog itself was scheduled all along, so the process was not merely stopped or
starved), the rank is as good as lost to its peers already: they stop hearing its heartbeats after
``peer_timeout``. With ``mpi_abort_on_error`` (the default) the watchdog writes what it saw and every
thread's stack to stderr and ends the job with ``MPI_Abort``; without it, it logs the error once.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from .launch import end_job

if TYPE_CHECKING:  # pragma: no cover - typing only
    from .channel import MPIChannel

log = logging.getLogger(__name__)

#: Seconds between the watchdog's checks (at most; shorter when the liveness tick is).
WATCHDOG_TICK = 0.5
#: A check that comes this many ticks late means the whole process was not scheduled (stopped,
#: starved): the staleness is then counted from that moment, not from the last liveness pass.
_LATE_TICKS = 4


class ProgressWatchdog:
    """Watches one channel's liveness pass from a daemon thread; see the module docstring."""

    def __init__(self, channel: MPIChannel, limit: float, tick: float = WATCHDOG_TICK) -> None:
        self._channel = channel
        self.limit = limit
        self._tick = tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"twisternet-mpi-watchdog-{channel.rank}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        ch = self._channel
        last = resumed = time.monotonic()
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            if now - last > _LATE_TICKS * self._tick:
                resumed = now           # we were not scheduled either: not evidence against progress
            last = now
            if ch._closed:
                return
            stuck = now - max(ch._liveness_at, resumed)
            if stuck > self.limit:
                self._fire(stuck)
                return

    def _fire(self, stuck: float) -> None:
        ch = self._channel
        now = time.monotonic()
        silent = [p for p in range(ch.world)
                  if p != ch.rank and p not in ch._lost and now - ch._heard[p] > ch._peer_timeout]
        why = (f"rank {ch.rank}: the MPI channel's progress has been stuck for {stuck:.1f}s (a thread is "
               f"inside an MPI call that does not return, or waits for one); not heard from since: "
               f"{ch.describe_ranks(silent) if silent else 'nobody'}")
        if not ch.config.mpi_abort_on_error:
            log.error("%s; mpi_abort_on_error is off, so the job is left running", why)
            return
        end_job(ch._MPI, f"{why}: ending the MPI job (MPI_Abort). Stacks:", stacks=True)
