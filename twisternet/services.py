"""Coordinator services: job-wide state machines (the barrier manager, the coflow coordinator) that run
in one place and talk to every rank by messages.

Under the TCP channel the bootstrap master hosts them (see :func:`install_on_master`); under MPI and
the local channel rank 0 hosts them, reached over two reserved control edges. Both run the same
:class:`ServiceHost` (one instance per service name), so a job sees the same services either way. Either way a rank uses
``ctx.services.send(name, msg)`` and ``ctx.services.subscribe(name, callback)``; messages are
msgpack-able dicts. A service object implements::

    handle(src_rank: int, msg: dict, now: float) -> list[tuple[int, dict]]   # replies, by rank
    tick(now: float) -> list[tuple[int, dict]]                               # timer-driven replies
    next_deadline() -> float | None                                         # when tick must run

with ``now`` from ``time.monotonic()`` of the hosting process. Services are created on first use.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any
from collections.abc import Callable

from .channel import CONTROL_EDGE_BASE
from .errors import TwisternetError

if TYPE_CHECKING:
    from .context import Context

log = logging.getLogger(__name__)

REQUEST_EDGE = CONTROL_EDGE_BASE + 1
REPLY_EDGE = CONTROL_EDGE_BASE + 2

_FACTORIES: dict[str, str | Callable[[], Any]] = {
    "barrier": "collectives.barrier.service:BarrierService",
    "coflow": "twisternet.coflow.coordinator:CoflowCoordinator",
}


def register_service(name: str, factory: str | Callable[[], Any]) -> None:
    """Make a coordinator service available by name (a callable or ``"module:attribute"``)."""
    _FACTORIES[name] = factory


def create_service(name: str) -> Any:
    """A new instance of the service registered as ``name``."""
    try:
        f = _FACTORIES[name]
    except KeyError:
        raise TwisternetError(f"no coordinator service named {name!r}; known: {sorted(_FACTORIES)}") from None
    if isinstance(f, str):
        mod, _, attr = f.partition(":")
        f = getattr(importlib.import_module(mod), attr)
        _FACTORIES[name] = f
    return f()


class ServiceHost:
    """The job's coordinator services in the one process that hosts them (the bootstrap master under TCP,
    rank 0 under MPI and the local channel): one instance per service name, created on first use,
    called one at a time. It reads the clock but starts no thread and sends nothing: the transport
    delivers requests to :meth:`handle`, runs :meth:`tick` when :meth:`next_deadline` has come, and
    sends the ``(rank, msg)`` replies both return."""

    def __init__(self) -> None:
        self._services: dict[str, Any] = {}
        self._lock = threading.RLock()

    def service(self, name: str) -> Any:
        """The instance of service ``name`` (created now if this is its first use)."""
        with self._lock:
            svc = self._services.get(name)
            if svc is None:
                svc = self._services[name] = create_service(name)
            return svc

    def names(self) -> list[str]:
        """The services created so far."""
        with self._lock:
            return list(self._services)

    def handle(self, src: int, name: str, msg: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
        """Feed rank ``src``'s request to service ``name``; its replies, by rank."""
        with self._lock:
            return list(self.service(name).handle(src, msg, time.monotonic()) or ())

    def next_deadline(self, name: str) -> float | None:
        """When service ``name`` wants :meth:`tick` (None: not created, or no timer)."""
        with self._lock:
            svc = self._services.get(name)
            return None if svc is None else svc.next_deadline()

    def tick(self, name: str) -> list[tuple[int, dict[str, Any]]]:
        """Run service ``name``'s timers; its replies, by rank."""
        with self._lock:
            svc = self._services.get(name)
            return [] if svc is None else list(svc.tick(time.monotonic()) or ())

    def peer_lost(self, rank: int) -> list[tuple[str, int, dict[str, Any]]]:
        """Tell every service that wants to know (``peer_lost(rank, now)``) that ``rank`` is gone;
        their replies as ``(service, rank, msg)``."""
        out: list[tuple[str, int, dict[str, Any]]] = []
        with self._lock:
            for name, svc in self._services.items():
                hook = getattr(svc, "peer_lost", None)
                if hook is not None:
                    out.extend((name, r, m) for r, m in hook(rank, time.monotonic()) or ())
        return out


class _RankZeroHost:
    """A :class:`ServiceHost` on rank 0 (MPI, local channel): replies go out through ``deliver`` and a
    thread runs the timers."""

    def __init__(self, deliver: Callable[[int, str, dict[str, Any]], None]) -> None:
        self.host = ServiceHost()
        self._deliver = deliver
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    def handle(self, src: int, name: str, msg: dict[str, Any]) -> None:
        replies = self.host.handle(src, name, msg)
        with self._cond:
            self._cond.notify()
        self._send_all(name, replies)
        self._ensure_ticker()

    def peer_lost(self, rank: int) -> None:
        for name, r, m in self.host.peer_lost(rank):
            if r != rank:
                self._safe_deliver(name, r, m)

    def _send_all(self, name: str, replies: Any) -> None:
        for rank, reply in replies or ():
            self._deliver(rank, name, reply)

    def _safe_deliver(self, name: str, rank: int, msg: dict[str, Any]) -> None:
        try:
            self._deliver(rank, name, msg)
        except TwisternetError as e:
            log.warning("coordinator service %s: could not deliver to rank %d: %s", name, rank, e)

    def _ensure_ticker(self) -> None:
        with self._cond:
            if self._thread is not None or self._stop:
                return
            self._thread = threading.Thread(target=self._tick_loop, name="twisternet-services", daemon=True)
        self._thread.start()

    def _tick_loop(self) -> None:
        while True:
            with self._cond:
                if self._stop:
                    return
            now = time.monotonic()
            due: list[tuple[str, list[tuple[int, dict[str, Any]]]]] = []
            wait = 0.5
            for name in self.host.names():
                d = self.host.next_deadline(name)
                if d is not None and d <= now:
                    due.append((name, self.host.tick(name)))
                elif d is not None:
                    wait = min(wait, d - now)
            for name, replies in due:
                for rank, reply in replies:
                    self._safe_deliver(name, rank, reply)
            if not due:
                with self._cond:
                    if not self._stop:
                        self._cond.wait(max(wait, 0.001))

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()


def install_on_master(master: Any, names: list[str] | None = None) -> ServiceHost:
    """Host the named services (default: all registered) in a bootstrap ``Master``, through one
    :class:`ServiceHost` (the master's loop thread calls it; ranks it reports lost are passed on)."""
    host = ServiceHost()
    for name in names or list(_FACTORIES):
        master.add_service(name, functools.partial(_master_handle, host, name),
                           functools.partial(_master_tick, host, name),
                           functools.partial(host.next_deadline, name))
    if hasattr(master, "on_peer_lost"):
        master.on_peer_lost(lambda rank: [(n, r, {"payload": m}) for n, r, m in host.peer_lost(rank)])
    return host


def _master_handle(host: ServiceHost, name: str, src: int, msg: dict[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    payload = msg.get("payload")
    if not isinstance(payload, dict):
        return [(src, {"error": "service message without a payload"})]
    return [(r, {"payload": m}) for r, m in host.handle(src, name, payload)]


def _master_tick(host: ServiceHost, name: str) -> list[tuple[int, dict[str, Any]]]:
    return [(r, {"payload": m}) for r, m in host.tick(name)]


class ServiceLink:
    """A rank's link to the coordinator services of its job (``ctx.services``)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._subs: dict[str, Callable[[dict[str, Any]], None]] = {}
        self._session = ctx.channel.session
        self._host: _RankZeroHost | None = None
        self.cache: dict[str, Any] = {}   # per-context clients built on this link (e.g. the barrier client)
        if self._session is not None:
            ctx.channel.route_services(self._from_master)
        else:
            if ctx.rank == 0:
                self._host = _RankZeroHost(self._reply)
                ctx.register_control_handler(REQUEST_EDGE, self._on_request)
            ctx.register_control_handler(REPLY_EDGE, self._on_reply)

    @property
    def coordinator(self) -> str:
        """Where the services run: "master" or "rank 0"."""
        return "master" if self._session is not None else "rank 0"

    def local_service(self, name: str) -> Any | None:
        """The service object itself when it runs in this process (rank 0 under MPI/local), else None.
        Lets the hosting rank install Python callbacks, which cannot travel to another process."""
        if self._host is None:
            return None
        return self._host.host.service(name)

    def subscribe(self, name: str, callback: Callable[[dict[str, Any]], None]) -> None:
        """Deliver the replies of service ``name`` to ``callback`` (on the progress thread)."""
        self._subs[name] = callback

    def send(self, name: str, msg: dict[str, Any]) -> None:
        """Send ``msg`` to service ``name`` on the coordinator."""
        if self._session is not None:
            self._session.send({"service": name, "payload": msg})
        else:
            self.ctx.send(0, REQUEST_EDGE, (name, msg))

    # rank 0 side
    def _on_request(self, src: int, obj: Any) -> bool:
        name, msg = obj
        assert self._host is not None
        try:
            self._host.handle(src, name, msg)
        except TwisternetError as e:
            log.error("rank 0: service request %r from rank %d failed: %s", name, src, e)
        return True

    def _reply(self, rank: int, name: str, msg: dict[str, Any]) -> None:
        # also while this rank's close() lingers: the host's timer thread may fire for peers still waiting
        self.ctx.send_while_leaving(rank, REPLY_EDGE, (name, msg))

    # every rank
    def _on_reply(self, src: int, obj: Any) -> bool:
        name, msg = obj
        self._dispatch(name, msg)
        return True

    def _from_master(self, name: str, ev: dict[str, Any]) -> None:
        """A service message from the master (TCP): its reply's payload, or an error it logs."""
        if "error" in ev:
            log.error("rank %d: service %r on the master: %s", self.ctx.rank, name, ev["error"])
            return
        self._dispatch(name, ev.get("payload", {}))

    def _dispatch(self, name: str, msg: dict[str, Any]) -> None:
        cb = self._subs.get(name)
        if cb is None:
            log.warning("rank %d: reply from service %r that nobody here subscribed to", self.ctx.rank, name)
            return
        cb(msg)

    def close(self) -> None:
        if self._host is not None:
            self._host.stop()
