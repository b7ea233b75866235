"""Plain records the barrier state machines return: what fired, who passed, who was admitted.

Each record converts to and from a dict of msgpack-able values (``to_dict``/``from_dict``), which is how the
service ships it to clients.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Mapping

from .errors import BarrierProtocolError


class Status(str, enum.Enum):
    """How an entrant left a barrier."""

    #: Released by the fire of the round it entered (it was waiting, or its entry caused the fire).
    FIRE = "fire"
    #: Arrived after its round fired and passed through (``late="pass"``).
    LATE_FIRE = "late_fire"


class FireReason(str, enum.Enum):
    """Which rule released a round."""

    MAX = "max"            # every one of ``max`` unique labels entered
    TIMEOUT = "timeout"    # ``timeout`` seconds elapsed since the first entry
    EARLY = "early"        # percent and/or min_wait satisfied (non-adaptive partial barrier)
    KNEE = "knee"          # adaptive release: a knee in the arrival process, gates satisfied
    CALLBACK = "callback"  # the enter-callback forced a fire the rules would not have taken


@dataclass(frozen=True)
class FireInfo:
    """One fire of one round of a named barrier: when, why, and which labels passed (label -> rank)."""

    name: str
    round: int
    reason: FireReason
    time: float
    passed: dict[str, int] = field(default_factory=dict)

    @property
    def count(self) -> int:
        """How many unique labels the fire released."""
        return len(self.passed)

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-able dict (``passed`` as a list of [label, rank] pairs, in arrival order)."""
        return {"name": self.name, "round": self.round, "reason": self.reason.value, "time": self.time,
                "passed": [[label, rank] for label, rank in self.passed.items()]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FireInfo:
        """Inverse of ``to_dict``; raises BarrierProtocolError on a malformed dict."""
        try:
            return cls(name=str(d["name"]), round=int(d["round"]), reason=FireReason(d["reason"]),
                       time=float(d["time"]), passed={str(l): int(r) for l, r in d["passed"]})
        except (KeyError, TypeError, ValueError) as exc:
            raise BarrierProtocolError(f"malformed fire record {d!r}: {exc}") from None


@dataclass(frozen=True)
class BarrierRelease:
    """One entrant (``label`` entered from ``rank`` for ``round``) leaving the barrier at ``time``."""

    name: str
    label: str
    rank: int
    round: int
    status: Status
    fire: FireInfo
    time: float

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-able dict."""
        return {"name": self.name, "label": self.label, "rank": self.rank, "round": self.round,
                "status": self.status.value, "fire": self.fire.to_dict(), "time": self.time}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BarrierRelease:
        """Inverse of ``to_dict``; raises BarrierProtocolError on a malformed dict."""
        try:
            return cls(name=str(d["name"]), label=str(d["label"]), rank=int(d["rank"]), round=int(d["round"]),
                       status=Status(d["status"]), fire=FireInfo.from_dict(d["fire"]), time=float(d["time"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise BarrierProtocolError(f"malformed release record {d!r}: {exc}") from None


class AdmitReason(str, enum.Enum):
    """Why a semaphore or throttle let an entrant in."""

    FREE = "free"                    # a slot (or period budget) was free when it entered
    RELEASE = "release"              # a holder released and it was next in FIFO order
    HOLD_TIMEOUT = "hold_timeout"    # a holder overran hold_timeout, was presumed failed, and it took the slot
    PERIOD = "period"                # a new throttle period began
    PEER_LOST = "peer_lost"          # a holder's process was lost and it took the slot


@dataclass(frozen=True)
class Admission:
    """``label`` (from ``rank``) was admitted into semaphore/throttle ``name`` at ``time`` for ``reason``."""

    name: str
    label: str
    rank: int
    reason: AdmitReason
    time: float

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-able dict."""
        return {"name": self.name, "label": self.label, "rank": self.rank, "reason": self.reason.value,
                "time": self.time}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Admission:
        """Inverse of ``to_dict``; raises BarrierProtocolError on a malformed dict."""
        try:
            return cls(name=str(d["name"]), label=str(d["label"]), rank=int(d["rank"]),
                       reason=AdmitReason(d["reason"]), time=float(d["time"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise BarrierProtocolError(f"malformed admission record {d!r}: {exc}") from None


@dataclass(frozen=True)
class EnterOutcome:
    """What one ``enter`` call on a pure barrier produced.

    ``own`` is the entrant's own release (None: it waits); ``releases`` lists every release the call caused,
    in order: overdue timer fires processed first, then the entrant's and the others' releases.
    """

    own: BarrierRelease | None
    releases: tuple[BarrierRelease, ...] = ()

    @property
    def status(self) -> Status | None:
        """The entrant's status, or None while it waits."""
        return None if self.own is None else self.own.status

    @property
    def waiting(self) -> bool:
        """True when the entrant was not released by this call."""
        return self.own is None
