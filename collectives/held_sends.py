"""Per-record sends held back and handed over together while a source's records are flowing.

One ``send()`` per record pays an operation's whole hand-over for every record: its lock (shared
with the thread that delivers incoming records), the routing and the bookkeeping. While a source's
records flow (the previous hand-over was less than ``config.flush_delay`` ago), :meth:`HeldSends.hold`
keeps each record (already checked and routed by the caller) with the ones after it, up to
:data:`SEND_BATCH`, and they are handed over together, per destination, in order: what ``send_many``
does for a list. The progress engine hands over what is held once it is ``flush_delay`` old
(``Context.defer``), so a last record never waits for another call; the operation's ``finish``,
``send_many``, ``offer`` and ``close`` call :meth:`HeldSends.release_held` first (``close`` waits for
room as ``send`` would: nothing held is dropped unless the operation failed), and so does every wait on
the Context (``Context.flush``).

A record after a pause goes at once, and so does one whose value is not a plain scalar (the caller
may change it after ``send`` returns). A ``send`` that raises (back pressure timed out, a lost peer)
did not take its record; records held before it stay held, in order.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from .reduction import _ATOMS
from .routing import normalize_key

if TYPE_CHECKING:
    from twisternet.context import Context

#: Most per-record sends held back before they are handed over together.
SEND_BATCH = 64


class HeldSends:
    """Mixin of the keyed operations: :meth:`hold` per record, :meth:`release_held` before anything
    else a source does. The operation provides :meth:`_hand_over_pairs` and (from Operation) ``ctx``."""

    ctx: Context
    key_type: str
    _closed: bool
    _error: BaseException | None

    if TYPE_CHECKING:
        def _check_source(self, task: int) -> None: ...
        def _raise_if_failed(self) -> None: ...
        def _select(self, key: Any) -> int: ...

    def _init_held(self, ctx: Context) -> None:
        self._held_back: dict[int, list[tuple[int, Any, Any]]] = {}    # source task -> (destination, key, value)
        self._held_back_lock = threading.Lock()    # the lists
        self._handing_over = threading.Lock()      # one hand-over at a time: records keep their order
        self._last_release: dict[int, float] = {}  # source task -> when its records last went
        self._held_key = object()                  # this operation's key for ctx.defer
        self._hold_for = ctx.config.flush_delay

    def _hand_over_pairs(self, task: int, d: int, pairs: list, block: bool, timeout: float | None) -> bool:
        """``(key, value)`` pairs from local source ``task`` into destination ``d`` (False: no room)."""
        raise NotImplementedError

    def send_record(self, task: int, key: Any, value: Any, timeout: float | None) -> None:
        """One record from local source ``task``: the key is checked and routed here (errors raise
        here), then :meth:`hold` sends it or holds it back while this source's records flow, to be
        handed over with the ones after it: the same records in the same order, at a fraction of
        the cost each."""
        key = normalize_key(key, self.key_type)
        self._check_source(task)
        self._raise_if_failed()
        self.hold(task, self._select(key), key, value, timeout)

    def hold(self, task: int, d: int, key: Any, value: Any, timeout: float | None) -> None:
        """Send one checked, routed record from ``task`` to destination ``d``: held back while records
        flow, else at once (module docstring)."""
        if type(value) not in _ATOMS:
            self.release_held(task, True, timeout, then=(d, key, value))
            return
        held = self._held_back.get(task)
        if not held:
            if time.monotonic() - self._last_release.get(task, 0.0) > self._hold_for:
                self.release_held(task, True, timeout, then=(d, key, value))     # after a pause: at once
                return
        elif len(held) >= SEND_BATCH:
            self.release_held(task, True, timeout)        # raises: this record was not taken
        with self._held_back_lock:
            held = self._held_back.setdefault(task, [])
            held.append((d, key, value))
            first = len(held) == 1
        if first:
            self.ctx.defer((self._held_key, task), lambda: self.release_held(task, False, None))

    def finish(self, task: int) -> None:
        """End the stream of source ``task`` (what it holds goes first)."""
        self.release_held(task, True, None)
        super().finish(task)  # type: ignore[misc]

    def close(self, *, timeout: float | None = None) -> None:
        """Close the operation; what every source holds goes first (back pressure: waits up to
        ``timeout`` and raises as ``send`` would, never drops it), unless the operation failed."""
        if not self._closed and self._error is None:
            for task in list(self._held_back):
                self.release_held(task, True, timeout)
        super().close(timeout=timeout)  # type: ignore[misc]

    def held_count(self) -> int:
        return sum(len(v) for v in list(self._held_back.values()))

    def release_held(self, task: int, block: bool, timeout: float | None,
                     then: tuple[int, Any, Any] | None = None) -> bool:
        """Hand this source's held records over (one hand-over per destination), then ``then``; False
        when ``block`` is False and some could not be taken now (they stay held, in order). If a
        hand-over raises, the records not taken stay held and ``then`` was not taken."""
        if not self._held_back.get(task) and then is None:
            return True
        if not self._handing_over.acquire(blocking=block):    # another thread hands over: wait our turn
            return False
        try:
            with self._held_back_lock:
                held = self._held_back.pop(task, [])
            by_dest: dict[int, list] = {}
            for d, key, value in held:
                by_dest.setdefault(d, []).append((key, value))
            groups = list(by_dest.items())
            done = 0
            try:
                while done < len(groups) and self._hand_over_pairs(task, *groups[done], block, timeout):
                    done += 1
            finally:
                left = [(d, k, v) for d, lst in groups[done:] for k, v in lst]
                if left:
                    with self._held_back_lock:
                        self._held_back[task] = left + self._held_back.get(task, [])
            if left:
                return False
            if then is not None:
                d, key, value = then
                self._hand_over_pairs(task, d, [(key, value)], True, timeout)
            self._last_release[task] = time.monotonic()
            return True
        finally:
            self._handing_over.release()
