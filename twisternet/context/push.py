"""Completion of large (zero-copy) sends: a thread waiting for its own large message moves it itself.

Over sockets (``Channel.can_push``) the sending thread writes the message with ``Channel.push`` and
waits for room without the engine; over MPI it polls the channel for the request's completion
(:meth:`OwnSend._drive_send`). Either way no thread hand-off is in the path of a large send.
"""

from __future__ import annotations

import time
from ..channel import Buffer
from ..errors import BackPressureTimeout
from .engine import _SEND_LOCK_WAIT
from .state import ContextState
from .streams import _DIRECT, _OutMsg, _Sent

#: How long one round of a thread driving its own large send may poll the channel (MPI) before it
#: re-checks its message: a round that returns at once costs ~30 us of Python per poll.
_DRIVE_SPIN = 0.0005


class SendHandle:
    """Completion of a :meth:`Context.isend`: until :meth:`wait` returns, the sent arrays may still be read."""

    __slots__ = ("_ctx", "_done", "_dst", "_edge", "_deadline", "_limit")

    def __init__(self, ctx: ContextState, done: _Sent | None, dst: int, edge: int,
                 deadline: float, limit: float) -> None:
        self._ctx, self._done, self._dst, self._edge = ctx, done, dst, edge
        self._deadline, self._limit = deadline, limit

    @property
    def done(self) -> bool:
        """Whether the channel has finished with the record's memory."""
        return self._done is None or self._done.is_set()

    def wait(self) -> None:
        """Block until sent; PeerLostError if the peer died first, BackPressureTimeout past the send's timeout."""
        if self._done is not None:
            self._ctx._wait_sent(self._done, self._dst, self._edge, self._deadline, self._limit)


class OwnSend(ContextState):
    """Context part: a sending thread completing its own large messages (a mixin of
    :class:`~twisternet.context.api.Context`)."""

    def _send_own(self, dst: int, edge: int, parts: list[Buffer], n: int, deadline: float, limit: float) -> bool:
        """Send a large message that this thread waits for anyway by writing it itself (Channel.push).

        The thread takes the engine *before* queueing the message, so the progress thread cannot pick
        it up in between, hands it to the channel, writes what the socket takes, and waits for room
        without the engine (the progress thread goes on receiving meanwhile). A message is then written
        by the thread that sent it with no hand-off either way, as a blocking socket send would be.
        If the engine stays busy for ``_SEND_LOCK_WAIT``, the message is queued for the engine instead."""
        done = _Sent()
        msg = _OutMsg([_DIRECT, *parts], n + 1, None, done)
        ch = self.channel
        while True:
            engine = self._chan_lock.acquire(timeout=_SEND_LOCK_WAIT)
            handed = False
            try:
                with self._lock:
                    gen = self._gen
                    s = self._stream(dst, edge)
                    room = s.queued_bytes < self._credit
                    if room:
                        if s.packer.pending_bytes:
                            self._emit_partial(s)
                        self._stamp(s, msg)
                        # nothing queued before it: straight to the channel if it has credit
                        handed = engine and not s.queue and ch.send(dst, edge, msg.parts, msg)
                        if not handed:
                            self._queue(s, msg)
            except BaseException:
                if engine:
                    self._chan_lock.release()
                raise
            if room:
                break
            if engine:
                self._chan_lock.release()
            self._blocked(gen, deadline, limit, edge, "send blocked by back pressure")
        if not engine:
            self.channel.wakeup()
            self._wait_sent(done, dst, edge, deadline, limit)
            return True
        left = False
        try:
            if not handed:
                self._pump()
                with self._lock:
                    handed = msg not in s.queue
            if handed:
                left = not ch.push(dst)
        finally:
            self._chan_lock.release()
        self._after_push()
        if not handed:
            # no credit for it yet: the engine hands it over and writes it once credit comes back
            self._wait_sent(done, dst, edge, deadline, limit)
            return True
        try:
            while not done.is_set():
                self._raise_failures()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BackPressureTimeout("large send did not complete", edge=edge, timeout=limit)
                ch.wait_writable(dst, min(remaining, 0.05))
                if self._chan_lock.acquire(timeout=min(remaining, 0.05)):
                    try:
                        left = not ch.push(dst)
                    finally:
                        self._chan_lock.release()
                    self._after_push()
        finally:
            if left:
                with self._chan_lock:
                    ch.end_push(dst)
        with self._lock:
            if dst in self._lost:  # its buffers were let go because the peer died, not sent
                raise self._lost_error(dst)
        return True

    def _after_push(self) -> None:
        """Wake the waiters (the stream's queue shrank, credit may have come back), and the engine if
        the push received records: handlers run on the engine, never in a sending thread."""
        self.notify()
        with self._lock:
            late = bool(self._in_dirty)
        if late:
            self.channel.wakeup()

    def _wait_sent(self, done: _Sent, dst: int, edge: int, deadline: float, limit: float) -> None:
        while not done.is_set():
            with self._lock:
                gen = self._gen
            if done.is_set():
                break
            if self._drive_send(deadline):
                continue
            self._blocked(gen, deadline, limit, edge, "large send did not complete")
        with self._lock:
            if dst in self._lost:  # its buffers were let go because the peer died, not sent
                raise self._lost_error(dst)

    def _drive_send(self, deadline: float) -> bool:
        """Over MPI, a thread waiting for its own large send to complete polls the request itself (as a
        blocking ``MPI_Send`` would), the engine thread keeping out of the way meanwhile: no hand-off
        to the engine thread and back, which costs two thread wake-ups per message. Bytes only, as in
        :meth:`_kick`. False: not done here (socket channels, or the engine is busy)."""
        if self._thread is None or getattr(self._in_progress, "active", False) or self._stop:
            return False
        self._raise_failures()
        if self.channel.can_wait_unlocked:
            # Sockets: the sender already wrote what fit (_kick); the engine thread, waiting for socket
            # room without the lock, writes the rest. Writing it here instead, waiting for room under the
            # lock, made 64-256 MB transfers collapse to a third of their speed in some runs.
            return False
        if not self._take_engine():
            return False
        self._progress_once(_DRIVE_SPIN, lock_held=True, deliver=False)
        self._driven_at = time.monotonic()
        with self._lock:
            late = bool(self._in_dirty)
        if late:
            self.channel.wakeup()    # what arrived meanwhile is delivered by the engine thread
        return time.monotonic() < deadline   # False: _blocked raises the timeout
