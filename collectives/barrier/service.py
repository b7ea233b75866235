"""``BarrierService``: the one place that holds every named barrier, semaphore and throttle of a job.

It runs where the job has a single coordinator (the bootstrap master under TCP, rank 0 under MPI) and is
transport-agnostic: the transport feeds it requests with ``handle(src_rank, msg, now)``, calls
``tick(now)`` when ``next_deadline()`` comes, and sends the returned ``(rank, reply)`` pairs. It never reads
a clock, starts no thread and is not thread-safe: one thread (the transport's) drives it. When a rank dies,
call ``peer_lost(rank, now)``.

Objects are created by the first request naming them, from the ``spec`` it carries; every later request
must carry an equal spec, or the offender gets an error reply (``BarrierMismatchError``) and nothing else
changes. Requests are idempotent: a duplicate (same sender, same ``id``) is answered with the same reply,
or ignored while the original is still pending, so a fire or admission is never reported twice.

Python callables cannot travel in messages: enter- and release-callbacks and custom policies are installed
on the service object itself (``set_enter_callback``, ``set_release_callback``, ``set_policy``), which only
code in the service's process can do.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, cast

from . import protocol as P
from .concurrency import AdaptiveConcurrency, ConcurrencyPolicy
from .errors import BarrierError, BarrierMismatchError, CatchUp
from .partial import EnterCallback, PartialBarrierMachine
from .records import Admission, BarrierRelease
from .semaphore import ReleaseCallback, SemaphoreBarrierMachine
from .specs import AnySpec, BarrierSpec, SemaphoreSpec, ThrottleSpec, spec_from_dict
from .throttle import ThrottledRelease

log = logging.getLogger(__name__)

Reply = tuple[int, dict[str, Any]]
ReqId = tuple[int, int]  # (src rank, request id)
_KIND_OF_OP = {P.ENTER: "barrier", P.ACQUIRE: "semaphore", P.RELEASE: "semaphore", P.THROTTLE: "throttle",
               P.COMPLETE: "throttle"}


@dataclass
class _Named:
    spec: AnySpec
    obj: PartialBarrierMachine | SemaphoreBarrierMachine | ThrottledRelease
    # barrier: (round, label, rank) -> pending requests; semaphore/throttle: (label,) -> pending requests
    pending: dict[tuple, list[ReqId]] = field(default_factory=dict)


class BarrierService:
    """Coordinator of all barriers of a job; pure message-in, messages-out (see the module docstring)."""

    def __init__(self, *, history: int = 1024, answered_cache: int = 65536) -> None:
        self.history = history
        self._objects: dict[str, _Named] = {}
        self._answered: OrderedDict[ReqId, dict[str, Any]] = OrderedDict()
        self._answered_cache = answered_cache
        self._pending_ids: dict[ReqId, str] = {}
        self._enter_cbs: dict[str, tuple[EnterCallback, float | None]] = {}
        self._release_cbs: dict[str, ReleaseCallback] = {}
        self._policies: dict[str, ConcurrencyPolicy] = {}

    # ------------------------------------------------------------------ in-process configuration
    def set_enter_callback(self, name: str, callback: EnterCallback, callback_timeout: float | None = None) -> None:
        """Install the enter-callback of barrier ``name`` (now, or when the barrier gets created)."""
        self._enter_cbs[name] = (callback, callback_timeout)
        named = self._objects.get(name)
        if named is not None and isinstance(named.obj, PartialBarrierMachine):
            fresh = PartialBarrierMachine.from_spec(name, cast(BarrierSpec, named.spec), callback,  # validates
                                             callback_timeout)
            named.obj.callback, named.obj.callback_timeout = fresh.callback, fresh.callback_timeout

    def set_release_callback(self, name: str, callback: ReleaseCallback) -> None:
        """Install the release-callback of semaphore ``name`` (now, or when it gets created)."""
        self._release_cbs[name] = callback
        named = self._objects.get(name)
        if named is not None and isinstance(named.obj, SemaphoreBarrierMachine):
            named.obj.release_callback = callback

    def set_policy(self, name: str, policy: ConcurrencyPolicy) -> None:
        """Install the concurrency policy of semaphore or throttle ``name`` before it is created."""
        if name in self._objects:
            raise BarrierError(f"{name!r} already exists; set its policy before the first request")
        self._policies[name] = policy

    def get(self, name: str) -> PartialBarrierMachine | SemaphoreBarrierMachine | ThrottledRelease | None:
        """The state machine behind ``name`` (for inspection), or None."""
        named = self._objects.get(name)
        return None if named is None else named.obj

    # ------------------------------------------------------------------ driving
    def handle(self, src_rank: int, msg: dict[str, Any], now: float) -> list[Reply]:
        """Process one request from ``src_rank`` at ``now``; return the replies to send, by rank."""
        rid = msg.get("id") if isinstance(msg, dict) else None
        name = msg.get("name") if isinstance(msg, dict) else None
        out: list[Reply] = []
        try:
            msg = P.check_request(msg)
            key: ReqId = (src_rank, msg["id"])
            if key in self._answered:
                log.debug("barrier service: duplicate request %s from rank %d answered again", msg["id"], src_rank)
                return [(src_rank, self._answered[key])]
            if key in self._pending_ids:
                log.debug("barrier service: duplicate of pending request %s from rank %d ignored", msg["id"],
                          src_rank)
                return []
            out.extend(self.tick(now))   # overdue timers first: they happened before this request
            out.extend(self._dispatch(src_rank, key, msg, now))
        except (BarrierError, TypeError, ValueError) as exc:
            log.warning("barrier service: request %r from rank %d rejected: %s", msg, src_rank, exc)
            ok_id = isinstance(rid, int) and not isinstance(rid, bool)
            reply = P.error_reply(rid if ok_id else None, name if isinstance(name, str) else None, exc)
            if ok_id:
                self._remember((src_rank, cast(int, rid)), reply)
            out.append((src_rank, reply))
        return out

    def tick(self, now: float) -> list[Reply]:
        """Run every timer due by ``now`` (timeouts, min_wait, knees, callback re-invocations, hold timeouts,
        throttle periods); return the replies they cause."""
        out: list[Reply] = []
        for named in self._objects.values():
            obj = named.obj
            if isinstance(obj, PartialBarrierMachine):
                out.extend(self._answer_releases(named, obj.tick(now)))
            else:
                out.extend(self._answer_admissions(named, obj.tick(now)))
        return out

    def peer_lost(self, rank: int, now: float) -> list[Reply]:
        """Rank ``rank`` died: forget its pending requests, free its semaphore slots and queue places.

        Its barrier entries stay counted (it did arrive); nothing is sent to it any more.
        """
        out: list[Reply] = []
        for named in self._objects.values():
            for wkey in list(named.pending):
                reqs = [q for q in named.pending[wkey] if q[0] != rank]
                if reqs:
                    named.pending[wkey] = reqs
                else:
                    del named.pending[wkey]
            if isinstance(named.obj, (SemaphoreBarrierMachine, ThrottledRelease)):
                out.extend(self._answer_admissions(named, named.obj.drop_rank(rank, now)))
        for req in [q for q in self._pending_ids if q[0] == rank]:
            del self._pending_ids[req]
        return [(dst, m) for dst, m in out if dst != rank]

    def next_deadline(self) -> float | None:
        """When ``tick`` must run next (None: only a request can change anything)."""
        ds = [d for d in (n.obj.next_deadline() for n in self._objects.values()) if d is not None]
        return min(ds) if ds else None

    # ------------------------------------------------------------------ requests
    def _dispatch(self, src: int, key: ReqId, msg: dict[str, Any], now: float) -> list[Reply]:
        op, name, label = msg["op"], msg["name"], msg["label"]
        named = self._lookup(op, name, msg.get("spec"))
        obj = named.obj
        if op == P.ENTER:
            assert isinstance(obj, PartialBarrierMachine)
            r = msg.get("round")
            if r is None:
                r = obj.next_round_of(label, src)
            wkey = (r, label, src)
            named.pending.setdefault(wkey, []).append(key)
            self._pending_ids[key] = name
            try:
                outcome = obj.enter(label, src, now, r)
            except CatchUp as cu:
                self._unpend(named, wkey, key)
                reply = {"op": P.CATCH_UP, "id": key[1], "name": name, "label": label, "rank": src, "round": cu.round,
                         "next_round": cu.next_round, "fire": cu.fire.to_dict()}
                self._remember(key, reply)
                return [(src, reply)]
            except BaseException:
                self._unpend(named, wkey, key)
                raise
            out = self._answer_releases(named, outcome.releases)
            if outcome.own is not None and key in self._pending_ids:   # a repeated entry: same answer
                self._unpend(named, wkey, key)
                out.append(self._reply_release(key, outcome.own))
            return out
        if op in (P.ACQUIRE, P.THROTTLE):
            assert isinstance(obj, (SemaphoreBarrierMachine, ThrottledRelease))
            wkey2 = (label,)
            named.pending.setdefault(wkey2, []).append(key)
            self._pending_ids[key] = name
            try:
                aout = obj.enter(label, src, now)
            except BaseException:
                self._unpend(named, wkey2, key)
                raise
            out = self._answer_admissions(named, aout.admissions)
            if aout.own is not None and key in self._pending_ids:
                self._unpend(named, wkey2, key)
                out.append(self._reply_admission(key, aout.own))
            return out
        # release (semaphore) or complete (throttle): acknowledged at once
        if op == P.RELEASE:
            assert isinstance(obj, SemaphoreBarrierMachine)
            admissions = obj.release(label, now)
            if (label,) in named.pending and label not in obj.waiting:   # withdrawn from the queue
                for req in named.pending.pop((label,)):
                    self._pending_ids.pop(req, None)
                    reply = P.error_reply(req[1], name, BarrierError(f"{label!r} released before admission"))
                    self._remember(req, reply)
            out = self._answer_admissions(named, admissions)
        else:
            assert isinstance(obj, ThrottledRelease)
            obj.complete(label, now)
            out = []
        ack = {"op": P.ACK, "id": key[1]}
        self._remember(key, ack)
        out.append((src, ack))
        return out

    def _lookup(self, op: str, name: str, spec_dict: Any) -> _Named:
        kind = _KIND_OF_OP[op]
        named = self._objects.get(name)
        if named is None:
            if spec_dict is None:
                raise BarrierError(f"{op}: {kind} {name!r} does not exist (nobody entered it yet)")
            spec = spec_from_dict(spec_dict)
            if spec.to_dict()["kind"] != kind:
                raise BarrierMismatchError(f"{op} needs a {kind}, but the spec describes a "
                                           f"{spec.to_dict()['kind']}")
            named = _Named(spec, self._create(name, spec))
            self._objects[name] = named
            log.info("barrier service: created %s %r with %s", kind, name, named.spec)
            return named
        have = named.spec.to_dict()["kind"]
        if have != kind:
            raise BarrierMismatchError(f"{op}: {name!r} is a {have}, not a {kind}")
        if spec_dict is not None:
            spec = spec_from_dict(spec_dict)
            if spec != named.spec:
                raise BarrierMismatchError(f"{kind} {name!r} was created with {named.spec}, "
                                           f"but this participant asks for {spec}")
        return named

    def _create(self, name: str, spec: AnySpec) -> PartialBarrierMachine | SemaphoreBarrierMachine | ThrottledRelease:
        if isinstance(spec, BarrierSpec):
            cb, cbt = self._enter_cbs.get(name, (None, None))
            return PartialBarrierMachine.from_spec(name, spec, cb, cbt, history=self.history)
        policy = self._policies.get(name)
        if policy is None and spec.adaptive_window is not None:
            policy = AdaptiveConcurrency(spec.adaptive_window)
        if isinstance(spec, SemaphoreSpec):
            return SemaphoreBarrierMachine(name, spec.n, spec.hold_timeout, self._release_cbs.get(name), policy=policy,
                                    max_concurrency=spec.max_concurrency)
        assert isinstance(spec, ThrottleSpec)
        return ThrottledRelease(name, spec.period, spec.count, spec.percent, spec.max, policy=policy)

    # ------------------------------------------------------------------ replies
    def _answer_releases(self, named: _Named, releases: Any) -> list[Reply]:
        out = []
        for rel in releases:
            for req in named.pending.pop((rel.round, rel.label, rel.rank), []):
                self._pending_ids.pop(req, None)
                out.append(self._reply_release(req, rel))
        return out

    def _answer_admissions(self, named: _Named, admissions: Any) -> list[Reply]:
        out = []
        for adm in admissions:
            for req in named.pending.pop((adm.label,), []):
                self._pending_ids.pop(req, None)
                out.append(self._reply_admission(req, adm))
        return out

    def _reply_release(self, req: ReqId, rel: BarrierRelease) -> Reply:
        reply = {"op": P.RELEASED, "id": req[1], "release": rel.to_dict()}
        self._remember(req, reply)
        return (req[0], reply)

    def _reply_admission(self, req: ReqId, adm: Admission) -> Reply:
        reply = {"op": P.ADMITTED, "id": req[1], "admission": adm.to_dict()}
        self._remember(req, reply)
        return (req[0], reply)

    def _unpend(self, named: _Named, wkey: tuple, req: ReqId) -> None:
        self._pending_ids.pop(req, None)
        reqs = named.pending.get(wkey)
        if reqs and req in reqs:
            reqs.remove(req)
            if not reqs:
                del named.pending[wkey]

    def _remember(self, req: ReqId, reply: dict[str, Any]) -> None:
        self._answered[req] = reply
        while len(self._answered) > self._answered_cache:
            self._answered.popitem(last=False)
