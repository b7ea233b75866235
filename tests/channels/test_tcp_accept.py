"""Listening ports under a flood: a bounded number of handshakes (threads) at once, a listener that
rests after ``accept`` fails (EMFILE at the descriptor limit) instead of spinning on it, log lines
rate-limited, and a worker's data port bound to the interface the master sees, not 0.0.0.0.

The worker's channel and the bootstrap master are both checked; the whole-job version (3,000 held
connections under ``ulimit -n 1024`` while a job runs) is tests/attack/test_attack_connections.py.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time

from channels import tcp
from channels.tcp import TCPChannel, _Peer
from twisternet import bootstrap
from twisternet.bootstrap import Master
from twisternet.config import Config

TOKEN = b"9f2c41d7e8b05a3364c1fd0e72ab8c55"


class _Recorder:
    def on_message(self, peer, edge, data, release):
        release()

    def on_credit(self, peer, edge):
        pass

    def on_sent(self, token):
        pass

    def on_peer_lost(self, peer, reason):
        pass


class FailingListener(socket.socket):
    """A listening socket whose accept fails as it does at the descriptor limit; counts the calls."""

    calls = 0

    def accept(self):  # type: ignore[override]
        type(self).calls += 1
        raise OSError(errno.EMFILE, "Too many open files")


def _channel_with(listener: socket.socket, **cfg) -> tuple[TCPChannel, socket.socket]:
    a, b = socket.socketpair()
    config = Config(heartbeat_interval=30.0, peer_timeout=60.0, **cfg)
    ch = TCPChannel(0, 2, config, {1: _Peer(1, a, "unix")}, [listener], TOKEN)
    ch.start(_Recorder())
    return ch, b


def _threads(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


def test_held_connections_to_a_data_port_hold_a_bounded_number_of_threads():
    ls = socket.create_server(("127.0.0.1", 0), backlog=512)
    ch, other = _channel_with(ls, handshake_timeout=60.0)
    clients = []
    try:
        before = _threads("twisternet-vet-0")
        for _ in range(300):
            clients.append(socket.create_connection(ls.getsockname(), timeout=10))
        deadline = time.monotonic() + 60
        # until every connection was taken: handed to a handshake or closed unread
        while _threads("twisternet-vet-0") - before + ch.dropped_connections < 300:
            assert time.monotonic() < deadline, (_threads("twisternet-vet-0"), ch.dropped_connections)
            ch.progress(0.01)
        assert _threads("twisternet-vet-0") - before <= tcp.MAX_PENDING_HANDSHAKES
        assert ch.dropped_connections >= 300 - tcp.MAX_PENDING_HANDSHAKES
    finally:
        for c in clients:
            c.close()
        ch.close(1.0)
        other.close()


def test_a_failing_accept_rests_instead_of_spinning_and_logs_a_few_lines(caplog):
    FailingListener.calls = 0
    ls = FailingListener(socket.AF_INET, socket.SOCK_STREAM)
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)
    client = socket.create_connection(ls.getsockname(), timeout=10)   # keeps the listener readable
    ch, other = _channel_with(ls)
    try:
        with caplog.at_level(logging.WARNING, logger="channels.tcp"):
            end = time.monotonic() + 1.5
            rounds = 0
            while time.monotonic() < end:
                ch.progress(0.05)
                rounds += 1
        lines = [r for r in caplog.records if "accept failed" in r.getMessage()]
        # backoff 0.05, 0.1, 0.2, 0.4, 0.8 s: about 5 tries in 1.5 s (old code: one per round)
        assert 1 <= FailingListener.calls <= 10, (FailingListener.calls, rounds)
        assert 1 <= len(lines) <= 6, len(lines)
    finally:
        client.close()
        ch.close(1.0)
        other.close()


def test_the_master_rests_after_a_failing_accept_and_caps_its_handshakes(caplog):
    FailingListener.calls = 0
    m = Master(1, TOKEN, "127.0.0.1", 0)
    real = m._admission.listener
    fake = FailingListener(socket.AF_INET, socket.SOCK_STREAM)
    fake.bind(("127.0.0.1", 0))
    fake.listen(16)
    fake.setblocking(False)
    m._admission.listener = fake
    client = socket.create_connection(fake.getsockname(), timeout=10)
    try:
        with caplog.at_level(logging.WARNING, logger="twisternet.bootstrap"):
            m.start()
            time.sleep(1.5)   # a measuring window: how often accept is tried in it
            calls = FailingListener.calls
        lines = [r for r in caplog.records if "accept failed" in r.getMessage()]
        assert 1 <= calls <= 10, calls
        assert 1 <= len(lines) <= 6, len(lines)
    finally:
        client.close()
        m.stop()
        real.close()


def test_the_master_runs_a_bounded_number_of_handshakes_at_once():
    m = Master(2, TOKEN, "127.0.0.1", 0, handshake_timeout=60.0).start()
    clients = []
    try:
        before = _threads("twisternet-master-handshake")
        for _ in range(200):
            clients.append(socket.create_connection(m.address, timeout=10))
        deadline = time.monotonic() + 60
        while _threads("twisternet-master-handshake") - before + m.dropped_connections < 200:
            assert time.monotonic() < deadline, (_threads("twisternet-master-handshake"),
                                                 m.dropped_connections)
            time.sleep(0.02)
        assert _threads("twisternet-master-handshake") - before <= bootstrap.MAX_PENDING_HANDSHAKES
    finally:
        for c in clients:
            c.close()
        m.stop()


def test_a_worker_binds_its_data_port_to_the_interface_the_master_sees():
    m = Master(1, TOKEN, "127.0.0.1", 0).start()
    try:
        config = Config(master=f"127.0.0.1:{m.address[1]}", token=TOKEN.decode(), world=1,
                        connect_timeout=30.0)
        ch = tcp.create_channel(config)
        try:
            tcp_listener = next(ls for ls in ch._listeners if ls.family == socket.AF_INET)
            assert tcp_listener.getsockname()[0] == "127.0.0.1"
        finally:
            ch.start(_Recorder())
            ch.close(1.0)
    finally:
        m.stop()


def test_bind_host_still_chooses_the_interface():
    m = Master(1, TOKEN, "127.0.0.1", 0).start()
    try:
        config = Config(master=f"127.0.0.1:{m.address[1]}", token=TOKEN.decode(), world=1,
                        bind_host="0.0.0.0", connect_timeout=30.0)
        ch = tcp.create_channel(config)
        try:
            tcp_listener = next(ls for ls in ch._listeners if ls.family == socket.AF_INET)
            assert tcp_listener.getsockname()[0] == "0.0.0.0"
        finally:
            ch.start(_Recorder())
            ch.close(1.0)
    finally:
        m.stop()


def test_log_throttle_keeps_a_burst_per_period_and_counts_the_rest(monkeypatch, caplog):
    from twisternet import logthrottle
    now = [100.0]
    monkeypatch.setattr(logthrottle.time, "monotonic", lambda: now[0])
    throttle = logthrottle.LogThrottle(logging.getLogger("test.throttle"), period=10.0, burst=3)
    with caplog.at_level(logging.WARNING, logger="test.throttle"):
        logged = [throttle.warning("k", "event %d", i) for i in range(10)]
        assert throttle.warning("other", "another kind")          # kinds are counted apart
        now[0] += 10.0
        assert throttle.warning("k", "event %d", 10)
    assert logged == [True] * 3 + [False] * 7 and throttle.suppressed == 7
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["event 0", "event 1", "event 2", "another kind",
                        "(7 more like the next one in the last 10s were not logged)", "event 10"]
