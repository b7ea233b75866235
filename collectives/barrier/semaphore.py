"""Semaphore barriers: at most ``limit`` labels inside at once, the rest wait in FIFO order.

``SemaphoreBarrierMachine(name, n, hold_timeout, release_callback, policy)``:

* ``enter(label, rank, now)`` admits at once while fewer than ``limit`` (initially ``n``) hold a slot,
  otherwise queues the label (FIFO).
* ``release(label, now)`` frees the label's slot and admits the next waiting labels. How many is decided by
  ``release_callback(label, rank, held_seconds)`` if given and it returns an int, else by the ``policy``
  (default ``FixedConcurrency``: one). Admitting k in place of one changes ``limit`` by k - 1, bounded to
  [1, ``max_concurrency``]; ``AdaptiveConcurrency`` thus shrinks, keeps or grows concurrency.
* A holder that has not released ``hold_timeout`` seconds after its admission is presumed failed: its slot
  goes to the next waiting label (``limit`` unchanged) and a later ``release`` from it is ignored.
* Releasing a label that is still waiting withdraws it from the queue.

Repeated ``enter`` of a label that holds or waits is idempotent.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from dataclasses import dataclass
from collections.abc import Callable

from .concurrency import ConcurrencyPolicy, FixedConcurrency
from .errors import BarrierProtocolError, BarrierSpecError
from .partial import check_label_rank
from .records import Admission, AdmitReason
from .specs import SemaphoreSpec

log = logging.getLogger(__name__)

#: ``release_callback(label, rank, held_seconds) -> how many to admit`` (None: ask the policy).
ReleaseCallback = Callable[[str, int, float], int | None]


@dataclass(frozen=True)
class AdmitOutcome:
    """What one ``enter`` on a semaphore or throttle produced: the entrant's admission (None: it waits) and
    every admission the call caused, in order."""

    own: Admission | None
    admissions: tuple[Admission, ...] = ()

    @property
    def waiting(self) -> bool:
        """True when the entrant was not admitted by this call."""
        return self.own is None


class SemaphoreBarrierMachine:
    """A counting semaphore with FIFO admission, failure presumption and pluggable concurrency policy."""

    def __init__(self, name: str, n: int, hold_timeout: float | None = None,
                 release_callback: ReleaseCallback | None = None, *,
                 policy: ConcurrencyPolicy | None = None, max_concurrency: int | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise BarrierSpecError("name", f"must be a non-empty str, got {name!r}")
        self.spec = SemaphoreSpec(n=n, hold_timeout=hold_timeout, max_concurrency=max_concurrency)
        if release_callback is not None and not callable(release_callback):
            raise BarrierSpecError("release_callback", f"must be callable, got {release_callback!r}")
        self.name = name
        self.release_callback = release_callback
        self.policy: ConcurrencyPolicy = policy if policy is not None else FixedConcurrency()
        self.limit = n
        self._holders: OrderedDict[str, tuple[int, float]] = OrderedDict()   # label -> (rank, admitted at)
        self._queue: OrderedDict[str, int] = OrderedDict()                   # label -> rank, FIFO
        self._admissions: dict[str, Admission] = {}
        self._failed: set[str] = set()
        self._last_now = -math.inf

    @property
    def holders(self) -> list[str]:
        """Labels holding a slot, in admission order."""
        return list(self._holders)

    @property
    def waiting(self) -> list[str]:
        """Labels waiting, in FIFO order."""
        return list(self._queue)

    @property
    def presumed_failed(self) -> list[str]:
        """Labels whose hold timed out (until they enter again)."""
        return sorted(self._failed)

    def enter(self, label: str, rank: int, now: float) -> AdmitOutcome:
        """Ask for a slot for ``label`` from ``rank`` at ``now``."""
        check_label_rank(label, rank)
        now = self._clamp(now)
        out = self._expire(now)
        if label in self._holders:
            return AdmitOutcome(self._admissions[label], tuple(out))
        if label in self._queue:
            return AdmitOutcome(None, tuple(out))
        self._failed.discard(label)
        own: Admission | None = None
        if not self._queue and len(self._holders) < self.limit:
            own = self._admit(label, rank, now, AdmitReason.FREE)
            out.append(own)
        else:
            self._queue[label] = rank
            log.debug("semaphore %r: %r (rank %d) waits, %d inside, limit %d", self.name, label, rank,
                      len(self._holders), self.limit)
        return AdmitOutcome(own, tuple(out))

    def release(self, label: str, now: float) -> list[Admission]:
        """``label`` leaves its slot at ``now``; returns the admissions this causes."""
        if not isinstance(label, str):
            raise TypeError(f"barrier labels are str, got {type(label).__name__} {label!r}")
        now = self._clamp(now)
        out = self._expire(now)
        if label in self._queue:
            del self._queue[label]
            log.debug("semaphore %r: %r withdrew from the queue", self.name, label)
            return out
        if label in self._failed:
            log.warning("semaphore %r: release from %r, presumed failed after its hold timeout; ignored",
                        self.name, label)
            self._failed.discard(label)
            return out
        if label not in self._holders:
            raise BarrierProtocolError(f"semaphore {self.name!r}: {label!r} released a slot it does not hold")
        rank, since = self._holders.pop(label)
        del self._admissions[label]
        held = now - since
        self.policy.record(held)
        k: int | None = None
        if self.release_callback is not None:
            try:
                k = self.release_callback(label, rank, held)
            except Exception:  # a user callback must not break the semaphore
                log.exception("semaphore %r: release callback raised; using the policy", self.name)
                k = None
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
                log.error("semaphore %r: release callback returned %r, not an int >= 0; using the policy",
                          self.name, k)
                k = None
        if k is None:
            k = self.policy.admit_count()
        cap = self.spec.max_concurrency
        self.limit = max(1, self.limit + k - 1)
        if cap is not None:
            self.limit = min(cap, self.limit)
        log.debug("semaphore %r: %r released after %gs; admit %d, limit now %d", self.name, label, held, k,
                  self.limit)
        out.extend(self._fill(now, AdmitReason.RELEASE))
        return out

    def drop_rank(self, rank: int, now: float) -> list[Admission]:
        """Rank ``rank`` died: its holders are presumed failed, its waiting labels withdrawn; returns the
        admissions into the freed slots."""
        now = self._clamp(now)
        out = self._expire(now)
        for label in [lab for lab, r in self._queue.items() if r == rank]:
            del self._queue[label]
        lost = [lab for lab, (r, _) in self._holders.items() if r == rank]
        for label in lost:
            del self._holders[label]
            del self._admissions[label]
            self._failed.add(label)
        if lost:
            log.warning("semaphore %r: rank %d lost while holding %s", self.name, rank, lost)
        out.extend(self._fill(now, AdmitReason.PEER_LOST))
        return out

    def tick(self, now: float) -> list[Admission]:
        """Presume failed every holder past its hold timeout by ``now``; return the admissions that causes."""
        return self._expire(self._clamp(now))

    def next_deadline(self) -> float | None:
        """When the oldest holder's hold times out (None without a hold timeout or holders)."""
        if self.spec.hold_timeout is None or not self._holders:
            return None
        return min(since for _, since in self._holders.values()) + self.spec.hold_timeout

    # ------------------------------------------------------------------
    def _admit(self, label: str, rank: int, now: float, reason: AdmitReason) -> Admission:
        adm = Admission(self.name, label, rank, reason, now)
        self._holders[label] = (rank, now)
        self._admissions[label] = adm
        log.debug("semaphore %r: admitted %r (rank %d) at %g (%s)", self.name, label, rank, now, reason.value)
        return adm

    def _fill(self, now: float, reason: AdmitReason) -> list[Admission]:
        out = []
        while self._queue and len(self._holders) < self.limit:
            label, rank = self._queue.popitem(last=False)
            out.append(self._admit(label, rank, now, reason))
        return out

    def _expire(self, now: float) -> list[Admission]:
        out: list[Admission] = []
        ht = self.spec.hold_timeout
        if ht is None:
            return out
        while self._holders:
            label, (rank, since) = min(self._holders.items(), key=lambda kv: kv[1][1])
            t = since + ht
            if t > now:
                break
            del self._holders[label]
            del self._admissions[label]
            self._failed.add(label)
            log.warning("semaphore %r: %r (rank %d) held its slot past %gs; presumed failed", self.name, label,
                        rank, ht)
            out.extend(self._fill(t, AdmitReason.HOLD_TIMEOUT))
        return out

    def _clamp(self, now: float) -> float:
        if not isinstance(now, (int, float)) or isinstance(now, bool) or math.isnan(now):
            raise TypeError(f"now must be a number, got {now!r}")
        self._last_now = max(self._last_now, float(now))
        return self._last_now
