"""The barrier wire protocol: plain dicts of msgpack-able values between ``BarrierClient`` and
``BarrierService``.

Client -> service (``id`` is an int unique per client; ``spec`` is a ``*Spec.to_dict()``)::

    {"op": "enter",    "id", "name", "label", "round": int | None, "spec"}   # partial/classic barrier
    {"op": "acquire",  "id", "name", "label", "spec"}                       # semaphore barrier
    {"op": "release",  "id", "name", "label"}                               # semaphore barrier
    {"op": "throttle", "id", "name", "label", "spec"}                       # throttled release
    {"op": "complete", "id", "name", "label"}                               # throttled release

Service -> client::

    {"op": "released", "id", "release": BarrierRelease.to_dict()}
    {"op": "catch_up", "id", "name", "label", "rank", "round", "next_round", "fire": FireInfo.to_dict()}
    {"op": "admitted", "id", "admission": Admission.to_dict()}
    {"op": "ack",      "id"}                                                # release / complete done
    {"op": "error",    "id", "name", "kind": error class name, "message"}

The service answers every request exactly once (duplicates of a request, same sender and id, get the same
answer again, or nothing while it is still pending).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Mapping

from .errors import BarrierProtocolError

ENTER, ACQUIRE, RELEASE, THROTTLE, COMPLETE = "enter", "acquire", "release", "throttle", "complete"
RELEASED, CATCH_UP, ADMITTED, ACK, ERROR = "released", "catch_up", "admitted", "ack", "error"
REQUEST_OPS = (ENTER, ACQUIRE, RELEASE, THROTTLE, COMPLETE)
REPLY_OPS = (RELEASED, CATCH_UP, ADMITTED, ACK, ERROR)
_NEEDS_SPEC = (ENTER, ACQUIRE, THROTTLE)


def check_request(msg: Any) -> dict[str, Any]:
    """Validate the shape of a client request; return it, or raise BarrierProtocolError saying what is wrong."""
    if not isinstance(msg, Mapping):
        raise BarrierProtocolError(f"a barrier request must be a dict, got {type(msg).__name__}")
    op = msg.get("op")
    if op not in REQUEST_OPS:
        raise BarrierProtocolError(f"unknown barrier op {op!r}; expected one of {REQUEST_OPS}")
    rid = msg.get("id")
    if isinstance(rid, bool) or not isinstance(rid, int):
        raise BarrierProtocolError(f"{op}: 'id' must be an int, got {rid!r}")
    for key in ("name", "label"):
        v = msg.get(key)
        if not isinstance(v, str) or not v:
            raise BarrierProtocolError(f"{op}: {key!r} must be a non-empty str, got {v!r}")
    if op in _NEEDS_SPEC and not isinstance(msg.get("spec"), Mapping):
        raise BarrierProtocolError(f"{op}: 'spec' must be a dict, got {msg.get('spec')!r}")
    if op == ENTER:
        r = msg.get("round")
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise BarrierProtocolError(f"enter: 'round' must be an int >= 0 or None, got {r!r}")
    return dict(msg)


def error_reply(rid: int | None, name: str | None, exc: BaseException) -> dict[str, Any]:
    """The reply reporting ``exc`` for request ``rid``."""
    return {"op": ERROR, "id": rid, "name": name, "kind": type(exc).__name__, "message": str(exc)}
