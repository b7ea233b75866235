"""``BarrierClient``: the participant side of the barrier protocol, on top of any transport.

The transport gives the client a ``send(msg)`` function (to the service) and feeds every reply from the
service to ``deliver(msg)`` (from any thread). Calls block on a ``threading.Condition`` until the reply
comes, the ``timeout`` runs out (``BarrierTimeout``) or the client is closed (``BarrierClosed``);
``enter_async`` instead calls ``on_done(result_or_exception)`` on the thread that delivers the reply (keep
it short and non-blocking).

The client counts rounds per ``(name, label)``: after a release from round r the next ``enter`` goes to
round r+1; after ``CatchUp`` it goes to the ``next_round`` the service named. Pass ``round=`` to override.
A timed-out ``enter`` stays counted at the service (the entry did happen) and does not advance the round:
calling ``enter`` again retries the same round and gets that round's answer (its fire, or a late pass).

Callbacks (the enter-callback of a partial barrier, the release-callback of a semaphore) are Python
callables and cannot cross processes: ``enter(..., callback=...)`` is accepted only by a client built with
``service=`` (an in-process service, or any object with thread-safe ``set_enter_callback`` /
``set_release_callback`` methods such as ``LocalBarrierCluster``); otherwise install them on the service
where it runs.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from . import protocol as P
from .clock import Clock, MonotonicClock
from .errors import (BarrierClosed, BarrierError, BarrierMismatchError, BarrierProtocolError, BarrierTimeout,
                     CatchUp, RemoteBarrierError)
from .partial import EnterCallback
from .records import Admission, BarrierRelease, FireInfo
from .semaphore import ReleaseCallback
from .specs import BarrierSpec, SemaphoreSpec, ThrottleSpec

log = logging.getLogger(__name__)

Result = BarrierRelease | Admission | None
OnDone = Callable[[Result | BaseException], None]
_WAIT_SLICE = 0.05  # seconds; bounds how late a timeout on a non-real clock is noticed
_ERRORS = {"BarrierMismatchError": BarrierMismatchError, "BarrierProtocolError": BarrierProtocolError}


@dataclass
class _Pending:
    op: str
    name: str
    label: str
    on_done: OnDone | None = None
    done: bool = False
    result: Result | BaseException = None
    rid: int = 0


class BarrierClient:
    """Enters barriers, semaphores and throttles held by a (possibly remote) ``BarrierService``."""

    def __init__(self, send: Callable[[dict[str, Any]], None], clock: Clock | None = None, *,
                 service: Any = None) -> None:
        self._send = send
        self._clock: Clock = clock if clock is not None else MonotonicClock()
        self._service = service
        self._cond = threading.Condition()
        self._next_id = 0
        self._pending: dict[int, _Pending] = {}
        self._rounds: dict[tuple[str, str], int] = {}
        self._closed = False

    # ------------------------------------------------------------------ partial barriers
    def enter(self, name: str, label: str, spec: BarrierSpec | None = None, *, round: int | None = None,
              timeout: float | None = None, callback: EnterCallback | None = None,
              callback_timeout: float | None = None) -> BarrierRelease:
        """Enter barrier ``name`` as ``label`` and block until released (``Status.FIRE`` or ``LATE_FIRE``).

        ``spec`` must be equal on every participant (it creates the barrier on first use); ``timeout`` bounds
        the wait (None: wait for ever). Raises ``CatchUp`` (late arrival at a catch-up barrier),
        ``BarrierTimeout``, ``BarrierClosed``, ``BarrierMismatchError`` or another ``BarrierError``.
        """
        p = self._start_enter(name, label, spec, round, None, callback, callback_timeout)
        result = self._wait(p, timeout, f"enter barrier {name!r} as {label!r}")
        assert isinstance(result, BarrierRelease)
        return result

    def enter_async(self, name: str, label: str, on_done: OnDone, spec: BarrierSpec | None = None, *,
                    round: int | None = None) -> int:
        """Like ``enter`` but returns the request id at once; ``on_done`` gets the release or the exception."""
        if not callable(on_done):
            raise TypeError(f"on_done must be callable, got {on_done!r}")
        return self._start_enter(name, label, spec, round, on_done, None, None).rid

    def next_round(self, name: str, label: str) -> int:
        """The round the next ``enter(name, label)`` goes to."""
        with self._cond:
            return self._rounds.get((name, label), 0)

    # ------------------------------------------------------------------ semaphores and throttles
    def acquire(self, name: str, label: str, spec: SemaphoreSpec | None = None, *,
                timeout: float | None = None, release_callback: ReleaseCallback | None = None) -> Admission:
        """Block until semaphore ``name`` admits ``label``."""
        if spec is not None and not isinstance(spec, SemaphoreSpec):
            raise TypeError(f"acquire needs a SemaphoreSpec, got {type(spec).__name__}")
        if release_callback is not None:
            self._local_service("release_callback").set_release_callback(name, release_callback)
        p = self._request(P.ACQUIRE, name, label, {"spec": None if spec is None else spec.to_dict()}, None)
        result = self._wait(p, timeout, f"acquire semaphore {name!r} as {label!r}")
        assert isinstance(result, Admission)
        return result

    def release(self, name: str, label: str, *, timeout: float | None = None) -> None:
        """Give back ``label``'s slot of semaphore ``name`` (or withdraw it from the queue); waits for the ack."""
        p = self._request(P.RELEASE, name, label, {}, None)
        self._wait(p, timeout, f"release semaphore {name!r} as {label!r}")

    def throttle(self, name: str, label: str, spec: ThrottleSpec | None = None, *,
                 timeout: float | None = None) -> Admission:
        """Block until throttled release ``name`` lets ``label`` through."""
        if spec is not None and not isinstance(spec, ThrottleSpec):
            raise TypeError(f"throttle needs a ThrottleSpec, got {type(spec).__name__}")
        p = self._request(P.THROTTLE, name, label, {"spec": None if spec is None else spec.to_dict()}, None)
        result = self._wait(p, timeout, f"pass throttle {name!r} as {label!r}")
        assert isinstance(result, Admission)
        return result

    def complete(self, name: str, label: str, *, timeout: float | None = None) -> None:
        """Report that ``label`` finished the work throttle ``name`` released it for (feeds adaptive policies)."""
        p = self._request(P.COMPLETE, name, label, {}, None)
        self._wait(p, timeout, f"complete throttle {name!r} as {label!r}")

    # ------------------------------------------------------------------ transport side
    def deliver(self, msg: dict[str, Any]) -> None:
        """Feed one reply from the service (any thread). Unknown or repeated replies are ignored."""
        try:
            rid = msg["id"]
            op = msg["op"]
        except (KeyError, TypeError):
            log.warning("barrier client: malformed reply %r ignored", msg)
            return
        with self._cond:
            p = self._pending.pop(rid, None) if isinstance(rid, int) else None
            if p is None:
                log.debug("barrier client: reply %r for no pending request ignored", msg)
                return
            result = self._decode(p, op, msg)
            if p.on_done is None:
                p.done, p.result = True, result
                self._cond.notify_all()
                return
        try:
            p.on_done(result)
        except Exception:  # must not kill the transport thread
            log.exception("barrier client: on_done callback raised")

    def close(self) -> None:
        """Fail every pending call with ``BarrierClosed``; later calls fail at once."""
        with self._cond:
            self._closed = True
            pending, self._pending = self._pending, {}
            for p in pending.values():
                p.done, p.result = True, BarrierClosed(f"barrier client closed during {p.op} {p.name!r}")
            self._cond.notify_all()
        for p in pending.values():
            if p.on_done is not None:
                try:
                    p.on_done(p.result)
                except Exception:
                    log.exception("barrier client: on_done callback raised")

    @property
    def closed(self) -> bool:
        """True after ``close``."""
        return self._closed

    # ------------------------------------------------------------------ internals
    def _start_enter(self, name: str, label: str, spec: BarrierSpec | None, round: int | None,
                     on_done: OnDone | None, callback: EnterCallback | None,
                     callback_timeout: float | None) -> _Pending:
        if spec is not None and not isinstance(spec, BarrierSpec):
            raise TypeError(f"enter needs a BarrierSpec, got {type(spec).__name__}")
        if round is not None and (isinstance(round, bool) or not isinstance(round, int) or round < 0):
            raise ValueError(f"round must be an int >= 0, got {round!r}")
        if callback is not None:
            self._local_service("callback").set_enter_callback(name, callback, callback_timeout)
        elif callback_timeout is not None:
            raise ValueError("callback_timeout needs a callback")
        with self._cond:
            r = self._rounds.get((name, label), 0) if round is None else round
        return self._request(P.ENTER, name, label,
                             {"round": r, "spec": None if spec is None else spec.to_dict()}, on_done)

    def _local_service(self, what: str) -> Any:
        if self._service is None:
            raise TypeError(f"a {what} is a Python callable and cannot cross processes: install it on the "
                            f"BarrierService where it runs, or build this client with service=<in-process service>")
        return self._service

    def _request(self, op: str, name: str, label: str, extra: dict[str, Any],
                 on_done: OnDone | None) -> _Pending:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if not isinstance(label, str) or not label:
            raise TypeError(f"label must be a non-empty str, got {label!r}")
        with self._cond:
            if self._closed:
                raise BarrierClosed(f"barrier client is closed ({op} {name!r})")
            self._next_id += 1
            rid = self._next_id
            pending = _Pending(op, name, label, on_done, rid=rid)
            self._pending[rid] = pending
        msg = {"op": op, "id": rid, "name": name, "label": label, **extra}
        try:
            self._send(msg)
        except BaseException:
            with self._cond:
                self._pending.pop(rid, None)
            raise
        return pending

    def _wait(self, p: _Pending, timeout: float | None, what: str) -> Result:
        deadline = None if timeout is None else self._clock.time() + timeout
        with self._cond:
            while not p.done:
                if deadline is not None:
                    remaining = deadline - self._clock.time()
                    if remaining <= 0:
                        self._pending.pop(p.rid, None)
                        raise BarrierTimeout(what, operation="barrier", timeout=timeout)
                    self._cond.wait(min(remaining, _WAIT_SLICE))
                else:
                    self._cond.wait(_WAIT_SLICE)
        if isinstance(p.result, BaseException):
            raise p.result
        return p.result  # type: ignore[return-value]

    def _decode(self, p: _Pending, op: str, msg: dict[str, Any]) -> Result | BaseException:
        """Turn a reply into a result or an exception (called with the lock held)."""
        try:
            if op == P.RELEASED:
                rel = BarrierRelease.from_dict(msg["release"])
                self._rounds[(rel.name, p.label)] = rel.round + 1
                return rel
            if op == P.CATCH_UP:
                fire = FireInfo.from_dict(msg["fire"])
                self._rounds[(p.name, p.label)] = int(msg["next_round"])
                return CatchUp(p.name, p.label, int(msg["rank"]), int(msg["round"]), fire, int(msg["next_round"]))
            if op == P.ADMITTED:
                return Admission.from_dict(msg["admission"])
            if op == P.ACK:
                return None
            if op == P.ERROR:
                kind, text = str(msg.get("kind")), str(msg.get("message"))
                cls = _ERRORS.get(kind)
                return cls(text) if cls is not None else RemoteBarrierError(kind, text, msg.get("name"))
            return BarrierProtocolError(f"unexpected reply op {op!r} to {p.op} {p.name!r}")
        except (KeyError, TypeError, ValueError, BarrierError) as exc:
            return BarrierProtocolError(f"malformed reply {msg!r} to {p.op} {p.name!r}: {exc}")
