"""In-process channel: the ranks of a job are threads of one process, joined by a :class:`LocalHub`.

It implements the full channel contract (credit per (peer, edge), release-driven back pressure,
ordered delivery, clean leave vs. loss), so operations tested on it behave as on TCP or MPI. It copies
each message once (sender's buffers to a receiver-owned bytes object), as a real transport would.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from twisternet.channel import Buffer, Channel, ChannelHandler, fits_credit
from twisternet.config import Config


class LocalHub:
    """Connects the LocalChannels of one in-process job."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.channels: list[LocalChannel | None] = [None] * world
        self.lock = threading.Lock()

    def attach(self, ch: LocalChannel) -> None:
        with self.lock:
            if self.channels[ch.rank] is not None:
                raise ValueError(f"rank {ch.rank} already attached to this hub")
            self.channels[ch.rank] = ch

    def fail(self, rank: int, reason: str) -> None:
        """Declare ``rank`` dead (e.g. its thread raised): every other rank sees it as lost."""
        with self.lock:
            chans = [c for c in self.channels if c is not None and c.rank != rank]
            me = self.channels[rank]
            if me is not None:
                me._dead = True
        for c in chans:
            c._post(("lost", rank, reason))


class LocalChannel(Channel):
    """One rank's end of a :class:`LocalHub`."""

    name = "local"
    spans_processes = False   # the ranks are threads of one process

    def __init__(self, hub: LocalHub, rank: int, config: Config) -> None:
        super().__init__(rank, hub.world, config)
        self.hub = hub
        self.credit = config.buffer_size * config.buffer_count
        self._inflight: dict[tuple[int, int], int] = {}
        self._inbox: deque[tuple] = deque()
        self._event = threading.Event()
        self._handler: ChannelHandler | None = None
        self._left: set[int] = set()
        self._lost: set[int] = set()
        self._dead = False
        hub.attach(self)

    # -- called by peers (any thread) -----------------------------------------------------------
    def _post(self, item: tuple) -> None:
        self._inbox.append(item)
        self._event.set()

    def start(self, handler: ChannelHandler) -> None:
        self._handler = handler

    def send(self, peer: int, edge: int, parts: Sequence[Buffer], token: object = None) -> bool:
        if peer == self.rank or not 0 <= peer < self.world:
            raise ValueError(f"bad peer {peer} for rank {self.rank} of {self.world}")
        if peer in self._lost or peer in self._left:
            # The message can never arrive: report like a broken connection would.
            self._post(("lost", peer, "send to a rank that is gone"))
            return True
        n = sum(memoryview(p).nbytes for p in parts)
        key = (peer, edge)
        inflight = self._inflight.get(key, 0)
        if not fits_credit(inflight, n, self.credit):
            return False
        self._inflight[key] = inflight + n
        data = b"".join(parts)
        target = self.hub.channels[peer]
        if target is None or target._dead:
            self._post(("lost", peer, "peer not attached"))
            return True
        target._post(("msg", self.rank, edge, data, n))
        if token is not None:
            self._post(("sent", token))
        return True

    def _returner(self, src: int, edge: int, n: int) -> Callable[[], None]:
        done = False

        def release() -> None:
            nonlocal done
            if done:
                return
            done = True
            sender = self.hub.channels[src]
            if sender is not None:
                sender._post(("credit", self.rank, edge, n))
        return release

    def progress(self, timeout: float = 0.0) -> bool:
        if not self._inbox and timeout > 0:
            self._event.wait(timeout)
        self._event.clear()
        did = False
        h = self._handler
        while self._inbox:
            item = self._inbox.popleft()
            did = True
            kind = item[0]
            if kind == "msg":
                _, src, edge, data, n = item
                if h is not None:
                    h.on_message(src, edge, memoryview(data), self._returner(src, edge, n))
            elif kind == "credit":
                _, peer, edge, n = item
                key = (peer, edge)
                self._inflight[key] = max(0, self._inflight.get(key, 0) - n)
                if h is not None:
                    h.on_credit(peer, edge)
            elif kind == "sent":
                if h is not None:
                    h.on_sent(item[1])
            elif kind == "bye":
                self._left.add(item[1])
            elif kind == "lost":
                peer, reason = item[1], item[2]
                if peer not in self._lost and peer not in self._left:
                    self._lost.add(peer)
                    if h is not None:
                        h.on_peer_lost(peer, reason)
        return did

    def wakeup(self) -> None:
        self._event.set()

    def has_pending(self, peer: int | None = None) -> bool:
        return False  # sends are handed over at once

    def pending_bytes(self, peer: int) -> int:
        return 0  # send() hands each message to the peer's inbox at once: nothing is held here

    def close(self, timeout: float) -> None:
        import time
        for c in self.hub.channels:
            if c is not None and c.rank != self.rank:
                c._post(("bye", self.rank))
        deadline = time.monotonic() + timeout
        others = {r for r in range(self.world) if r != self.rank}
        while not others <= (self._left | self._lost) and time.monotonic() < deadline:
            self.progress(0.01)


    def abort(self, reason: str) -> None:
        self.hub.fail(self.rank, reason)


def create_channel(config: Config, *, hub: LocalHub | None = None, rank: int = 0) -> LocalChannel:
    """A local channel; without a hub, a one-rank job (what ``tn.init()`` gives outside any launcher)."""
    return LocalChannel(hub or LocalHub(1), rank, config)
