"""The small-message fast path: the sending thread writes to an idle link itself, owed credit rides with
data, releases by a running thread wake nobody, and the busy-poll window follows ``busy_poll_us``."""

from __future__ import annotations

import select
import socket

import pytest

from channels import tcp
from channels.tcp import CreditLedger, TCPChannel, _Peer
from twisternet.config import Config, busy_poll_seconds
from twisternet.errors import ConfigError


class _Recorder:
    def __init__(self) -> None:
        self.messages: list[tuple[int, int, bytes]] = []
        self.releases: list = []
        self.sent: list[object] = []
        self.lost: list[tuple[int, str]] = []

    def on_message(self, peer, edge, data, release):
        self.messages.append((peer, edge, bytes(data)))
        self.releases.append(release)

    def on_credit(self, peer, edge):
        pass

    def on_sent(self, token):
        self.sent.append(token)

    def on_peer_lost(self, peer, reason):
        self.lost.append((peer, reason))


def _pair():
    a, b = socket.socketpair()
    cfg = Config(buffer_size=64 << 10, buffer_count=4, heartbeat_interval=30.0, peer_timeout=60.0)
    ch0 = TCPChannel(0, 2, cfg, {1: _Peer(1, a, "unix")}, [], b"t" * 16)
    ch1 = TCPChannel(1, 2, cfg, {0: _Peer(0, b, "unix")}, [], b"t" * 16)
    h0, h1 = _Recorder(), _Recorder()
    ch0.start(h0)
    ch1.start(h1)
    return ch0, ch1, h0, h1, a, b


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def test_small_send_on_idle_link_is_written_by_the_sender() -> None:
    """Old code queued the frame until the next progress round: nothing reached the socket in send()."""
    ch0, ch1, h0, h1, a, b = _pair()
    try:
        token = object()
        assert ch0.send(1, 7, [b"x" * 1000], token)
        assert _readable(b), "send() on an idle link should write the frame at once"
        assert h0.sent == [token] and not ch0.has_pending()
        ch1.progress(0.5)
        assert h1.messages == [(0, 7, b"x" * 1000)]
    finally:
        ch0.abort("test over")
        ch1.abort("test over")


def test_owed_credit_rides_with_the_next_message() -> None:
    """Old code returned credit in a CREDIT frame of its own, only after CREDIT_DELAY; now a message to
    the peer that is owed credit carries it in front, at once."""
    ch0, ch1, h0, h1, a, b = _pair()
    try:
        assert ch0.send(1, 3, [b"y" * 500])
        ch1.progress(0.5)
        assert ch0._inflight[(1, 3)] == 500
        h1.releases.pop()()                      # the core is done with it: 500 bytes owed to rank 0
        assert ch1.send(0, 9, [b"reply"])        # at once, well before CREDIT_DELAY
        ch0.progress(0.5)
        assert h0.messages == [(1, 9, b"reply")]
        assert ch0._inflight[(1, 3)] == 0, "the credit should have come back with the reply"
        assert not ch1._ledger.owes
    finally:
        ch0.abort("test over")
        ch1.abort("test over")


def test_release_wakes_only_a_sleeping_poller() -> None:
    """Old code rang the channel's waker on every release, even from the thread running the round
    (a write and a spurious wake-up of the progress thread per message)."""
    wakes: list[int] = []
    ledger = CreditLedger(1 << 20, lambda: wakes.append(1))
    ledger.releaser(1, 0, 100)()
    assert wakes == [] and ledger.owes
    ledger.sleeping(1.0)
    try:
        ledger.releaser(1, 0, 100)()
    finally:
        ledger.awake()
    assert wakes == [1]
    assert ledger.take_owed(1) == [(0, 200)] and not ledger.owes


def test_owed_credit_shortens_a_sleep() -> None:
    ledger = CreditLedger(1 << 20, lambda: None)
    ledger.releaser(1, 0, 100)()
    try:
        assert ledger.sleeping(5.0) <= tcp.credit.CREDIT_DELAY
    finally:
        ledger.awake()


def test_busy_poll_rule() -> None:
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cfg = Config(spin_time=0.0003)
    assert busy_poll_seconds(cfg, cores, load=0.0) == pytest.approx(0.0003)   # fits the cores: poll
    assert busy_poll_seconds(cfg, cores + 1, load=0.0) == 0.0                  # oversubscribed: sleep
    assert busy_poll_seconds(cfg, 1, load=cores + 5.0) == 0.0                  # busy machine: sleep
    assert busy_poll_seconds(Config(busy_poll_us=50), cores + 1) == pytest.approx(50e-6)
    assert busy_poll_seconds(Config(busy_poll_us=0), 1) == 0.0
    with pytest.raises(ConfigError):
        Config(busy_poll_us=-2)


def test_small_record_to_an_idle_stream_goes_at_once_unbatched() -> None:
    """Nagle's rule in the core: with nothing of the stream unacknowledged (Channel.idle) a small record
    is its own message at once; old code packed it and held it for ``flush_delay`` (here 1 s). While it
    is unacknowledged, the next record is batched as before."""
    import threading

    from channels.local import LocalChannel, LocalHub
    from twisternet.config import load_config
    from twisternet.context import Context
    from twisternet.context.streams import _BATCH, _DIRECT

    class Recording(LocalChannel):
        idle_now = True

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.kinds: list[bytes] = []

        def idle(self, peer, edge):
            return self.idle_now

        def send(self, peer, edge, parts, token=None):
            if edge == 5:
                self.kinds.append(bytes(memoryview(parts[0])[:1]))
            return super().send(peer, edge, parts, token)

    cfg = load_config(env={}, channel="local", flush_delay=1.0, timeout=30.0)
    hub = LocalHub(2)
    chans = [Recording(hub, r, cfg) for r in range(2)]
    got: list[object] = []
    arrived = threading.Event()
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            with Context(chans[rank], cfg) as ctx:
                if rank == 1:
                    ctx.register(5, lambda src, obj: (got.append(obj), arrived.set()) and True)
                    ctx.wait_until(lambda: len(got) == 3)
                else:
                    ctx.send(1, 5, b"first")
                    deadline = 20.0
                    assert arrived.wait(deadline) and chans[0].kinds == [_DIRECT]
                    chans[0].idle_now = False
                    ctx.send(1, 5, b"second")
                    ctx.send(1, 5, b"third")
                    ctx.flush()
                    ctx.wait_until(lambda: len(chans[0].kinds) == 2)
                    assert chans[0].kinds == [_DIRECT, _BATCH]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            hub.fail(rank, repr(e))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got == [b"first", b"second", b"third"]
