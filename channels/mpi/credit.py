"""Credit, both ways: the sender's ledger of bytes in flight per (peer, edge), and the receiver's
returns of released bytes, batched per peer (sent once an edge has a quarter of its credit pending,
when a poll is quiet, or after 1 ms). The messages that carry returns are in :mod:`.wire`."""

from __future__ import annotations

import time

from twisternet.channel import fits_credit

#: Pending credit older than this (seconds) is returned even if the batch is small.
_CREDIT_MAX_DELAY = 1e-3


class CreditLedger:
    """Sender side: bytes in flight per (peer, edge) against ``credit`` bytes each (see
    :func:`twisternet.channel.fits_credit`), and the (peer, edge) pairs refused for lack of it,
    which get ``on_credit`` when returns come."""

    __slots__ = ("credit", "in_flight", "_blocked")

    def __init__(self, credit: int) -> None:
        self.credit = credit
        #: Bytes in flight per (peer, edge), none: not in it. Read-only outside this class (the idle
        #: test of every small send reads it without a call).
        self.in_flight: dict[tuple[int, int], int] = {}
        self._blocked: set[tuple[int, int]] = set()

    def fits(self, key: tuple[int, int], cost: int) -> bool:
        """Whether a message of ``cost`` bytes may go on ``key`` now; if not, ``key`` is remembered
        as blocked."""
        if fits_credit(self.in_flight.get(key, 0), cost, self.credit):
            return True
        self._blocked.add(key)
        return False

    def charge(self, key: tuple[int, int], cost: int) -> None:
        """A message of ``cost`` bytes went on ``key``."""
        self.in_flight[key] = self.in_flight.get(key, 0) + cost

    def returned(self, key: tuple[int, int], nbytes: int) -> tuple[bool, bool]:
        """The receiver returned ``nbytes`` on ``key``: ``(unblocked, excess)``, whether ``key`` had
        been refused (and may send again) and whether more came back than was in flight."""
        left = self.in_flight.get(key, 0) - nbytes
        excess = left < 0
        if left > 0:
            self.in_flight[key] = left
        else:
            self.in_flight.pop(key, None)
        if key in self._blocked:
            self._blocked.discard(key)
            return True, excess
        return False, excess


class CreditReturns:
    """Receiver side: bytes released per peer and edge, not yet returned, and since when each peer
    has some waiting. ``batch``: an edge with this much pending is returned at the next poll."""

    __slots__ = ("batch", "pending", "oldest", "full", "_since")

    def __init__(self, batch: int) -> None:
        self.batch = batch
        #: Bytes released and not returned yet: peer -> {edge: bytes}. Read-only outside this class;
        #: non-empty when there are any (what every poll checks, without a call).
        self.pending: dict[int, dict[int, int]] = {}
        #: No later than when the oldest of them was released, and whether an edge may have a full
        #: batch: :meth:`due` can have nothing to return while ``not full`` and the oldest is younger
        #: than the delay (a poll that just received a message skips it then).
        self.oldest = float("inf")
        self.full = False
        self._since: dict[int, float] = {}

    def __bool__(self) -> bool:
        return bool(self.pending)

    def add(self, peer: int, edge: int, nbytes: int) -> None:
        """``nbytes`` of a message from ``peer`` on ``edge`` were released."""
        per_edge = self.pending.get(peer)
        if per_edge is None:
            now = time.monotonic()
            if not self.pending:
                self.oldest = now
            per_edge = self.pending[peer] = {}
            self._since[peer] = now
        total = per_edge[edge] = per_edge.get(edge, 0) + nbytes
        if total >= self.batch:
            self.full = True

    def drop(self, peer: int) -> None:
        """``peer`` left or was lost: nothing goes back to it any more."""
        self.pending.pop(peer, None)
        self._since.pop(peer, None)

    def take(self, peer: int, most: int) -> list[tuple[int, int]]:
        """Take up to ``most`` of ``peer``'s pending returns, ``[(edge, bytes), ...]``, to send now
        along with a message to it (piggybacked); [] if it has none."""
        per_edge = self.pending.get(peer)
        if per_edge is None:
            return []
        if len(per_edge) <= most:
            del self.pending[peer]
            del self._since[peer]
            return list(per_edge.items())
        items = []
        for edge in list(per_edge)[:most]:
            items.append((edge, per_edge.pop(edge)))
        return items

    def due(self, quiet: bool) -> list[tuple[int, list[tuple[int, int]]]]:
        """Take the returns to send now, ``(peer, [(edge, bytes), ...])``: all of them when ``quiet``,
        else only full or old batches."""
        now = time.monotonic()
        batch = self.batch
        out = []
        for peer in list(self.pending):
            per_edge = self.pending[peer]
            if not (quiet or now - self._since[peer] >= _CREDIT_MAX_DELAY
                    or max(per_edge.values()) >= batch):
                continue
            del self.pending[peer]
            del self._since[peer]
            out.append((peer, list(per_edge.items())))
        self.full = False       # (what is left is below the batch)
        self.oldest = min(self._since.values(), default=float("inf"))
        return out
