"""An in-process wiring of one ``BarrierService`` and N ``BarrierClient``\\ s, for tests and as the model of
the real transport wiring.

Clients send into one queue; a service thread takes requests from it, calls ``handle``, and between
requests sleeps until ``next_deadline()`` (at most ``poll_interval``, so a ``ManualClock`` moved by a test
is noticed) and calls ``tick``. Every message is packed and unpacked with msgpack on its way, so what
passes here is what a real transport can carry. Replies are delivered on the service thread (``on_done``
callbacks of ``enter_async`` run there).

The real wiring is the same loop: requests arrive from the channel instead of the queue (source rank =
the peer), replies go out through the channel, and the loop wakes for ``next_deadline()``.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import msgpack

from .client import BarrierClient
from .clock import Clock, MonotonicClock
from .partial import EnterCallback
from .semaphore import ReleaseCallback
from .service import BarrierService

log = logging.getLogger(__name__)


class LocalBarrierCluster:
    """``n`` clients (ranks 0..n-1) and a service thread in this process; use as a context manager."""

    def __init__(self, n: int, clock: Clock | None = None, *, poll_interval: float = 0.05,
                 service: BarrierService | None = None) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self.service = service if service is not None else BarrierService()
        self.poll_interval = poll_interval
        self._lock = threading.RLock()
        self._inbox: queue.Queue[tuple[int, bytes] | None] = queue.Queue()
        self._stop = threading.Event()
        self.clients: list[BarrierClient] = [
            BarrierClient(self._sender(rank), self.clock, service=self) for rank in range(n)]
        self._thread = threading.Thread(target=self._run, name="barrier-service", daemon=True)
        self.messages = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> LocalBarrierCluster:
        """Start the service thread."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the service thread and close every client (pending calls fail with ``BarrierClosed``)."""
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        for c in self.clients:
            c.close()

    def __enter__(self) -> LocalBarrierCluster:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def wake(self) -> None:
        """Make the service thread re-check its deadlines now (e.g. after moving a ManualClock)."""
        self._inbox.put(None)

    # ------------------------------------------------------------------ thread-safe service configuration
    def set_enter_callback(self, name: str, callback: EnterCallback, callback_timeout: float | None = None) -> None:
        """``BarrierService.set_enter_callback`` under the service lock."""
        with self._lock:
            self.service.set_enter_callback(name, callback, callback_timeout)
        self.wake()

    def set_release_callback(self, name: str, callback: ReleaseCallback) -> None:
        """``BarrierService.set_release_callback`` under the service lock."""
        with self._lock:
            self.service.set_release_callback(name, callback)

    # ------------------------------------------------------------------ internals
    def _sender(self, rank: int) -> Any:
        def send(msg: dict[str, Any]) -> None:
            if self._stop.is_set():
                raise ConnectionError("barrier harness stopped")
            self._inbox.put((rank, msgpack.packb(msg, use_bin_type=True)))
        return send

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                deadline = self.service.next_deadline()
            wait = self.poll_interval
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - self.clock.time()))
            try:
                item = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
            except queue.Empty:
                item = None
            if self._stop.is_set():
                break
            try:
                with self._lock:
                    now = self.clock.time()
                    if item is None:
                        replies = self.service.tick(now)
                    else:
                        src, data = item
                        self.messages += 1
                        replies = self.service.handle(src, msgpack.unpackb(data, raw=False), now)
                for dst, reply in replies:
                    if not 0 <= dst < len(self.clients):
                        log.error("barrier harness: reply to unknown rank %d dropped: %r", dst, reply)
                        continue
                    wire = msgpack.packb(reply, use_bin_type=True)
                    self.clients[dst].deliver(msgpack.unpackb(wire, raw=False))
            except Exception:  # keep serving; the failure is logged
                log.exception("barrier harness: service loop error")
