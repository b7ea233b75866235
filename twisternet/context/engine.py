"""The progress engine of a Context: who moves bytes and runs handlers, and how threads hand it over.

The engine is ``_chan_lock``: whoever holds it may call the channel (``progress``, ``send``, ``push``).
Normally the progress thread (``_run``) holds it; a thread blocked in a wait, or sending, takes it
when it is free and moves the bytes itself (no thread hand-off in the path of a reply), and the
progress thread keeps out of its way for ``_DRIVER_GRACE`` after (see ``_take_engine``). In manual
mode the thread that calls ``Context.progress`` (or waits) runs it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .state import ContextState

log = logging.getLogger(__name__)

#: The progress thread leaves the engine to a caller that drove it within this many seconds.
_DRIVER_GRACE = 0.001
#: How long the progress thread (socket channels) stays out of the way of a thread that drives the
#: engine before it looks again. Every look takes the GIL from the driver, which on a busy machine can
#: cost the driver a scheduler round (milliseconds) per message: few looks, at the price of records
#: that arrive after the driver stopped waiting being handled up to this much later.
_STEP_ASIDE = 0.005
#: How long a thread sending a large (zero-copy) message waits for a busy engine before handing over.
_SEND_LOCK_WAIT = 0.002


class ProgressEngine(ContextState):
    """Context part: the progress thread, one progress round, and the engine hand-offs (a mixin of
    :class:`~twisternet.context.api.Context`).

    State (made in ``Context.__init__``): ``_chan_lock`` (the engine), ``_thread``,
    ``_progress_thread_id``, ``_in_progress`` (per thread: inside a round, record views), ``_driven_at``,
    ``_sleep_until``, ``_seen``, ``_stop``."""

    def _on_engine_thread(self) -> bool:
        return threading.get_ident() == self._progress_thread_id or getattr(self._in_progress, "active", False)

    def _kick(self, wait: float = 0.0) -> None:
        """Get queued messages moving: hand them to the channel in this thread if the engine is free
        (no thread hand-off), else wake the engine. ``wait``: how long to wait for a busy engine (a
        thread that must wait for its own large message to leave anyway had better write it itself
        than hand it over and be woken again)."""
        if (self._thread is not None and self.channel.can_wait_unlocked
                and not getattr(self._in_progress, "active", False) and not self._stop
                and self._chan_lock.acquire(timeout=wait if wait > 0 else -1, blocking=wait > 0)):
            # Bytes only: handlers are not run here, because the sender may be inside an operation
            # (holding its lock) and a handler run re-entrantly could overtake its record. The channel
            # writes a small message to an idle link in send() itself, so a whole progress round (a
            # poll, reads, credit) is only needed when something is left queued in the channel.
            try:
                self._in_progress.active = True
                try:
                    did = self._pump()
                    if self.channel.has_pending():
                        did = self.channel.progress(0.0) or did
                        did = self._pump() or did
                finally:
                    self._in_progress.active = False
            finally:
                self._chan_lock.release()
            if did:
                self.notify()
            with self._lock:
                # what arrived is delivered by the engine; a partly filled buffer due later needs
                # the engine awake in time
                late = bool(self._in_dirty) or (
                    bool(self._out_partial) and self._sleep_until > min(self._out_partial.values())) or (
                    bool(self._deferred) and self._sleep_until > min(t for t, _ in self._deferred.values()))
            if not late:
                return
        self.channel.wakeup()

    def _run(self) -> None:
        self._progress_thread_id = threading.get_ident()
        unlocked = self.channel.can_wait_unlocked
        try:
            while not self._stop:
                if not unlocked:
                    if time.monotonic() - self._driven_at < _DRIVER_GRACE:
                        time.sleep(_DRIVER_GRACE)   # a sender polls its own large message (_drive_send)
                        continue
                    self._progress_once(0.05)
                    continue
                # Work under the engine lock without waiting, then wait *without* it, so a thread
                # that sends or waits for an answer can move the bytes itself at once (no hand-off).
                if time.monotonic() - self._driven_at < _DRIVER_GRACE:
                    # A caller waiting for an answer drives the engine itself right now: keep out of
                    # its way (it handles what arrives without a hand-off); take over if it stops.
                    time.sleep(_STEP_ASIDE)
                    continue
                # One round, then the unlocked wait even if the round did something: the wait returns at
                # once if more is ready, where a second round would cost as much as the first (and keep
                # the engine from a thread that wants to send) just to find that nothing is.
                # A busy engine is driven by a waiting or sending thread: never queue up behind it (the
                # round it would run after it, finding the driver's reply already taken or taking the
                # next one from it, is a hand-off per message); keep out of its way instead.
                if not self._chan_lock.acquire(blocking=False):
                    time.sleep(_STEP_ASIDE)
                    continue
                self._progress_once(0.0, lock_held=True)
                if self._stop:
                    continue
                with self._lock:
                    if self._in_dirty:
                        continue
                    timeout = self._sleep_for(0.05)
                if self._chan_lock.locked():
                    # a thread drives the engine: it would wake with us for every message it waits for
                    self._sleep_until = float("inf")
                    time.sleep(_STEP_ASIDE)
                    continue
                try:
                    self.channel.wait(timeout)
                finally:
                    self._sleep_until = float("inf")
        except BaseException as e:  # the engine must report, not vanish
            log.exception("rank %d: progress engine failed", self.rank)
            with self._lock:
                if self._failure is None:
                    self._failure = e
            self.notify()

    def _run_deferred(self, everything: bool = False) -> None:
        """Call the deferred functions that are due (all with ``everything``), outside the lock."""
        now = time.monotonic()
        with self._lock:
            due = [(k, fn) for k, (t, fn) in self._deferred.items() if everything or t <= now]
            for k, _ in due:
                del self._deferred[k]
        for k, fn in due:
            try:
                done = fn()
            except Exception:  # an operation's failure is its own: the engine goes on
                log.debug("deferred %r failed", k, exc_info=True)
                done = True
            if not done:
                self.defer(k, fn)

    def _sleep_for(self, timeout: float) -> float:
        """How long the channel may wait (at most ``timeout``): until the first partly filled buffer is
        due, and no longer than 10 ms while scheduled sends wait for pacing tokens or channel room; notes
        the wake-up time in ``_sleep_until``. Called with ``_lock`` held."""
        now = time.monotonic()
        if self._out_partial:
            timeout = max(0.0, min(timeout, min(self._out_partial.values()) - now))
        if self._deferred:
            timeout = max(0.0, min(timeout, min(t for t, _ in self._deferred.values()) - now))
        if self._out_ready and self._coflow_pump is not None:
            timeout = max(0.0, min(timeout, self._coflow_pump.pace_until - now, 0.01))
        self._sleep_until = now + timeout
        return timeout

    def _progress_once(self, timeout: float, *, lock_held: bool = False, deliver: bool = True) -> bool:
        if not lock_held:
            self._chan_lock.acquire()
        try:
            self._in_progress.active = True
            try:
                self._seen = False
                if self._deferred:
                    self._run_deferred()    # first: what it hands over goes out in this round's pump
                # (unlocked peeks, as below: nothing queued, nothing to hand over; a waiter's round
                # for its reply usually finds nothing)
                queued = bool(self._out_ready or self._out_partial or self._deferred or self._coflow_pump is not None)
                did = self._pump() if queued else False
                seen = did
                if self.coflows is not None:
                    self.coflows.flush_outbox()   # coordinator reports, outside the Context lock
                if did or self._in_dirty:
                    timeout = 0.0
                elif not queued:
                    self._sleep_until = time.monotonic() + timeout
                else:
                    with self._lock:
                        timeout = self._sleep_for(timeout)
                did = self._poll_channel(timeout, deliver) or did
                self._sleep_until = float("inf") if timeout > 0 else self._sleep_until
                if self._after_poll(deliver):
                    did = seen = True
                seen = seen or self._seen
            finally:
                self._in_progress.active = False
        finally:
            self._chan_lock.release()
        # Waiters hear of what they can see: records handled, messages handed to the channel (room in
        # a stream's queue), sends completed. Not of the channel's own steps (a header read, a credit
        # frame, one segment of several): over MPI a large message takes about seven such steps, and
        # waking a waiter for each cost a GIL hand-off apiece.
        if seen:
            self.notify()
        return did

    def _poll_channel(self, timeout: float, deliver: bool) -> bool:
        """The channel's part of a round (engine held, ``_in_progress.active`` set): its progress, with
        the records of its messages handed to their handlers as they are read when ``deliver`` (see
        Inbound.on_message; ``_deliver`` takes what could not be)."""
        self._inline = deliver
        try:
            return self.channel.progress(timeout)
        finally:
            self._inline = False

    def _after_poll(self, deliver: bool) -> bool:
        """The end of a round (engine held): hand over what the handlers queued, deliver what could not
        be delivered inline. Whether it did either."""
        did = False
        # (unlocked peeks: whoever fills these after the peek wakes the channel, see _kick)
        if (self._out_ready or self._out_partial or self._coflow_pump is not None) and self._pump():
            did = True
        if deliver and (self._in_dirty or self._refused) and self._deliver():
            did = True
            self.channel.flush_released()   # what the handlers released goes back now
        return did

    def _spin(self, predicate: Callable[[], bool], until: float) -> bool | None:
        """Rounds of the engine by this waiting thread, back to back, until ``predicate()`` holds (True),
        a peer fails, ``until`` passes or the engine is not free (it is given back between rounds, so a
        thread that wants it gets it) (False). None if not even one round could run, or if the engine
        is stopping: the caller then waits for a change instead.

        A round with nothing queued on this side, the usual one of a thread that waits for a reply,
        is the channel's poll, and the hand-over of what its handlers queue, if they queue anything:
        none of ``_progress_once``'s work and calls, which such a round finds empty and which cost a
        waiter about 0.8 us per message (1 KB ping-pong, MPI and UDS alike: in its polls, and between
        the reply and its return)."""
        local = self._in_progress
        if getattr(local, "active", False):
            return None
        lock = self._chan_lock
        progress = self.channel.progress
        monotonic = time.monotonic
        ran: bool | None = None
        while lock.acquire(False):
            ran = False
            if (self._stop or self._deferred or self._out_ready or self._out_partial
                    or self._coflow_pump is not None or self.coflows is not None):
                if self._stop:
                    lock.release()
                    return None
                self._progress_once(0.0, lock_held=True)
            else:
                local.active = True
                self._inline = True
                self._seen = False
                try:
                    # (_poll_channel(0.0, True), inlined: the call cost a waiter 0.2-0.3 us per message)
                    progress(0.0)
                    self._inline = False
                    # (unlocked peeks, as in _after_poll: what the handlers queued or refused)
                    if ((self._out_ready or self._out_partial or self._in_dirty or self._refused)
                            and self._after_poll(True)):
                        self._seen = True
                finally:
                    self._inline = False
                    local.active = False
                    lock.release()
                if self._seen:
                    self.notify()
            now = monotonic()
            self._driven_at = self._sleep_until = now
            if predicate():
                return True
            if now >= until or self._failure is not None or self._lost:
                return False
        return ran

    def _take_engine(self) -> bool:
        """Take the engine for this (waiting) thread if it is free. Over MPI the engine thread holds it
        while it polls, so ask it to step aside (it keeps out while ``_driven_at`` is recent, see
        ``_run``) and wait briefly: the thread that waits for a record (or for its own large send,
        ``_drive_send``) then moves it itself, as a blocking ``MPI_Recv``/``MPI_Send`` does, instead
        of being woken for every record the engine thread handles (a wake-up and a GIL hand-off per
        message, in the path of the next one)."""
        if self.channel.can_wait_unlocked:
            return self._chan_lock.acquire(blocking=False)
        self._driven_at = time.monotonic()   # the engine thread yields the channel (see _run)
        if self._chan_lock.acquire(blocking=False):
            return True
        self.channel.wakeup()                # the engine stops its current wait early
        return self._chan_lock.acquire(timeout=_SEND_LOCK_WAIT)

    def _wait_change(self, gen: int, timeout: float) -> None:
        if timeout <= 0:
            return
        if self._thread is None:
            # manual mode: this thread drives the engine
            if not self._chan_lock.locked() or not getattr(self._in_progress, "active", False):
                self._progress_once(min(timeout, 0.01))
            return
        # A blocked caller drives the engine itself when it is free, as MPI does: the reply it waits
        # for is then received, handled and seen in this thread, with no hand-off between threads.
        if not getattr(self._in_progress, "active", False) and self._take_engine():
            if self._gen != gen or self._stop:
                self._chan_lock.release()
                return
            self._driven_at = time.monotonic() + min(timeout, 0.005)   # driving until then at most
            self._progress_once(min(timeout, 0.005), lock_held=True)
            self._driven_at = time.monotonic()
            return
        with self._cond:
            self._cond_waiters += 1     # first: see notify
            try:
                if self._gen == gen:
                    self._cond.wait(timeout)
            finally:
                self._cond_waiters -= 1
