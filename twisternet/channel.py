"""The interface every transport implements, and the registry the core picks one from by name.

A channel moves *messages* (a sequence of buffers, concatenated on the wire) between ranks, each tagged
with an *edge* (the id of the operation it belongs to). Per (peer, edge) it enforces credit-based flow
control: the receiver grants ``buffer_size * buffer_count`` bytes of credit; a message may be sent while
the bytes in flight plus its own size fit the credit and a sixteenth (:func:`fits_credit`), and a
message larger than that may travel when nothing else is in flight on that (peer, edge). Credit comes
back when the receiving side calls the ``release`` function it was handed with the message, so a
consumer that stops consuming stops its senders (back pressure) and memory stays bounded.

Threading contract (what the core guarantees, so channels need no locks of their own):

* ``start``, ``send``, ``progress``, ``push``, ``end_push``, ``has_pending`` and ``close`` are called
  by one thread at a time (the Context serialises them): the progress thread, a thread blocked in a
  Context wait that drives progress itself meanwhile, a thread writing its own large message, or in
  manual mode the thread running ``Context.progress``.
* ``wait`` and ``wait_writable`` are called without that serialisation, concurrently with the others.
* ``wakeup`` and the ``release`` functions handed out with messages may be called from any thread.
* handler callbacks run on the thread that called ``progress``.

Messages between one ordered pair of ranks on one edge are delivered in the order they were sent.
Edge ids are non-negative 31-bit integers (< 2**31); edges >= CONTROL_EDGE_BASE are reserved for the core.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol
from collections.abc import Callable, Sequence

if TYPE_CHECKING:
    from .bootstrap.session import MasterSession
    from .config import Config

Buffer = bytes | bytearray | memoryview
#: Largest edge id, exclusive. Edges from CONTROL_EDGE_BASE up are reserved for core services.
MAX_EDGE = 1 << 31
CONTROL_EDGE_BASE = MAX_EDGE - 1024


def fits_credit(inflight: int, size: int, credit: int) -> bool:
    """The flow-control rule of every channel, per (peer, edge): may a message of ``size`` bytes go now,
    with ``inflight`` bytes sent and not yet released? Yes if nothing is in flight, or if the total
    stays within the credit plus a sixteenth of it. The sixteenth absorbs framing: an array of exactly
    half the credit (16 MB with the defaults) travels with a codec head of a few dozen bytes, and
    without the slack only one such message could be in flight, so the connection idled while each
    one's credit came back (TCP p2p at 16 MB: 12-17% slower)."""
    return not inflight or inflight + size <= credit + (credit >> 4)


class ChannelHandler(Protocol):
    """What a channel reports to the core."""

    def on_message(self, peer: int, edge: int, data: memoryview, release: Callable[[], None]) -> None:
        """A whole message arrived. ``data`` is handed over: the channel never reuses its memory, so
        the core may keep views of it. ``release`` (call exactly once) returns the credit."""

    def on_credit(self, peer: int, edge: int) -> None:
        """Credit for (peer, edge) came back: a send that returned False may now succeed."""

    def on_sent(self, token: object) -> None:
        """A message sent with a non-None ``token`` left this process: its buffers may be reused."""

    def on_peer_lost(self, peer: int, reason: str) -> None:
        """``peer`` died or became unreachable (connection reset, heartbeat silence, MPI error)."""


class Channel(ABC):
    """A transport between the ``world`` ranks of a job; this process is ``rank``."""

    #: Short name used in the registry and in logs ("tcp", "mpi", "local").
    name: str = ""

    #: The link to the job's coordinator, the bootstrap master (TCP): it hosts the services and its
    #: table says where every rank runs. None when the job has none (MPI, local): then rank 0 hosts the
    #: services over the channel itself (twisternet.services) and ranks exchange their hosts.
    session: MasterSession | None = None

    def __init__(self, rank: int, world: int, config: Config) -> None:
        self.rank = rank
        self.world = world
        self.config = config

    @abstractmethod
    def start(self, handler: ChannelHandler) -> None:
        """Begin delivering to ``handler``. Called once, before any other method but ``wakeup``."""

    @abstractmethod
    def send(self, peer: int, edge: int, parts: Sequence[Buffer], token: object = None) -> bool:
        """Queue one message (the concatenation of ``parts``) for ``peer`` on ``edge``.

        Returns False, queuing nothing, when (peer, edge) lacks credit; the handler's ``on_credit``
        says when to retry. The channel keeps references to ``parts`` (no copy) until the message has
        left this process; if ``token`` is not None, ``on_sent(token)`` reports that moment. ``peer``
        is never this channel's own rank.
        """

    @abstractmethod
    def progress(self, timeout: float = 0.0) -> bool:
        """Move bytes: send what is queued, receive, deliver, return credit. Waits up to ``timeout``
        seconds for something to happen (``wakeup`` cuts the wait short). Returns True if it did work."""

    @abstractmethod
    def wakeup(self) -> None:
        """Interrupt a ``progress`` call that is waiting. Thread-safe, cheap, may be called often."""

    def flush_released(self) -> None:  # noqa: B027 - optional: channels that batch releases override it
        """Called by the core, holding the engine, right after handlers ran: hand back what they
        released (credit, receive buffers) now rather than at the next ``progress`` call, so a
        sender waiting for it hears sooner. Optional; the default does nothing."""

    #: True if :meth:`wait` may run in one thread while another calls ``progress(0)`` (then the
    #: core's progress thread waits without holding the engine, and any thread can move bytes at once).
    can_wait_unlocked: bool = False

    def wait(self, timeout: float) -> None:
        """Block until there may be work for ``progress`` (data, room to write, a ``wakeup``) or for
        ``timeout`` seconds; moves no bytes. Only called if :attr:`can_wait_unlocked`."""
        raise NotImplementedError(f"{type(self).__name__} cannot wait outside progress()")

    #: True if ``progress``, ``send`` and ``flush_released`` may be called from several threads at once
    #: (the channel serialises them itself, and a waiting ``progress(timeout)`` lets another thread's
    #: ``progress(0)`` or ``send`` in between its polls): a waiting caller can then drive the channel
    #: without taking the core's engine from the progress thread. Handler callbacks run on whichever
    #: thread polled. The default (False) keeps the contract above: one thread at a time.
    thread_safe_progress: bool = False

    #: True if a thread may write its own messages with :meth:`push`, :meth:`wait_writable` and
    #: :meth:`end_push` (the core lets a thread that sends a large message and waits for it move the
    #: bytes itself, with no hand-off to the progress thread). Only used with a progress thread.
    can_push: bool = False

    def push(self, peer: int) -> bool:
        """Write what is queued for ``peer`` now, without waiting or reading; True once nothing is left.
        While something is left the caller, not the progress engine, waits for room to write more
        (:meth:`wait_writable`, then ``push`` again) until it calls :meth:`end_push`."""
        raise NotImplementedError(f"{type(self).__name__} cannot push")

    def end_push(self, peer: int) -> None:
        """The pushing thread stops: the engine writes whatever is still queued for ``peer``."""
        raise NotImplementedError(f"{type(self).__name__} cannot push")

    def wait_writable(self, peer: int, timeout: float) -> None:
        """Block, holding nothing (call it without the engine), until ``peer``'s connection may take
        more bytes or ``timeout`` seconds pass. Moves no bytes."""
        raise NotImplementedError(f"{type(self).__name__} cannot push")

    @abstractmethod
    def has_pending(self, peer: int | None = None) -> bool:
        """Whether messages for ``peer`` (or any peer) are queued but not yet fully sent."""

    def pending_bytes(self, peer: int) -> int:
        """Bytes handed to :meth:`send` for ``peer`` and not yet gone from this process (queued or being
        written). The coflow scheduler keeps this under ``coflow_inflight`` so the backlog stays in its
        own priority-ordered queues, where a more urgent coflow can overtake it. Every channel that
        queues sends must override this; the default (0: nothing held) suits only a channel that hands
        each message over inside ``send``, and with it the in-flight cap never holds a send back."""
        return 0

    def idle(self, peer: int, edge: int) -> bool:
        """Whether nothing sent to ``peer`` on ``edge`` is still queued here or unacknowledged (its credit
        not back): then the core sends a small record at once as its own message instead of batching it
        with later ones (as Nagle's rule does for TCP segments). Called without the engine, so it is a
        hint. The default (False) always batches."""
        return False

    #: True if :meth:`send_small` may write a small message at once (the core's fast path).
    can_send_small: bool = False

    def send_small(self, peer: int, edge: int, parts: Sequence[Buffer], nbytes: int) -> bool:
        """Send one small message (the concatenation of ``parts``, ``nbytes`` in all) to ``peer`` on
        ``edge`` at once, without a token: the channel copies ``parts`` and keeps no reference to them.
        Only if nothing for ``peer`` is queued here and nothing on (peer, edge) is unacknowledged (see
        :meth:`idle`); otherwise returns False and does nothing (the core then queues it and uses
        :meth:`send`). Called holding the engine, like :meth:`send`. The default returns False."""
        return False

    #: Whether the ranks of a job are separate processes (False for the in-process local channel, whose
    #: ranks are threads sharing one address space): e.g. shared-memory segments between ranks only pay
    #: off, and only work as intended, when this is True.
    spans_processes: bool = True

    def route_services(self, route: Callable[[str, dict[str, Any]], None]) -> None:
        """Hand the coordinator's service messages to ``route(service_name, message)``, on the thread
        that drives progress. Only for a channel with a :attr:`session`, which must override it."""
        raise NotImplementedError(f"{type(self).__name__} has no coordinator session")

    @abstractmethod
    def close(self, timeout: float) -> None:
        """Flush queued messages (up to ``timeout`` seconds), tell peers this rank leaves cleanly,
        wait for theirs, and release every resource. A peer that leaves cleanly is not reported lost."""

    def abort(self, reason: str) -> None:
        """Leave at once *without* the clean goodbye, so peers report this rank as lost (used when the
        program fails). Channels should override this; the default falls back to a short close."""
        self.close(0.0)


ChannelFactory = Callable[..., Channel]
_REGISTRY: dict[str, str | ChannelFactory] = {
    # name -> factory, or "module:attribute" imported on first use (so the core imports no transport).
    "tcp": "channels.tcp:create_channel",
    "mpi": "channels.mpi:create_channel",
    "local": "channels.local:create_channel",
}


def register_channel(name: str, factory: str | ChannelFactory) -> None:
    """Make a transport available to ``tn.init(channel=name)``.

    ``factory`` is a callable or a ``"module:attribute"`` string. It is called as
    ``factory(config=..., **launch_info)`` and returns a started-ready Channel (see each channel).
    """
    _REGISTRY[name] = factory


def channel_factory(name: str) -> ChannelFactory:
    """The factory registered under ``name``, importing it if it was registered by path."""
    try:
        entry = _REGISTRY[name]
    except KeyError:
        from .errors import ConfigError
        raise ConfigError("channel", f"no channel named {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    if isinstance(entry, str):
        import importlib
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
        _REGISTRY[name] = entry
    return entry
