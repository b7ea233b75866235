"""Loss reports say where (twisternet.bootstrap and the TCP channel): the host and ranks of a lost or
failing peer, severed sessions, and unreachable ranks in the mesh."""

from __future__ import annotations

import socket
import time

import pytest

from tests.twisternet.bootstrap_harness import Events, join_all, start_master
from twisternet.errors import ClosedError, OperationTimeout

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------------- loss reports say where

def test_rank_places_name_the_host_and_its_ranks() -> None:
    from twisternet.bootstrap import rank_places
    a, b = ("hostA/boot/1", "10.0.0.1"), ("hostB/boot/2", "10.0.0.2")
    assert rank_places([a, b, a, b]) == [
        "rank 0 on hostA (10.0.0.1; ranks on that host: 0, 2)", "rank 1 on hostB (10.0.0.2; ranks on that host: 1, 3)",
        "rank 2 on hostA (10.0.0.1; ranks on that host: 0, 2)", "rank 3 on hostB (10.0.0.2; ranks on that host: 1, 3)"]
    assert rank_places([a] + [b] * 4)[1] == "rank 1 on hostB (10.0.0.2; ranks on that host: 1-4)"
    assert rank_places([a, a]) == ["rank 0 on hostA (10.0.0.1)", "rank 1 on hostA (10.0.0.1)"]  # one host


def test_master_reports_where_a_lost_rank_ran_and_why_it_gave_up() -> None:
    master, addr = start_master(3)
    sessions = join_all(addr, [0, 1, 2])
    logs = [Events(s) for s in sessions]
    sessions[1].abort("rank 1 failed: PeerLostError('rank 7 on hostZ')")
    for i in (0, 2):
        ev = logs[i].wait_for(lambda e: e["type"] == "peer_lost", timeout=5)
        assert ev == {"type": "peer_lost", "rank": 1,
                      "reason": "it gave up: rank 1 failed: PeerLostError('rank 7 on hostZ')",
                      "place": f"rank 1 on {socket.gethostname()} (127.0.0.1)"}, ev
    sessions[0].close(), sessions[2].close()
    assert master.wait(10) == 1


def test_a_severed_session_is_reported_lost_without_a_goodbye_and_stops_its_thread() -> None:
    """sever() drops the master link as a dying process does: no bye, no abort reason."""
    master, addr = start_master(3)
    sessions = join_all(addr, [0, 1, 2])
    logs = [Events(s) for s in sessions]
    link = sessions[1]._thread
    sessions[1].sever()
    for i in (0, 2):
        ev = logs[i].wait_for(lambda e: e["type"] == "peer_lost", timeout=10)
        assert ev["rank"] == 1 and "without a goodbye" in ev["reason"], ev
    assert not link.is_alive()
    assert not [e for e in logs[1].items if e["type"] == "master_lost"], logs[1].items
    with pytest.raises(ClosedError):
        sessions[1].send({"service": "x"})
    sessions[1].close()                 # after sever: nothing more to do, no error
    sessions[0].close(), sessions[2].close()
    assert master.wait(10) == 1


class _StubSession:
    """What TCPChannel uses of a MasterSession: the table, events, abort/close."""

    def __init__(self, table: list[dict]) -> None:
        self.table = table
        self.callbacks: list = []
        self.aborted: list[str] = []

    def on_event(self, cb) -> None:
        self.callbacks.append(cb)

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)

    def close(self) -> None:
        pass


class _LossRecorder:
    def __init__(self) -> None:
        self.messages: list[bytes] = []
        self.lost: list[tuple[int, str]] = []

    def on_message(self, peer, edge, data, release):
        self.messages.append(bytes(data))
        release()

    def on_credit(self, peer, edge):
        pass

    def on_sent(self, token):
        pass

    def on_peer_lost(self, peer, reason):
        self.lost.append((peer, reason))


TWO_HOSTS = [{"host_id": "hostA/boot/1", "tcp_host": "10.0.0.1"}, {"host_id": "hostB/boot/2", "tcp_host": "10.0.0.2"}]


def _channel_pair():
    from channels.tcp import TCPChannel, _Peer
    from twisternet.config import Config
    a, b = socket.socketpair()
    cfg = Config(heartbeat_interval=0.5, peer_timeout=30.0)
    s0, s1 = _StubSession(TWO_HOSTS), _StubSession(TWO_HOSTS)
    ch0 = TCPChannel(0, 2, cfg, {1: _Peer(1, a, "unix")}, [], b"t" * 16, s0)
    ch1 = TCPChannel(1, 2, cfg, {0: _Peer(0, b, "unix")}, [], b"t" * 16, s1)
    h0, h1 = _LossRecorder(), _LossRecorder()
    ch0.start(h0)
    ch1.start(h1)
    return ch0, ch1, h0, h1, s0, s1


def _progress_until(cond, *chans, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        for ch in chans:
            ch.progress(0.01)


def test_a_failing_peer_tells_the_others_why_and_where_it_ran() -> None:
    ch0, ch1, h0, h1, s0, s1 = _channel_pair()
    try:
        assert ch0.send(1, 1, [b"last words"])      # queued, not written yet: the ABORT goes behind it
        ch0.abort("rank 0 failed: PeerLostError('peer rank 5 was lost: rank 5 on hostC (10.0.0.3)')")
        _progress_until(lambda: h1.lost, ch1)
        assert h1.messages == [b"last words"]
        assert h1.lost == [(0, "rank 0 on hostA (10.0.0.1; ranks on that host: 0): it failed: rank 0 failed: "
                               "PeerLostError('peer rank 5 was lost: rank 5 on hostC (10.0.0.3)')")]
        assert s0.aborted and "rank 5 on hostC" in s0.aborted[0]     # the master hears why, too
    finally:
        ch1.abort("test over")


def test_a_peer_that_hangs_up_is_reported_with_its_host_and_ranks() -> None:
    ch0, ch1, h0, h1, s0, s1 = _channel_pair()
    try:
        ch1._peers[0].sock.shutdown(socket.SHUT_RDWR)    # as if the process died: no BYE, no ABORT
        _progress_until(lambda: h0.lost, ch0)
        peer, reason = h0.lost[0]
        assert peer == 1 and reason.startswith("rank 1 on hostB (10.0.0.2; ranks on that host: 1): "), reason
    finally:
        ch0.abort("test over")
        ch1.abort("test over")


def test_a_loss_the_master_reports_names_where_the_rank_ran() -> None:
    ch0, ch1, h0, h1, s0, s1 = _channel_pair()
    try:
        for cb in s0.callbacks:
            cb({"type": "peer_lost", "rank": 1, "reason": "no message for 5s (heartbeat timeout)",
                "place": "rank 1 on hostB (10.0.0.2; ranks on that host: 1)"})
        _progress_until(lambda: h0.lost, ch0)
        assert h0.lost == [(1, "bootstrap master reports rank 1 on hostB (10.0.0.2; ranks on that host: 1): "
                               "no message for 5s (heartbeat timeout)")]
    finally:
        ch0.abort("test over")
        ch1.abort("test over")


def test_mesh_errors_name_the_host_of_each_unreachable_rank() -> None:
    from channels.tcp import build_mesh
    from twisternet.config import Config
    with socket.socket() as closed:       # a port nobody listens on
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
    listener = socket.create_server(("127.0.0.1", 0))
    table = [{"host_id": "hostA/boot/1", "tcp_host": "127.0.0.1", "tcp_port": dead_port},
             {"host_id": "hostB/boot/2", "tcp_host": "127.0.0.1", "tcp_port": listener.getsockname()[1]}]
    cfg = Config(connect_timeout=0.5, force_tcp=True)
    try:
        with pytest.raises(OperationTimeout) as dialing:      # rank 1 dials rank 0: refused
            build_mesh(1, 2, table, [], b"t" * 16, cfg)
        text = str(dialing.value)
        assert text.startswith("rank 1 on hostB (127.0.0.1; ranks on that host: 1) could not connect to ranks [0]")
        assert "rank 0 on hostA (127.0.0.1; ranks on that host: 0): " in text and "refused" in text, text
        with pytest.raises(OperationTimeout) as waiting:      # rank 0 waits for rank 1, which never comes
            build_mesh(0, 2, table, [listener], b"t" * 16, cfg)
        assert "no connection arrived from rank 1 on hostB (127.0.0.1; ranks on that host: 1)" in str(waiting.value)
    finally:
        listener.close()
