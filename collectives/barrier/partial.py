"""Partial barriers (Albrecht et al., ATC 2006) as pure, deterministic state machines on an injected clock.

Semantics of one *round* of ``PartialBarrierMachine(name, max, timeout, percent, min_wait, late, callback,
callback_timeout, knee=False)``; ``t0`` is the time of the round's first entry, ``n`` the number of unique
labels entered so far:

1. **max** -- the round fires as soon as ``n == max``.
2. **timeout** -- at ``t0 + timeout`` the round fires whatever ``n`` is. It overrides everything else,
   including a veto of the enter-callback (it is the liveness guarantee).
3. **early release** (``knee=False``) -- fires once *both* conditions hold: ``n >= ceil(percent% of max)``
   and ``now >= t0 + min_wait``. A condition whose parameter is None counts as true, but only if the other
   one is set: with neither ``percent`` nor ``min_wait`` there is no early release. With neither, and no
   ``timeout`` and no knee, the barrier is a classic barrier (only rule 1).
4. **adaptive release** (``knee=True``) -- ``percent`` and ``min_wait`` become *gates* instead of triggers:
   the round fires when a knee is detected in the arrival process (see ``knee.py``) and the gates hold; if a
   knee is detected before ``min_wait`` elapsed, the fire comes when ``min_wait`` elapses while no new label
   arrived since the knee. Rules 1 and 2 still apply.
5. **enter-callback** -- ``callback(label, rank, default) -> bool`` is consulted on every new entry (with
   ``default`` = what rules 1, 3, 4 decide at that moment), whenever a timer makes rules 3/4 decide to fire
   (label and rank None), and every ``callback_timeout`` seconds after its last invocation while the round is
   open (label and rank None), even when nobody arrives. Its answer is final (veto with False, force with
   True) except against rule 2. A callback that raises is logged and its ``default`` used.

Entries count unique *labels* (logical tasks); copies of a label entered from other ranks count once, wait
like the others and are released with them. The fire's ``passed`` map (label -> the first rank that
entered it) tells everyone who made it.

**Rounds.** A named barrier is reused: after round r fired, entries for round r+1 begin a new round. Every
entry carries the round it intends (by default the entrant's ``(label, rank)`` own next round, counted by the
barrier). An entry for a round that already fired is *late*:

* ``late="pass"``: it passes at once with status ``LATE_FIRE`` and the fire's info. Exception, adaptive
  barriers: until the round's timeout (if any) or its ``max``-th label, late arrivals are held and released
  as a group at the next knee the (still running) estimator detects -- later knees release later groups.
  A held arrival thus waits at most ``arr + 4*arrvar`` after the latest arrival.
* ``late="catch_up"``: ``CatchUp`` is raised, carrying the fire's info and ``next_round``, the lowest round
  that has not fired, which the application should enter next (skipping the rounds it missed).

Entering a round beyond the lowest open one is a protocol error. Repeating an entry of the same
``(label, rank)`` for the same round is idempotent: it waits again, or gets the same release back.

Time is passed in as ``now``; overdue timer events are processed in time order (each at its own deadline)
before an entry is counted, so the result does not depend on how often ``tick`` runs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from collections.abc import Callable

from .errors import BarrierProtocolError, BarrierSpecError, CatchUp
from .knee import KneeDetector
from .records import BarrierRelease, EnterOutcome, FireInfo, FireReason, Status
from .specs import BarrierSpec

log = logging.getLogger(__name__)

#: ``callback(label, rank, default) -> bool``; label and rank are None on timer invocations.
EnterCallback = Callable[[str | None, int | None, bool], bool]
Key = tuple[str, int]

# Priorities of timer events that fall on the same instant: the timeout overrides everything.
_TIMEOUT, _KNEE, _MIN_WAIT, _CALLBACK = 0, 1, 2, 3


@dataclass
class _Round:
    index: int
    t0: float
    timeout_at: float | None
    min_wait_at: float | None
    knee: KneeDetector | None
    labels: dict[str, int] = field(default_factory=dict)
    waiters: list[Key] = field(default_factory=list)
    waiter_set: set[Key] = field(default_factory=set)
    released: dict[Key, BarrierRelease] = field(default_factory=dict)
    held: list[Key] = field(default_factory=list)
    holding: bool = False
    fire: FireInfo | None = None
    cb_next: float | None = None


def check_label_rank(label: object, rank: object) -> None:
    """Raise TypeError/ValueError unless ``label`` is a str and ``rank`` a non-negative int."""
    if not isinstance(label, str):
        raise TypeError(f"barrier labels are str, got {type(label).__name__} {label!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank must be an int >= 0, got {rank!r}")


class PartialBarrierMachine:
    """A named, reusable partial barrier; see the module docstring for the exact release rules."""

    def __init__(self, name: str, max: int, timeout: float | None = None, percent: float | None = None,
                 min_wait: float | None = None, late: str = "pass", callback: EnterCallback | None = None,
                 callback_timeout: float | None = None, *, knee: bool = False, history: int = 1024) -> None:
        if not isinstance(name, str) or not name:
            raise BarrierSpecError("name", f"must be a non-empty str, got {name!r}")
        self.spec = BarrierSpec(max=max, timeout=timeout, percent=percent, min_wait=min_wait, late=late,
                                knee=knee)
        if callback is not None and not callable(callback):
            raise BarrierSpecError("callback", f"must be callable, got {callback!r}")
        if callback_timeout is not None:
            if callback is None:
                raise BarrierSpecError("callback_timeout", "needs a callback")
            if isinstance(callback_timeout, bool) or not isinstance(callback_timeout, (int, float)) \
                    or not math.isfinite(callback_timeout) or callback_timeout <= 0:
                raise BarrierSpecError("callback_timeout", f"must be a finite number > 0, got {callback_timeout!r}")
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise BarrierSpecError("history", f"must be an int >= 1, got {history!r}")
        self.name = name
        self.callback = callback
        self.callback_timeout = None if callback_timeout is None else float(callback_timeout)
        self.history = history
        self._rounds: dict[int, _Round] = {}
        self._current = 0
        self._next_round: dict[Key, int] = {}
        self._outbox: list[BarrierRelease] = []
        self._last_now = -math.inf

    @classmethod
    def from_spec(cls, name: str, spec: BarrierSpec, callback: EnterCallback | None = None,
                  callback_timeout: float | None = None, history: int = 1024) -> PartialBarrierMachine:
        """Build a barrier from a validated ``BarrierSpec``."""
        return cls(name, spec.max, spec.timeout, spec.percent, spec.min_wait, spec.late, callback,
                   callback_timeout, knee=spec.knee, history=history)

    # ------------------------------------------------------------------ inspection
    @property
    def current_round(self) -> int:
        """The lowest round that has not fired (the one a punctual entrant enters)."""
        return self._current

    def fire_info(self, round: int) -> FireInfo | None:
        """The fire of ``round``, or None if it has not fired (or was forgotten, see ``history``)."""
        rd = self._rounds.get(round)
        return None if rd is None else rd.fire

    def entered(self, round: int) -> dict[str, int]:
        """Unique labels that entered ``round`` so far (label -> first rank), late ones included."""
        rd = self._rounds.get(round)
        return {} if rd is None else dict(rd.labels)

    def knees(self, round: int) -> list[tuple[float, int]]:
        """Knees detected in ``round`` as (time, arrivals before it); empty unless ``knee=True``."""
        rd = self._rounds.get(round)
        return [] if rd is None or rd.knee is None else list(rd.knee.knees)

    def knee_detector(self, round: int) -> KneeDetector | None:
        """The live estimator of ``round`` (None for non-adaptive barriers or unknown rounds)."""
        rd = self._rounds.get(round)
        return None if rd is None else rd.knee

    def next_round_of(self, label: str, rank: int) -> int:
        """The round the next default entry of ``(label, rank)`` goes to."""
        return self._next_round.get((label, rank), 0)

    # ------------------------------------------------------------------ driving
    def enter(self, label: str, rank: int, now: float, round: int | None = None) -> EnterOutcome:
        """Count ``label`` entering from ``rank`` at ``now`` for ``round`` (default: its own next round).

        Returns the entrant's own release (None while it waits) and every release this call caused. Raises
        ``CatchUp`` for a late arrival of a ``late="catch_up"`` barrier (releases that overdue timers caused
        during this call are then returned by the next ``tick``).
        """
        check_label_rank(label, rank)
        now = self._clamp(now)
        self._outbox.extend(self._advance(now))
        key = (label, rank)
        r = self._next_round.get(key, 0) if round is None else round
        if isinstance(r, bool) or not isinstance(r, int) or r < 0:
            raise BarrierProtocolError(f"barrier {self.name!r}: round must be an int >= 0, got {r!r}")
        if r > self._current:
            raise BarrierProtocolError(f"barrier {self.name!r}: {label!r} (rank {rank}) entered round {r} while "
                                       f"round {self._current} has not fired")
        if r < self._current:
            own = self._enter_late(r, key, now)
        else:
            own = self._enter_open(r, key, now)
        releases, self._outbox = tuple(self._outbox), []
        return EnterOutcome(own=own, releases=releases)

    def tick(self, now: float) -> list[BarrierRelease]:
        """Process every timer event due by ``now``; return the releases they caused."""
        now = self._clamp(now)
        out, self._outbox = self._outbox, []
        out.extend(self._advance(now))
        return out

    def next_deadline(self) -> float | None:
        """The time of the next timer event (None: nothing will happen until somebody enters)."""
        if self._outbox:
            return self._last_now
        ev = self._next_event()
        return None if ev is None else ev[0]

    # ------------------------------------------------------------------ entries
    def _enter_open(self, r: int, key: Key, now: float) -> BarrierRelease | None:
        rd = self._rounds.get(r)
        if rd is None:
            spec = self.spec
            rd = _Round(index=r, t0=now,
                        timeout_at=None if spec.timeout is None else now + spec.timeout,
                        min_wait_at=None if spec.min_wait is None else now + spec.min_wait,
                        knee=KneeDetector() if spec.knee else None)
            self._rounds[r] = rd
        if key in rd.waiter_set:
            return None  # a repeated entry: still waiting
        label, rank = key
        rd.waiters.append(key)
        rd.waiter_set.add(key)
        if label not in rd.labels:
            rd.labels[label] = rank
            if rd.knee is not None:
                rd.knee.observe(now)
        log.debug("barrier %r round %d: %r (rank %d) entered at %g, %d/%d labels", self.name, r, label, rank,
                  now, len(rd.labels), self.spec.max)
        self._outbox.extend(self._evaluate(rd, now, label, rank, on_entry=True))
        return rd.released.get(key)

    def _enter_late(self, r: int, key: Key, now: float) -> BarrierRelease | None:
        rd = self._rounds.get(r)
        if rd is None or rd.fire is None:
            raise BarrierProtocolError(f"barrier {self.name!r}: round {r} is older than the {self.history} rounds "
                                       f"remembered; cannot answer a late entry for it")
        if key in rd.released:
            return rd.released[key]          # a repeated entry: same answer
        if key in rd.held:
            return None                      # a repeated entry: still held for the next knee
        label, rank = key
        new_label = label not in rd.labels
        if new_label:
            rd.labels[label] = rank
            if rd.knee is not None:
                rd.knee.observe(now)
        if self.spec.late == "catch_up":
            self._next_round[key] = self._current
            log.debug("barrier %r round %d: %r (rank %d) late, told to catch up to %d", self.name, r, label,
                      rank, self._current)
            raise CatchUp(self.name, label, rank, r, rd.fire, self._current)
        if rd.holding:
            rd.held.append(key)
            if len(rd.labels) >= self.spec.max:
                self._outbox.extend(self._release_held(rd, now, stop_holding=True))
            return rd.released.get(key)
        rel = BarrierRelease(self.name, label, rank, r, Status.LATE_FIRE, rd.fire, now)
        rd.released[key] = rel
        self._next_round[key] = r + 1
        self._outbox.append(rel)
        return rel

    # ------------------------------------------------------------------ rules
    def _gates(self, rd: _Round, now: float) -> bool:
        thr = self.spec.percent_threshold
        return (thr is None or len(rd.labels) >= thr) and \
            (self.spec.min_wait is None or now >= rd.t0 + self.spec.min_wait)

    def _rules(self, rd: _Round, now: float) -> tuple[bool, FireReason | None]:
        """What rules 1, 3 and 4 decide at ``now`` (rule 2, the timeout, is a timer event)."""
        spec = self.spec
        if len(rd.labels) >= spec.max:
            return True, FireReason.MAX
        if spec.knee:
            assert rd.knee is not None
            if rd.knee.in_knee and self._gates(rd, now):
                return True, FireReason.KNEE
            return False, None
        if (spec.percent is not None or spec.min_wait is not None) and self._gates(rd, now):
            return True, FireReason.EARLY
        return False, None

    def _evaluate(self, rd: _Round, now: float, label: str | None, rank: int | None, *,
                  on_entry: bool = False, callback_timer: bool = False) -> list[BarrierRelease]:
        if rd.fire is not None:
            return []
        if rd.timeout_at is not None and now >= rd.timeout_at:
            return self._fire(rd, FireReason.TIMEOUT, now)
        default, reason = self._rules(rd, now)
        if self.callback is not None and (default or on_entry or callback_timer):
            if self._consult(rd, label, rank, default, now):
                return self._fire(rd, reason if default and reason is not None else FireReason.CALLBACK, now)
            return []
        if default and reason is not None:
            return self._fire(rd, reason, now)
        return []

    def _consult(self, rd: _Round, label: str | None, rank: int | None, default: bool, now: float) -> bool:
        assert self.callback is not None
        try:
            decision = bool(self.callback(label, rank, default))
        except Exception:  # a user callback must not break the barrier
            log.exception("barrier %r: enter-callback raised; using the default decision %s", self.name, default)
            decision = default
        if self.callback_timeout is not None:
            rd.cb_next = now + self.callback_timeout
        if decision != default:
            log.debug("barrier %r round %d: callback %s the fire", self.name, rd.index,
                      "forced" if decision else "vetoed")
        return decision

    def _fire(self, rd: _Round, reason: FireReason, now: float) -> list[BarrierRelease]:
        info = FireInfo(self.name, rd.index, reason, now, dict(rd.labels))
        rd.fire = info
        out = []
        for key in rd.waiters:
            rel = BarrierRelease(self.name, key[0], key[1], rd.index, Status.FIRE, info, now)
            rd.released[key] = rel
            self._next_round[key] = rd.index + 1
            out.append(rel)
        rd.waiters, rd.waiter_set = [], set()
        rd.min_wait_at = None
        rd.cb_next = None
        rd.holding = (self.spec.knee and self.spec.late == "pass" and len(rd.labels) < self.spec.max
                      and reason is not FireReason.TIMEOUT)
        if not rd.holding:
            rd.timeout_at = None
        self._current = rd.index + 1
        log.debug("barrier %r round %d fired at %g (%s): %d/%d labels passed", self.name, rd.index, now,
                 reason.value, len(info.passed), self.spec.max)
        self._prune()
        return out

    def _release_held(self, rd: _Round, now: float, *, stop_holding: bool) -> list[BarrierRelease]:
        assert rd.fire is not None
        out = []
        for key in rd.held:
            rel = BarrierRelease(self.name, key[0], key[1], rd.index, Status.LATE_FIRE, rd.fire, now)
            rd.released[key] = rel
            self._next_round[key] = rd.index + 1
            out.append(rel)
        rd.held = []
        if stop_holding:
            rd.holding = False
            rd.timeout_at = None
        return out

    def _prune(self) -> None:
        floor = self._current - self.history
        for r in [r for r, rd in self._rounds.items() if r < floor and not rd.holding]:
            del self._rounds[r]

    # ------------------------------------------------------------------ timers
    def _next_event(self) -> tuple[float, int, int] | None:
        best: tuple[float, int, int] | None = None
        for rd in self._rounds.values():
            if rd.fire is not None and not rd.holding:
                continue
            cands = []
            if rd.timeout_at is not None:
                cands.append((rd.timeout_at, _TIMEOUT, rd.index))
            if rd.knee is not None:
                d = rd.knee.deadline()
                if d is not None:
                    cands.append((d, _KNEE, rd.index))
            if rd.fire is None:
                if rd.min_wait_at is not None:
                    cands.append((rd.min_wait_at, _MIN_WAIT, rd.index))
                if rd.cb_next is not None:
                    cands.append((rd.cb_next, _CALLBACK, rd.index))
            for c in cands:
                if best is None or c < best:
                    best = c
        return best

    def _advance(self, now: float) -> list[BarrierRelease]:
        out: list[BarrierRelease] = []
        while True:
            ev = self._next_event()
            if ev is None or ev[0] > now:
                return out
            t, kind, r = ev
            rd = self._rounds[r]
            if kind == _TIMEOUT:
                rd.timeout_at = None
                if rd.fire is None:
                    out.extend(self._fire(rd, FireReason.TIMEOUT, t))
                else:
                    out.extend(self._release_held(rd, t, stop_holding=True))
            elif kind == _KNEE:
                assert rd.knee is not None
                rd.knee.check(t)
                log.debug("barrier %r round %d: knee at %g after %d arrivals", self.name, r, t, rd.knee.arrivals)
                if rd.fire is None:
                    out.extend(self._evaluate(rd, t, None, None))
                elif rd.held:
                    out.extend(self._release_held(rd, t, stop_holding=False))
            elif kind == _MIN_WAIT:
                rd.min_wait_at = None
                out.extend(self._evaluate(rd, t, None, None))
            else:
                rd.cb_next = None
                out.extend(self._evaluate(rd, t, None, None, callback_timer=True))

    def _clamp(self, now: float) -> float:
        if not isinstance(now, (int, float)) or isinstance(now, bool) or math.isnan(now):
            raise TypeError(f"now must be a number, got {now!r}")
        if now < self._last_now:
            log.debug("barrier %r: time went back from %g to %g; using %g", self.name, self._last_now, now,
                      self._last_now)
            now = self._last_now
        self._last_now = float(now)
        return self._last_now


class BarrierMachine(PartialBarrierMachine):
    """A classic barrier: a round fires only when all ``max`` unique labels have entered."""

    def __init__(self, name: str, max: int, late: str = "pass", *, history: int = 1024) -> None:
        super().__init__(name, max, late=late, history=history)
