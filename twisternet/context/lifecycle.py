"""Leaving a job: a Context's clean, collective close, and its quick exit when the program failed.

A clean close tells every peer this rank is done (``_LEAVE_EDGE``), keeps the engine running until each
live peer said the same (rank 0 may still have to answer service requests), drains what is queued and
closes the channel. A failing rank (``_failure`` set, or a peer lost) skips the goodbye: it gets its
loss notices out for at most ``_NOTICE_FLUSH`` and aborts the channel, so peers see it as lost.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from .state import ContextState
from .streams import _CAUSE_EDGE, _LEAVE_EDGE

log = logging.getLogger(__name__)

#: How long a failing rank's close() waits for its loss notices to leave before it aborts the channel.
_NOTICE_FLUSH = 0.5


class Lifecycle(ContextState):
    """Context part: close, leave, drain (a mixin of :class:`~twisternet.context.api.Context`).

    State (made in ``Context.__init__``): ``_closed``, ``_left_peers``, ``_on_close``."""

    def close(self, timeout: float | None = None) -> None:
        """Flush pending sends, leave the job cleanly (waiting for the peers to leave too), stop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        limit = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            broken = self._failure is not None and self._failure is not self._reported_failure
        try:
            if not self._lost and not broken:
                self._linger(deadline)
        finally:
            self._stop = True
            self.channel.wakeup()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join(max(1.0, deadline - time.monotonic()))
            with self._chan_lock:
                try:
                    if broken or self._lost:
                        self._flush_notices(time.monotonic() + _NOTICE_FLUSH)
                    if broken:
                        self.channel.abort(f"rank {self.rank} failed: {self._failure!r}")
                    else:
                        self.channel.close(max(0.5, min(deadline - time.monotonic(), self.config.peer_timeout)))
                except Exception:  # closing must finish; log what went wrong
                    log.exception("rank %d: error while closing the channel", self.rank)
            with self._lock:
                for s in self._out.values():
                    s.packer.discard()
            self.services.close()
            self.notify()
            if self._on_close is not None:
                self._on_close()
        with self._lock:
            unheard = None if broken or self._reported_heard else self._reported_failure
        if unheard is not None:
            raise unheard  # a reported failure user code has not heard yet, raised once the job is left

    def _flush_notices(self, deadline: float) -> None:
        """Before a failing rank drops its connections: get its loss notices (and what is queued before
        them) out, for at most until ``deadline`` (engine stopped, channel lock held)."""
        def pending() -> bool:
            with self._lock:
                return any(s.queue for k, s in self._out.items() if k[1] == _CAUSE_EDGE)
        try:
            with self._lock:
                for key in [k for k in self._out_partial if k[1] == _CAUSE_EDGE]:
                    self._emit_partial(self._out[key])
            while time.monotonic() < deadline and (pending() or self.channel.has_pending()):
                self._pump()
                self.channel.progress(0.005)
        except Exception:  # best effort on the way out
            log.debug("rank %d: flushing loss notices failed", self.rank, exc_info=True)

    def _linger(self, deadline: float) -> None:
        """Collective leave: tell every peer we are done, then keep the engine running (delivering,
        answering service requests as rank 0 may have to) until every live peer said the same."""
        for peer in range(self.world):
            if peer != self.rank:
                with self._lock:
                    if peer in self._lost:
                        continue
                self._send(peer, _LEAVE_EDGE, None, block=True, timeout=max(0.1, deadline - time.monotonic()),
                           closing=True)
        self.flush()
        others = set(range(self.world)) - {self.rank}
        while True:
            with self._lock:
                gen = self._gen
                done = others <= (self._left_peers | set(self._lost))
            if done:
                break
            if time.monotonic() >= deadline:
                with self._lock:
                    late = sorted(others - self._left_peers - set(self._lost))
                log.warning("rank %d: closing before ranks %s finished", self.rank, late)
                break
            self._wait_change(gen, min(0.5, deadline - time.monotonic()))
        self._drain(deadline)

    def _drain(self, deadline: float) -> None:
        """Wait until every queued message has been handed to the channel and sent."""
        def drained() -> bool:
            with self._lock:
                busy = any(s.queue for s in self._out.values()) or bool(self._out_partial)
            return not busy and not self.channel.has_pending()
        while not drained():
            self._raise_failures()
            if time.monotonic() >= deadline:
                log.warning("rank %d: close timed out with sends still pending", self.rank)
                return
            with self._lock:
                gen = self._gen
                for key in list(self._out_partial):
                    self._emit_partial(self._out[key])
            self.channel.wakeup()
            self._wait_change(gen, 0.05)

    def _on_leave(self, src: int, obj: Any) -> bool:
        with self._lock:
            self._left_peers.add(src)
        return True
