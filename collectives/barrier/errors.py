"""Errors raised by partial barriers, semaphores and throttles (all under ``TwisternetError``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from twisternet.errors import ClosedError, OperationTimeout, TwisternetError

if TYPE_CHECKING:
    from .records import FireInfo


class BarrierError(TwisternetError):
    """Base class of the errors of this package."""


class BarrierSpecError(BarrierError, ValueError):
    """A barrier parameter is invalid; the message names the parameter."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"barrier parameter {param!r}: {message}")
        self.param = param


class BarrierMismatchError(BarrierError):
    """Two participants created the same named barrier with different parameters (or kinds)."""


class BarrierProtocolError(BarrierError):
    """A barrier message or call does not follow the protocol (bad round, unknown holder, malformed dict)."""


class BarrierTimeout(OperationTimeout):
    """A blocking barrier call (enter, acquire, release) was not answered in time."""


class BarrierClosed(ClosedError):
    """The barrier client was closed while a call was pending or before it was made."""


class CatchUp(BarrierError):
    """A late arrival at a ``late="catch_up"`` barrier: the round already fired, skip ahead to ``next_round``.

    ``fire`` describes the round that fired without this entrant; ``next_round`` is the lowest round that
    has not fired yet, the one the application should enter next.
    """

    def __init__(self, name: str, label: str, rank: int, round: int, fire: FireInfo,
                 next_round: int) -> None:
        super().__init__(f"barrier {name!r}: label {label!r} (rank {rank}) arrived late for round {round}, "
                         f"which fired at t={fire.time:g} ({fire.reason}); catch up to round {next_round}")
        self.name = name
        self.label = label
        self.rank = rank
        self.round = round
        self.fire = fire
        self.next_round = next_round


class RemoteBarrierError(BarrierError):
    """The barrier service rejected a request; ``kind`` is the service's error class name."""

    def __init__(self, kind: str, message: str, name: str | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.name = name
