"""Failure, liveness and teardown of the MPI channel: heartbeats and the silent-peer timeout, marking
a peer lost, leaving without a goodbye (abort), and freeing every MPI resource at the end."""

from __future__ import annotations

import logging
import time
from collections import deque

from .launch import _OPEN_CHANNELS, _ORPHANED_SENDS, _SILENT_LOST
from .records import _Heartbeat, _Send
from .state import MPIChannelState
from .wire import _HEARTBEAT_MSG, TAG_CTRL, _encode_abort

log = logging.getLogger(__name__)


#: Most seconds between two liveness checks (the heartbeat interval, when shorter).
_LIVENESS_TICK = 0.5


class LivenessMixin(MPIChannelState):
    """Heartbeats, lost peers, abort and teardown.

    A mixin of :class:`~channels.mpi.channel.MPIChannel`, not an object of its own: losing a peer or
    tearing down touches the state of every other part (send queue, request table, pre-posted
    receives, slots, credit, order queues)."""

    def abort(self, reason: str) -> None:
        """Leave at once without the goodbye: peers get an abort notice and report this rank lost."""
        if self._closed_before_start():
            return
        MPI = self._MPI
        msg = _encode_abort(reason)
        notices = []
        for peer in self._live_peers():
            if peer in self._bye_from:
                continue
            try:
                notices.append(self._comm.Isend(msg, peer, TAG_CTRL))
            except MPI.Exception:
                pass
        limit = time.monotonic() + 0.5
        try:
            while notices and not MPI.Request.Testall(notices) and time.monotonic() < limit:
                time.sleep(1e-4)
        except MPI.Exception:
            pass
        for req in notices:
            if req != MPI.REQUEST_NULL:
                _ORPHANED_SENDS.append(msg)  # MPI may still read it after Free
                try:
                    req.Free()
                except MPI.Exception:
                    pass
        log.warning("rank %d: channel aborted: %s", self.rank, reason)
        self._teardown()

    def describe_ranks(self, ranks: list[int]) -> str:
        """``ranks`` with the hosts they ran on, grouped by host: "ranks 2, 3 on host1"."""
        by_host: dict[str, list[int]] = {}
        for r in sorted(ranks):
            by_host.setdefault(self.hosts[r], []).append(r)
        return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} on host {h}"
                         for h, rs in by_host.items())

    def _lose(self, peer: int, reason: str) -> None:
        """Mark ``peer`` lost (once) and report it, unless it already left cleanly. The reason gets
        the peer's host unless it names it already."""
        if peer in self._lost or peer in self._bye_from:
            return
        if f"host {self.hosts[peer]}" not in reason:
            reason = f"{reason} (rank {peer} ran on host {self.hosts[peer]})"
        self._pending_total -= self._pending_sends[peer]
        self._lost[peer] = reason
        self._pre_drop(peer)
        self._slots_in.drop_peer(peer)
        self._slots_out.drop_peer(peer)
        if self._handler is not None:
            self._slot_drop_deferred(peer)
        log.warning("rank %d: lost rank %d: %s", self.rank, peer, reason)
        q = self._sendq[peer]
        while q:
            self._unaccount_send(q.popleft()[2], False)
        self._credit_returns.drop(peer)
        for key in [k for k in self._split_in if k[0] == peer]:
            del self._split_in[key]
        for key in [k for k in self._order if k[0] == peer]:
            del self._order[key]
        if self._handler is not None:
            self._events.append((self._handler.on_peer_lost, (peer, reason)))

    def _liveness(self, now: float) -> None:
        """Send each live peer its heartbeat when due; report peers silent for ``peer_timeout`` lost.

        A peer that said goodbye is neither checked nor sent to, and once our own goodbye is out we
        send no more heartbeats (a peer may free its communicator right after it has all goodbyes)
        and check nobody (close() bounds that wait itself)."""
        self._next_liveness = now + min(self._hb_interval, _LIVENESS_TICK)
        self._liveness_at = now     # read by the watchdog (.watchdog)
        if self._bye_sent:
            return
        watched = [p for p in range(self.world)
                   if p != self.rank and p not in self._lost and p not in self._bye_from]
        silent = [p for p in watched if now - self._heard[p] > self._peer_timeout]
        if silent:
            # Peers that fall silent together (a host whose link went down) are named together, so
            # whichever loss reaches the user first names every rank and host that went.
            # Peers a tick or two from the timeout are named too (not yet lost): when a link drops,
            # its host's ranks time out one tick apart, and the first error should name them all.
            quiet = now - max(self._heard[p] for p in silent)
            reason = (f"no message or heartbeat for {quiet:.1f}s from {self.describe_ranks(silent)} "
                      f"(peer_timeout {self._peer_timeout:g}s): stopped, hung or unreachable")
            near = min(self._peer_timeout / 2, 2 * _LIVENESS_TICK + self._hb_interval)
            also = [p for p in watched if p not in silent and now - self._heard[p] > self._peer_timeout - near]
            if also:
                reason += (f"; also silent for {now - max(self._heard[p] for p in also):.1f}s: "
                           f"{self.describe_ranks(also)}")
            for peer in silent:
                self._lose(peer, reason)
                if self.config.mpi_abort_on_error:
                    _SILENT_LOST[self._world_rank(peer)] = self._lost.get(peer, "silent")
        for peer in watched:
            if peer in self._lost:
                continue
            if not self._beat_busy[peer] and now - self._beat_sent[peer] >= self._hb_interval:
                try:
                    req = self._comm.Isend(_HEARTBEAT_MSG, peer, TAG_CTRL)
                except self._MPI.Exception as e:
                    self._lose(peer, f"MPI error sending a heartbeat: {e.Get_error_string()}")
                    continue
                self._post(req, _Heartbeat(peer, _HEARTBEAT_MSG))
                self._beat_busy[peer] = True
                self._beat_sent[peer] = now

    def _world_rank(self, peer: int) -> int:
        """``peer``'s rank in COMM_WORLD (the channel may run on a split communicator)."""
        MPI = self._MPI
        mine, world = self._comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            return int(MPI.Group.Translate_ranks(mine, [peer], world)[0])
        except MPI.Exception:
            return peer
        finally:
            mine.Free()
            world.Free()

    def _live_peers(self) -> list[int]:
        return [p for p in range(self.world) if p != self.rank and p not in self._lost]

    def _waiting_for_peers(self) -> list[int]:
        return [p for p in self._live_peers() if p not in self._bye_from or self._bulk_pending[p]]

    def _teardown(self) -> None:
        """Cancel pre-posted receives, drop what is left and free the communicator."""
        MPI = self._MPI
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.stop()
        for q in self._sendq:  # never handed to MPI: just drop them
            while q:
                self._unaccount_send(q.popleft()[2], False)
        cancelled = []
        for req, op in self._requests.outstanding() + self._untracked_recvs():
            if isinstance(op, _Send):
                try:
                    req.Free()  # completes in the background (or never, if the peer is gone)
                except MPI.Exception:
                    pass
                # MPI may still read the buffers after Free: they must outlive this channel.
                _ORPHANED_SENDS.append(op.keep)
                continue
            try:
                req.Cancel()
                cancelled.append(req)
            except MPI.Exception:
                pass
        limit = time.monotonic() + 1.0
        while cancelled and time.monotonic() < limit:
            try:
                if MPI.Request.Testall(cancelled):
                    break
            except MPI.Exception:
                break
            time.sleep(1e-4)
        else:
            if cancelled and time.monotonic() >= limit:
                log.warning("rank %d: %d cancelled receives did not complete", self.rank, len(cancelled))
        self._requests.clear()
        self._data_recvs = [deque() for _ in range(self.world)]
        self._repost.clear()
        self._ctrl_recvs = [deque() for _ in range(self.world)]
        self._pre_q = [deque() for _ in range(self.world)]
        self._order.clear()
        self._spares.clear()
        self._slots_in.close()      # views handed out stay valid; the files are unlinked
        self._slots_out.close()
        self._slot_deferred.clear()
        self._split_in.clear()
        self._slot_blocked.clear()
        self._free_comm()
        _OPEN_CHANNELS.discard(self)
        log.debug("MPI channel rank %d closed", self.rank)

    def _closed_before_start(self) -> bool:
        """True if there is nothing to tell peers: closed already, or never started (then the
        communicator is freed and the channel closed here)."""
        if self._closed:
            return True
        if self._started:
            return False
        self._free_comm()
        self._closed = True
        _OPEN_CHANNELS.discard(self)
        return True

    def _free_comm(self) -> None:
        try:
            if self._comm != self._MPI.COMM_NULL:
                self._comm.Free()
        except self._MPI.Exception as e:
            log.warning("rank %d: freeing the channel communicator failed: %s", self.rank, e)


