"""Credit bookkeeping of the TCP channel: bytes in flight per (peer, edge), and released credit owed back.

The sender may have ``credit`` bytes in flight per edge; the receiver returns them in CREDIT frames once
the core releases the messages, batched (see :meth:`CreditLedger.due`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from twisternet.channel import fits_credit

#: Longest a released byte of credit waits to be returned with others (see CreditLedger.due).
CREDIT_DELAY = 1e-3

Key = tuple[int, int]   # (peer, edge)


class CreditLedger:
    """What this rank sent and may still send per (peer, edge), and what it owes its senders."""

    def __init__(self, credit: int, wake: Callable[[], None]) -> None:
        self.credit = credit
        self._wake = wake
        #: Bytes sent per (peer, edge) whose credit has not come back yet.
        self.inflight: dict[Key, int] = {}
        #: Releases reported (from any thread), not yet folded into ``owed``: (peer, edge, nbytes).
        #: Read-only outside this class, as ``owed``.
        self.returns: deque[tuple[int, int, int]] = deque()
        #: Released bytes not yet returned, per (peer, edge). ``returns or owed``: :attr:`owes`,
        #: without the property's call (every small send looks).
        self.owed: dict[Key, int] = {}
        self._owed_since = float("inf")                         # when the oldest of them was released
        self._owed_peak = 0     # at least the largest value in _owed (0 when it is empty): see due()
        #: Threads blocked in a poll of this channel (:meth:`sleeping`): only they need a wake-up when
        #: credit is released; a release seen by a running round is returned by it.
        self.sleepers = 0
        self._sleep_lock = threading.Lock()

    # ---------------------------------------------------------------- sending side
    def fits(self, key: Key, n: int) -> bool:
        """Whether ``n`` more bytes on ``key`` fit the credit (nothing is counted)."""
        return fits_credit(self.inflight.get(key, 0), n, self.credit)

    def charge(self, key: Key, n: int) -> None:
        """``n`` more bytes were sent on ``key``."""
        self.inflight[key] = self.inflight.get(key, 0) + n

    def returned(self, key: Key, n: int) -> None:
        """A CREDIT frame gave ``n`` bytes of ``key`` back."""
        self.inflight[key] = max(0, self.inflight.get(key, 0) - n)

    # ---------------------------------------------------------------- receiving side
    def releaser(self, peer: int, edge: int, n: int) -> Callable[[], None]:
        """The release callback of a received message of ``n`` bytes: callable from any thread, once."""
        returns = self.returns
        wake = self._wake
        used = [False]

        def release() -> None:
            if used[0]:
                return
            used[0] = True
            returns.append((peer, edge, n))
            if ledger.sleepers:
                wake()
        ledger = self
        return release

    def sleeping(self, timeout: float) -> float:
        """A thread is about to poll for up to ``timeout``: count it (``awake()`` after) and return the
        timeout cut short so that owed credit is returned on time. Counting first means a release that
        does not see the sleeper was appended before this check, which then shortens the wait."""
        with self._sleep_lock:
            self.sleepers += 1
        return self.wait(timeout)

    def awake(self) -> None:
        with self._sleep_lock:
            self.sleepers -= 1

    @property
    def owes(self) -> bool:
        """Whether released credit waits to be returned (cheap: checked on every progress round)."""
        return bool(self.returns or self.owed)

    def take_owed(self, peer: int) -> list[tuple[int, int]]:
        """``(edge, nbytes)`` of all credit owed to ``peer``, now (it rides with a message to it)."""
        if self.returns:
            self._fold()
        owed = self.owed
        if len(owed) == 1:      # (the common case: one edge of one peer owed)
            ((key, n),) = owed.items()
            if key[0] != peer:
                return []
            owed.clear()
            self._owed_since = float("inf")
            self._owed_peak = 0
            return [(key[1], n)]
        out = [(k[1], owed.pop(k)) for k in [k for k in owed if k[0] == peer]]
        if not owed:
            self._owed_since = float("inf")
            self._owed_peak = 0
        return out

    def due(self) -> list[tuple[int, int, int]]:
        """``(peer, edge, nbytes)`` of credit to return now, in batches: a (peer, edge) gets its bytes
        back once a quarter of its credit is owed, or once the oldest owed byte waited ``CREDIT_DELAY``.
        A stream of large messages then costs the sender one CREDIT frame (and one wake-up of its
        engine) per quarter of the credit instead of one per message. A sender can only be held up by
        what is owed if its next message is larger than about three quarters of the credit, and then
        for ``CREDIT_DELAY``."""
        if self.returns:
            self._fold()
        owed = self.owed
        if not owed:
            return []
        due = time.monotonic() - self._owed_since >= CREDIT_DELAY
        batch = self.credit // 4
        if not due and self._owed_peak < batch:
            return []       # (the common case, after every released message: nothing is due yet)
        out = [(k[0], k[1], owed.pop(k)) for k in [k for k, n in owed.items() if due or n >= batch]]
        if not owed:
            self._owed_since = float("inf")
            self._owed_peak = 0
        return out

    def _fold(self) -> None:
        """Move the releases reported (from any thread) into what is owed per (peer, edge)."""
        if self.returns:
            owed = self.owed
            if not owed:
                self._owed_since = time.monotonic()
            peak = self._owed_peak
            while self.returns:
                peer, edge, n = self.returns.popleft()
                total = owed[(peer, edge)] = owed.get((peer, edge), 0) + n
                if total > peak:
                    peak = total
            self._owed_peak = peak

    def wait(self, timeout: float) -> float:
        """``timeout`` cut short so that owed credit is returned on time."""
        if self.returns:       # released, not yet counted (it is, by the next round): soon
            return min(timeout, CREDIT_DELAY)
        if self.owed:
            return max(0.0, min(timeout, self._owed_since + CREDIT_DELAY - time.monotonic()))
        return timeout
