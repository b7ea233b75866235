"""Errors of the coflow package; all derive from the library-wide :class:`TwisternetError`."""

from __future__ import annotations

from twisternet.errors import TwisternetError

__all__ = ["CoflowError", "TraceFormatError", "UnknownPolicyError", "SimulationError"]


class CoflowError(TwisternetError, ValueError):
    """A coflow, flow, capacity or policy option is invalid."""


class TraceFormatError(CoflowError):
    """A coflow-benchmark trace line is malformed; the message names the file line."""

    def __init__(self, line_no: int, message: str, source: str = "<trace>") -> None:
        super().__init__(f"{source}:{line_no}: {message}")
        self.line_no = line_no
        self.source = source


class UnknownPolicyError(CoflowError, KeyError):
    """No scheduling policy is registered under the requested name."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SimulationError(CoflowError):
    """The simulator cannot make progress (a policy allocated nothing while work remains)."""
