"""Peer loss and failure in a Context: who was lost first, and the errors waiters raise.

A rank that loses a peer tells the others which one (``_CAUSE_EDGE``) before it may fail and exit
itself, so every rank names the first rank lost, not the ones that left in reaction to it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ..errors import PeerLostError
from .state import ContextState
from .streams import _CAUSE_EDGE

log = logging.getLogger(__name__)


class PeerLoss(ContextState):
    """Context part: lost peers and failures (a mixin of :class:`~twisternet.context.api.Context`).

    State (made in ``Context.__init__``): ``_lost`` (rank -> reason), ``_lost_after`` (rank -> the rank
    whose loss it reported), ``_told``, ``_failure``."""

    def on_peer_lost(self, peer: int, reason: str) -> None:
        with self._lock:
            if peer in self._lost:
                return
            cause = self._lost_after.get(peer)
        if cause is None:
            # queued before the loss is visible: a caller that raises on it and closes flushes them
            self._tell_loss(peer, reason)
        with self._lock:
            if peer in self._lost:
                return
            if cause is not None:
                reason += f" (it left after rank {cause} was lost)"
            self._lost[peer] = reason
        log.error("rank %d: peer rank %d lost: %s", self.rank, peer, reason)
        self.notify()

    def _tell_loss(self, peer: int, reason: str) -> None:
        """Tell every live peer that ``peer`` was lost, so that when this rank fails in reaction they
        name ``peer`` and not this rank."""
        with self._lock:
            if peer in self._told or self._stop:    # stopped: the channel is closing, nobody to tell
                return
            self._told.add(peer)
            live = [r for r in range(self.world) if r not in (self.rank, peer) and r not in self._lost]
        for r in live:
            try:
                self._send(r, _CAUSE_EDGE, [peer, reason], block=False, timeout=0.0, closing=True, force=True)
            except Exception:  # best effort: the loss itself is reported regardless
                log.debug("rank %d: could not tell rank %d of the loss", self.rank, r, exc_info=True)
        with self._lock:    # now, not after the flush delay: this rank may fail and exit any moment
            for r in live:
                if (r, _CAUSE_EDGE) in self._out_partial:
                    self._emit_partial(self._out[(r, _CAUSE_EDGE)])
        self.channel.wakeup()

    def _on_cause(self, src: int, obj: Any) -> None:
        """Rank ``src`` lost rank ``obj[0]``: remember it (before ``src`` itself may go)."""
        try:
            lost, reason = int(obj[0]), str(obj[1])
        except (TypeError, ValueError, IndexError):
            log.warning("rank %d: bad loss notice from rank %d: %r", self.rank, src, obj)
            return
        if lost == self.rank:
            return
        with self._lock:
            self._lost_after.setdefault(src, lost)
            if lost in self._lost:
                return
        # pass it on too (before the loss is visible here): a rank that fails because of it must be
        # known to have left after it
        self._tell_loss(lost, reason)
        with self._lock:
            if lost in self._lost:
                return
            self._lost[lost] = f"{reason} (seen by rank {src})"
        log.error("rank %d: peer rank %d lost (reported by rank %d): %s", self.rank, lost, src, reason)
        self.notify()

    def _raise_failures(self) -> None:
        if self._failure is None and not self._lost:
            return      # (unlocked peek: the common case, checked by every wait)
        with self._lock:
            failure = self._failure
            lost = next(iter(self._lost.items()), None)
        if failure is not None and failure is self._reported_failure:
            if self._closed:
                failure = None  # while leaving the job: close() raises it at the end if still unheard
            else:
                self._reported_heard = True
        if failure is not None:
            # the original exception (a handler's or the engine's), so callers see what really failed
            raise failure
        if lost is not None:
            raise self._lost_error(lost[0])

    def _lost_error(self, peer: int) -> PeerLostError:
        """PeerLostError for the loss of ``peer``, naming the first rank lost: if ``peer`` (or the rank
        it left after) reported losing another rank before it went, that one; the others are "lost
        after" it."""
        with self._lock:
            roots = [r for r in self._lost if r not in self._lost_after]
            root = roots[0] if roots else peer
            reason = self._lost.get(root, "lost")
            after = sorted(r for r in self._lost if r != root)
        if after:
            reason += f"; rank{'s' if len(after) > 1 else ''} {', '.join(map(str, after))} lost after rank {root}"
        return PeerLostError(root, reason)

    def lost_view(self) -> Mapping[int, str]:
        """The live, read-only table of lost ranks (rank -> reason), read without the lock: a cheap test
        for hot paths (an operation's sends look at it first); :attr:`lost_peers` is a consistent copy."""
        return MappingProxyType(self._lost)
