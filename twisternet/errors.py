"""The one exception hierarchy of twisternet: every error the library raises derives from TwisternetError."""

from __future__ import annotations

from collections.abc import Iterable


class TwisternetError(Exception):
    """Base class of every error twisternet raises."""

    #: Set on an error another rank had first (or was told of already): an operation failing with it
    #: does not send it back to the other ranks.
    remote: bool = False


class ConfigError(TwisternetError, ValueError):
    """A configuration key is unknown or its value is invalid; the message names the key."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"config key {key!r}: {message}")
        self.key = key


class CodecError(TwisternetError, TypeError):
    """A value cannot be encoded or decoded (unsupported type, pickle not allowed, corrupt bytes)."""


class ProtocolError(TwisternetError):
    """A peer sent bytes that do not follow the wire protocol."""


class AuthError(TwisternetError):
    """A connection failed the job-token challenge."""


class PeerLostError(TwisternetError):
    """A peer process died or became unreachable while this process depended on it."""

    def __init__(self, rank: int, reason: str = "") -> None:
        msg = f"peer rank {rank} was lost"
        if reason:
            msg += f": {reason}"
        super().__init__(msg)
        self.rank = rank
        self.reason = reason


class OperationTimeout(TwisternetError, TimeoutError):
    """A blocking operation did not complete in time; names the edge, the operation and missing sources."""

    def __init__(self, what: str, *, edge: int | None = None, operation: str | None = None,
                 missing_sources: Iterable[int] = (), timeout: float | None = None) -> None:
        self.edge = edge
        self.operation = operation
        self.missing_sources = sorted(missing_sources)
        self.timeout = timeout
        parts = [what]
        if operation is not None:
            parts.append(f"operation={operation}")
        if edge is not None:
            parts.append(f"edge={edge}")
        if self.missing_sources:
            parts.append(f"sources that never finished={self.missing_sources}")
        if timeout is not None:
            parts.append(f"after {timeout:g}s")
        super().__init__("; ".join(parts))


class BackPressureTimeout(OperationTimeout):
    """A send stayed blocked by back pressure (no credit from the receiver) past its timeout."""


class ClosedError(TwisternetError):
    """The context, channel or operation was already closed."""


class LaunchError(TwisternetError, RuntimeError):
    """The launcher could not start the job (a missing extra, a helper process that did not start)."""


class LaunchEnvError(ConfigError):
    """A launcher's environment variables are incomplete or contradict each other; names the variable."""

    def __init__(self, variable: str, message: str) -> None:
        TwisternetError.__init__(self, f"environment variable {variable}: {message}")
        self.key = variable


class MismatchError(TwisternetError, ValueError):
    """Ranks of one collective call disagree about what they do (array dtype, shape or length, the kind
    of operation on an edge); raised on every rank, naming the ranks that differ."""

    def __init__(self, message: str, ranks: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.ranks = sorted(ranks)


class RemoteError(TwisternetError):
    """An operation failed on another rank (e.g. its reduction function raised there); every rank of
    the operation raises this, naming the rank where it failed and what went wrong."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank} failed: {message}")
        self.rank = rank
        self.remote_message = message


class ArrowUnavailableError(TwisternetError, ImportError):
    """A table API was used but pyarrow is not installed (``pip install 'twisternet[arrow]'``)."""


class TableSchemaError(TwisternetError, ValueError):
    """Tables sent to one columnar operation do not fit together (schemas differ, a key column is
    missing or of an unsupported type); the message names the columns and the ranks."""
