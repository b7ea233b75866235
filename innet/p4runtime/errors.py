"""P4Runtime errors: one exception carrying a google.rpc canonical code, and the mapping from ControlError."""

from __future__ import annotations

import grpc

from innet.control import ControlError

from .protos import code_pb2

# google.rpc.Code number -> grpc.StatusCode (same numbering).
_GRPC_BY_NUMBER = {sc.value[0]: sc for sc in grpc.StatusCode}


class P4RuntimeError(Exception):
    """A failed P4Runtime operation: ``code`` is a google.rpc.Code value, ``message`` is for humans."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = int(code)
        self.message = message

    @property
    def code_name(self) -> str:
        return code_pb2.Code.Name(self.code)

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _GRPC_BY_NUMBER.get(self.code, grpc.StatusCode.UNKNOWN)

    def __str__(self) -> str:
        return f"{self.code_name}: {self.message}"


def invalid_argument(message: str) -> P4RuntimeError:
    return P4RuntimeError(code_pb2.INVALID_ARGUMENT, message)


def not_found(message: str) -> P4RuntimeError:
    return P4RuntimeError(code_pb2.NOT_FOUND, message)


def out_of_range(message: str) -> P4RuntimeError:
    return P4RuntimeError(code_pb2.OUT_OF_RANGE, message)


def unimplemented(message: str) -> P4RuntimeError:
    return P4RuntimeError(code_pb2.UNIMPLEMENTED, message)


def permission_denied(message: str) -> P4RuntimeError:
    return P4RuntimeError(code_pb2.PERMISSION_DENIED, message)


def from_control_error(exc: ControlError) -> P4RuntimeError:
    """Translate a switch-side ControlError (its ``code`` names a canonical code) to a P4RuntimeError."""
    try:
        code = code_pb2.Code.Value(getattr(exc, "code", "UNKNOWN"))
    except ValueError:
        code = code_pb2.UNKNOWN
    return P4RuntimeError(code, str(exc) or type(exc).__name__)
