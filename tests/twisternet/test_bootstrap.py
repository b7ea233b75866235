"""Tests of the bootstrap master and worker sessions (twisternet.bootstrap)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from twisternet.auth import handshake
from twisternet.bootstrap import (MAX_MESSAGE, Master, MasterSession, _FrameReader, encode_message, host_id,
                                  join, parse_address)
from twisternet.errors import (AuthError, ClosedError, ConfigError, OperationTimeout, PeerLostError, ProtocolError,
                               TwisternetError)

pytestmark = pytest.mark.timeout(60)

TOKEN = b"bootstrap-test-token"
ROOT = Path(__file__).resolve().parents[2]
JOINER = Path(__file__).with_name("scripts") / "boot_joiner.py"
FAST = dict(heartbeat_interval=0.2, peer_timeout=3.0)


class Events:
    """Collects a session's events; lets a test wait for one."""

    def __init__(self, session: MasterSession) -> None:
        self.items: list[dict] = []
        self._cond = threading.Condition()
        session.on_event(self._add)

    def _add(self, ev: dict) -> None:
        with self._cond:
            self.items.append(ev)
            self._cond.notify_all()

    def wait_for(self, pred, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for ev in self.items:
                    if pred(ev):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching event within {timeout}s; got {self.items}")
                self._cond.wait(left)


def start_master(world: int, **kw) -> tuple[Master, str]:
    kw.setdefault("peer_timeout", 3.0)
    kw.setdefault("heartbeat_interval", 0.2)
    m = Master(world, TOKEN, "127.0.0.1", 0, **kw).start()
    return m, f"127.0.0.1:{m.address[1]}"


def join_all(addr: str, ranks: list[int | None], **kw) -> list[MasterSession]:
    kw = {**FAST, "timeout": 20, **kw}
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [pool.submit(join, addr, TOKEN, listen={"tcp": f"10.0.0.{i}:{1000 + i}", "i": i}, rank=r,
                               **kw) for i, r in enumerate(ranks)]
        return [f.result(timeout=30) for f in futures]


def spawn_joiner(addr: str, rank: int | None, mode: str = "hold", world: int | None = None) -> subprocess.Popen:
    env = {**os.environ, "TWISTERNET_MASTER": addr, "TWISTERNET_TOKEN": TOKEN.decode(),
           "TWISTERNET_RANK": "" if rank is None else str(rank),
           "TWISTERNET_WORLD": "" if world is None else str(world), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(JOINER), mode], env=env, stdout=subprocess.PIPE, text=True)


def wait_joined(p: subprocess.Popen, timeout: float = 20) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    t.start()
    t.join(timeout)
    line = box[0] if box else ""
    assert line.startswith("JOINED"), f"joiner did not join: {line!r}"
    return line


# ----------------------------------------------------------------------------------- join and table

def test_four_joiners_get_consistent_tables() -> None:
    master, addr = start_master(4)
    sessions = join_all(addr, [None, 2, None, None])
    try:
        assert sorted(s.rank for s in sessions) == [0, 1, 2, 3]
        assert sessions[1].rank == 2  # the requested rank was honoured
        tables = [s.table for s in sessions]
        assert all(t == tables[0] for t in tables)
        assert all(s.world == 4 for s in sessions)
        for i, s in enumerate(sessions):  # each rank's entry is exactly what it sent, plus host_id
            assert s.table[s.rank] == {"tcp": f"10.0.0.{i}:{1000 + i}", "i": i, "host_id": host_id()}
        assert sessions[0].local_host == "127.0.0.1"
    finally:
        for s in sessions:
            s.close()
    assert master.wait(10) == 0


def test_host_id_names_host_boot_and_netns() -> None:
    hid = host_id()
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert hid == f"{socket.gethostname()}/{boot}/{os.stat('/proc/self/ns/net').st_ino}"


def test_junk_and_wrong_token_connections_are_dropped_and_join_completes() -> None:
    master, addr = start_master(2, handshake_timeout=0.5)
    host, port = parse_address(addr)
    garbage = socket.create_connection((host, port))
    garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + os.urandom(100))
    silent = socket.create_connection((host, port))
    with pytest.raises(AuthError):
        join(addr, b"not the job token", listen={}, timeout=5, handshake_timeout=2)
    sessions = join_all(addr, [None, None])
    try:
        assert sorted(s.rank for s in sessions) == [0, 1]
        # The junk connections were closed by the master (EOF or reset), within the handshake timeout.
        t0 = time.monotonic()
        for s in (garbage, silent):
            s.settimeout(3)
            try:
                while s.recv(4096):
                    pass
            except ConnectionResetError:
                pass
        assert time.monotonic() - t0 < 3
    finally:
        garbage.close(), silent.close()
        for s in sessions:
            s.close()
    assert master.wait(10) == 0


def test_rank_conflicts_and_world_mismatch_are_errors() -> None:
    master, addr = start_master(2)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(join, addr, TOKEN, listen={}, rank=0, timeout=20, **FAST)
        time.sleep(0.3)
        with pytest.raises(ConfigError, match="rank 0 is already taken") as exc:
            join(addr, TOKEN, listen={}, rank=0, timeout=5, **FAST)
        assert exc.value.key == "rank"
        with pytest.raises(ConfigError) as exc:
            join(addr, TOKEN, listen={}, rank=5, timeout=5, **FAST)
        assert exc.value.key == "rank"
        with pytest.raises(ConfigError) as exc:
            join(addr, TOKEN, listen={}, world=3, timeout=5, **FAST)
        assert exc.value.key == "world"
        second = join(addr, TOKEN, listen={}, rank=1, world=2, timeout=10, **FAST)
        s0 = first.result(10)
    assert (s0.rank, second.rank) == (0, 1)
    s0.close(), second.close()
    assert master.wait(10) == 0


def test_worker_leaving_before_the_job_starts_frees_its_slot() -> None:
    master, addr = start_master(2)
    with pytest.raises(OperationTimeout):
        join(addr, TOKEN, listen={}, rank=0, timeout=0.5, **FAST)  # gives up; rank 0 is free again
    time.sleep(0.2)
    sessions = join_all(addr, [0, 1])
    assert [s.rank for s in sessions] == [0, 1]
    for s in sessions:
        s.close()
    assert master.wait(10) == 0


def test_master_join_timeout_fails_the_job() -> None:
    master, addr = start_master(2, join_timeout=0.5)
    with pytest.raises(TwisternetError, match="only 1 of 2 workers joined"):
        join(addr, TOKEN, listen={}, timeout=10, **FAST)
    master.stop()
    assert master.wait(5) == 1


def test_join_times_out_without_a_master() -> None:
    with socket.socket() as s:  # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(OperationTimeout, match="could not reach"):
        join(f"127.0.0.1:{port}", TOKEN, listen={}, timeout=1.0)
    assert time.monotonic() - t0 < 3


def test_bad_join_arguments() -> None:
    with pytest.raises(ValueError):
        join("no-port", TOKEN, listen={})
    with pytest.raises(ConfigError):
        join("127.0.0.1:1", TOKEN, listen={}, rank=2, world=2)
    with pytest.raises(TypeError):
        join("127.0.0.1:1", TOKEN, listen=[])  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Master(0, TOKEN)
    assert parse_address("[::1]:80") == ("::1", 80)


# ----------------------------------------------------------------------------------- failures

def test_killed_joiner_is_reported_to_the_others() -> None:
    master, addr = start_master(3)
    victim = spawn_joiner(addr, rank=2)
    try:
        sessions = join_all(addr, [0, 1])
        wait_joined(victim)
        logs = [Events(s) for s in sessions]
        t0 = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        for log in logs:
            ev = log.wait_for(lambda e: e["type"] == "peer_lost", timeout=3.0)
            assert ev["rank"] == 2 and ev["reason"]
        assert time.monotonic() - t0 < 3.0
        assert all(s.lost == {2} for s in sessions)
    finally:
        victim.kill()
        victim.wait(5)
    for s in sessions:
        s.close()
    assert master.wait(10) == 1  # a worker was lost


def test_silent_joiner_is_reported_after_peer_timeout() -> None:
    master, addr = start_master(2, peer_timeout=1.5)
    victim = spawn_joiner(addr, rank=1)
    try:
        (s0,) = join_all(addr, [0], peer_timeout=1.5)
        wait_joined(victim)
        log = Events(s0)
        victim.send_signal(signal.SIGSTOP)  # connection open, but no heartbeat any more
        t0 = time.monotonic()
        ev = log.wait_for(lambda e: e["type"] == "peer_lost", timeout=4.0)
        assert ev["rank"] == 1 and "heartbeat" in ev["reason"]
        assert 1.0 < time.monotonic() - t0 < 3.5
    finally:
        victim.kill()
        victim.wait(5)
    s0.close()
    assert master.wait(10) == 1


def test_clean_close_is_not_reported_as_lost() -> None:
    master, addr = start_master(3)
    sessions = join_all(addr, [0, 1, 2])
    logs = [Events(s) for s in sessions]
    sessions[0].close()
    leaver = spawn_joiner(addr, rank=None)  # the job is running: a late joiner is refused
    assert leaver.wait(20) != 0
    time.sleep(1.0)  # several heartbeat periods
    for log in logs[1:]:
        assert not [e for e in log.items if e["type"] == "peer_lost"], log.items
    sessions[1].close(), sessions[2].close()
    assert master.wait(10) == 0


def test_report_lost_reaches_the_others_once() -> None:
    master, addr = start_master(3)
    sessions = join_all(addr, [0, 1, 2])
    logs = [Events(s) for s in sessions]
    master.report_lost(1, "process was killed by SIGKILL")
    master.report_lost(1, "again")
    for i in (0, 2):
        ev = logs[i].wait_for(lambda e: e["type"] == "peer_lost", timeout=3)
        assert ev == {"type": "peer_lost", "rank": 1, "reason": "process was killed by SIGKILL",
                      "place": f"rank 1 on {socket.gethostname()} (127.0.0.1)"}
    time.sleep(0.3)
    assert sum(e["type"] == "peer_lost" for e in logs[0].items) == 1
    with pytest.raises(ValueError):
        master.report_lost(3, "out of range")
    for s in sessions:
        s.close()
    assert master.wait(10) == 1


def test_report_lost_during_join_fails_the_joiners() -> None:
    master, addr = start_master(3)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(join, addr, TOKEN, listen={}, rank=r, timeout=20, **FAST) for r in (0, 1)]
        time.sleep(0.5)
        master.report_lost(2, "process exited with code 1")
        for f in futures:
            with pytest.raises(PeerLostError) as exc:
                f.result(10)
            assert exc.value.rank == 2
    # a worker arriving late is refused with the same reason instead of waiting for nothing
    with pytest.raises(PeerLostError, match="rank 2 was lost"):
        join(addr, TOKEN, listen={}, rank=2, timeout=5, **FAST)
    master.stop()
    assert master.wait(5) == 1


def test_master_killed_gives_master_lost_and_stop_gives_shutdown(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    proc = subprocess.Popen([sys.executable, "-m", "twisternet", "master", "--world", "1", "--host",
                             "127.0.0.1", "--token-file", str(token_file)], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TWISTERNET_PEER_TIMEOUT": "3",
                                 "TWISTERNET_HEARTBEAT_INTERVAL": "0.2"},
                            stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for _ in range(5):
            line = proc.stderr.readline()  # type: ignore[union-attr]
            m = re.search(r"listening on [\d.]+:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "master did not report its port"
        assert token_file.stat().st_mode & 0o777 == 0o600
        token = token_file.read_text().strip().encode()
        session = join(f"127.0.0.1:{port}", token, listen={}, timeout=10, **FAST)
        log = Events(session)
        proc.send_signal(signal.SIGKILL)
        ev = log.wait_for(lambda e: e["type"] == "master_lost", timeout=4)
        assert ev["reason"]
        session.close()
    finally:
        proc.kill()
        proc.wait(5)

    master, addr = start_master(1)
    session = join(addr, TOKEN, listen={}, timeout=10, **FAST)
    log = Events(session)
    master.stop()
    log.wait_for(lambda e: e["type"] == "master_shutdown", timeout=4)
    time.sleep(0.3)
    assert not [e for e in log.items if e["type"] == "master_lost"]
    session.close()


def fake_master(frames: bytes, hello: dict | None = None) -> tuple[str, threading.Thread]:
    """A one-shot master written against the documented protocol: handshake, then send ``frames``."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = srv.accept()
        srv.close()
        try:
            handshake(conn, TOKEN, initiator=False, hello=hello or {"kind": "master", "world": 2},
                      timeout=5)
            conn.sendall(frames)
            conn.settimeout(5)
            while conn.recv(4096):  # until the worker leaves
                pass
        except OSError:
            pass
        finally:
            conn.close()
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"127.0.0.1:{srv.getsockname()[1]}", t


def test_messages_arriving_with_the_table_are_not_lost() -> None:
    table = [{"a": 1, "host_id": "h"}, {"b": 2, "host_id": "h"}]
    frames = b"".join(len(b).to_bytes(4, "big") + b for b in (
        msgpack.packb({"type": "table", "rank": 1, "world": 2, "table": table}),
        msgpack.packb({"type": "peer_lost", "rank": 0, "reason": "gone"})))
    addr, t = fake_master(frames)
    session = join(addr, TOKEN, listen={}, timeout=5, **FAST)
    assert (session.rank, session.world, session.table) == (1, 2, table)
    log = Events(session)
    assert log.wait_for(lambda e: e["type"] == "peer_lost", timeout=1)["rank"] == 0
    assert session.lost == {0}
    session.close()
    t.join(5)


@pytest.mark.parametrize("bad", [
    {"type": "table", "rank": 2, "world": 2, "table": [{}, {}]},
    {"type": "table", "rank": 0, "world": 2, "table": [{}]},
    {"type": "table", "rank": 0, "world": 2},
])
def test_malformed_table_is_a_protocol_error(bad: dict) -> None:
    body = msgpack.packb(bad)
    addr, t = fake_master(len(body).to_bytes(4, "big") + body)
    with pytest.raises(ProtocolError, match="malformed table"):
        join(addr, TOKEN, listen={}, timeout=5, **FAST)
    t.join(5)


def test_peer_that_is_not_a_master_is_refused() -> None:
    addr, t = fake_master(b"", hello={"kind": "worker"})
    with pytest.raises(ProtocolError, match="not a bootstrap master"):
        join(addr, TOKEN, listen={}, timeout=5, **FAST)
    t.join(5)


# ----------------------------------------------------------------------------------- services

class Timer:
    """A service that answers each request ``after`` seconds later, through tick()."""

    def __init__(self) -> None:
        self.pending: list[tuple[float, int]] = []

    def handle(self, src: int, msg: dict) -> list:
        self.pending.append((time.monotonic() + msg["after"], src))
        self.pending.sort()
        return []

    def next_deadline(self) -> float | None:
        return self.pending[0][0] if self.pending else None

    def tick(self) -> list:
        now = time.monotonic()
        due = [src for t, src in self.pending if t <= now]
        self.pending = [(t, src) for t, src in self.pending if t > now]
        return [(src, {"fired": True}) for src in due]


def test_services_echo_errors_and_ticks() -> None:
    master, addr = start_master(2)
    master.add_service("echo", lambda src, msg: [(src, {"echo": msg["x"], "from": src})])

    def broken(src: int, msg: dict) -> list:
        raise RuntimeError("boom")
    master.add_service("broken", broken)
    timer = Timer()
    master.add_service("timer", timer.handle, tick=timer.tick, next_deadline=timer.next_deadline)
    sessions = join_all(addr, [0, 1])
    logs = [Events(s) for s in sessions]
    sessions[1].send({"service": "echo", "x": [1, "two", b"3"]})
    ev = logs[1].wait_for(lambda e: e.get("service") == "echo", timeout=3)
    assert ev == {"type": "service", "service": "echo", "echo": [1, "two", b"3"], "from": 1}
    assert not [e for e in logs[0].items if e.get("service") == "echo"]

    sessions[0].send({"service": "nope"})
    assert "no service" in logs[0].wait_for(lambda e: e.get("service") == "nope", timeout=3)["error"]
    sessions[0].send({"service": "broken"})
    assert "boom" in logs[0].wait_for(lambda e: e.get("service") == "broken", timeout=3)["error"]

    t0 = time.monotonic()
    sessions[0].send({"service": "timer", "after": 0.5})
    logs[0].wait_for(lambda e: e.get("service") == "timer", timeout=3)
    assert 0.4 < time.monotonic() - t0 < 2.0
    with pytest.raises(ValueError):
        sessions[0].send({"service": "echo", "x": b"x" * (MAX_MESSAGE + 1)})
    for s in sessions:
        s.close()
    with pytest.raises(TwisternetError):
        sessions[0].send({"service": "echo", "x": 1})
    assert master.wait(10) == 0


# ----------------------------------------------------------------------------------- wire format

messages = st.dictionaries(st.text(max_size=8), st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=10), max_size=5)


@settings(max_examples=50, deadline=None)
@given(msgs=st.lists(messages, max_size=6), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_frames_round_trip_across_arbitrary_chunking(msgs: list[dict], cuts: list[int]) -> None:
    stream = b"".join(encode_message(m) for m in msgs)
    # independent check of the frame layout: u32 big-endian length + msgpack
    if msgs:
        n = int.from_bytes(stream[:4], "big")
        assert msgpack.unpackb(stream[4:4 + n], raw=False) == msgs[0]
    reader = _FrameReader()
    got: list[dict] = []
    prev = 0
    for c in sorted(min(c, len(stream)) for c in cuts) + [len(stream)]:
        got += reader.feed(stream[prev:c])
        prev = c
    assert got == msgs


@settings(max_examples=100, deadline=None)
@given(junk=st.binary(min_size=1, max_size=200))
def test_frame_garbage_is_a_protocol_error_or_incomplete(junk: bytes) -> None:
    reader = _FrameReader()
    try:
        out = reader.feed(junk)
    except ProtocolError:
        return
    for m in out:  # anything accepted must be a real map that the length prefix delimited
        assert isinstance(m, dict)


def test_oversize_frame_is_refused() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        _FrameReader().feed((MAX_MESSAGE + 1).to_bytes(4, "big"))
    with pytest.raises(ProtocolError, match="map"):
        _FrameReader().feed(encode_message({})[:0] + (1).to_bytes(4, "big") + msgpack.packb(7))


def test_a_worker_meeting_a_master_busy_with_handshakes_retries_and_joins(monkeypatch) -> None:
    """Every handshake slot of the master is taken by a silent connection, so the worker's first
    connection is closed unread: join tries again and joins once the silent one timed out."""
    from twisternet.bootstrap import admission
    monkeypatch.setattr(admission, "MAX_PENDING_HANDSHAKES", 1)
    master, addr = start_master(1, handshake_timeout=1.5)
    host, port = parse_address(addr)
    silent = socket.create_connection((host, port))
    try:
        silent.settimeout(20)
        assert silent.recv(4)[:4] == b"TNA1"    # the master's opening: its handshake holds the slot
        t0 = time.monotonic()
        session = join(addr, TOKEN, listen={}, timeout=30, handshake_timeout=5, **FAST)
        try:
            assert session.rank == 0
            assert time.monotonic() - t0 < 25
            assert master.dropped_connections >= 1     # the first try was closed unread
        finally:
            session.close()
    finally:
        silent.close()
        master.stop()


# ----------------------------------------------------------------------------------- join failures say why

def _join_in_thread(addr: str, token: bytes = TOKEN, **kw) -> tuple[threading.Thread, list]:
    """join() in a thread; the list gets ("ok", session) or ("err", exception)."""
    box: list = []

    def run() -> None:
        try:
            box.append(("ok", join(addr, token, listen={}, **{**FAST, "timeout": 20, **kw})))
        except Exception as e:  # noqa: BLE001 - the test inspects it
            box.append(("err", e))
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_missing_worker_master_exits_and_tells_the_joined_ones_who_joined() -> None:
    master, addr = start_master(3, join_timeout=3.0, fail_linger=0.5)
    t0 = time.monotonic()
    joiners = [_join_in_thread(addr) for _ in range(2)]
    assert master.wait(3.0 + 0.5 + 10) == 1, "the master kept waiting for the missing worker"
    assert time.monotonic() - t0 < 3.0 + 0.5 + 10
    assert master.failure is not None and "only 2 of 3 workers joined" in master.failure
    for t, box in joiners:
        t.join(15)
        kind, err = box[0]
        assert kind == "err" and isinstance(err, OperationTimeout), box
        text = str(err)
        assert "only 2 of 3 workers joined the master at " + addr in text, text
        assert f"2 from {socket.gethostname()} (127.0.0.1)" in text, text
        assert "no other worker reached it" in text, text


def test_wrong_token_worker_is_named_in_the_joined_workers_errors() -> None:
    master, addr = start_master(3, join_timeout=3.0, fail_linger=0.5)
    with pytest.raises(AuthError, match="token"):
        join(addr, b"not the job token", listen={}, timeout=5, handshake_timeout=2)
    joiners = [_join_in_thread(addr) for _ in range(2)]
    assert master.wait(3.0 + 0.5 + 10) == 1
    assert "refused: 127.0.0.1: wrong job token" in (master.failure or ""), master.failure
    for t, box in joiners:
        t.join(15)
        kind, err = box[0]
        assert kind == "err" and isinstance(err, OperationTimeout), box
        assert "refused: 127.0.0.1: wrong job token" in str(err), err


def test_refused_world_mismatch_is_named_in_the_join_failure() -> None:
    master, addr = start_master(2, join_timeout=3.0, fail_linger=0.5)
    with pytest.raises(ConfigError, match="world"):
        join(addr, TOKEN, listen={}, world=5, timeout=5, **FAST)
    t, box = _join_in_thread(addr)
    assert master.wait(3.0 + 0.5 + 10) == 1
    t.join(15)
    kind, err = box[0]
    assert kind == "err" and "worker expects world=5" in str(err) and "127.0.0.1" in str(err), box


def test_no_route_to_the_master_is_retried_then_names_the_master(monkeypatch) -> None:
    import errno
    from twisternet.bootstrap import addresses as bootstrap
    calls = []

    def unreachable(master: str) -> str:
        calls.append(master)
        if len(calls) < 3:          # the link comes up after a while: transient, retried
            raise OSError(errno.ENETUNREACH, "Network is unreachable")
        return "127.0.0.1"
    monkeypatch.setattr(bootstrap, "local_address_for", unreachable)
    assert bootstrap.route_to_master("127.0.0.1:9", 10.0) == "127.0.0.1" and len(calls) == 3

    def never(master: str) -> str:
        raise OSError(errno.ENETUNREACH, "Network is unreachable")
    monkeypatch.setattr(bootstrap, "local_address_for", never)
    t0 = time.monotonic()
    with pytest.raises(OperationTimeout) as info:
        bootstrap.route_to_master("127.0.0.1:9", 0.5)
    assert time.monotonic() - t0 < 3
    assert "127.0.0.1:9" in str(info.value) and socket.gethostname() in str(info.value)
    assert "Network is unreachable" in str(info.value)


def test_tcp_channel_without_a_route_raises_a_twisternet_error_naming_the_master(monkeypatch) -> None:
    import errno
    from channels.tcp import create_channel
    from twisternet.bootstrap import addresses
    from twisternet.config import load_config

    def never(master: str) -> str:
        raise OSError(errno.ENETUNREACH, "Network is unreachable")
    monkeypatch.setattr(addresses, "local_address_for", never)
    config = load_config(env={}, master="127.0.0.1:9", token="9f3c1a7e52b84d06e1c7a9b3f25d8e40", connect_timeout=0.5)
    with pytest.raises(TwisternetError, match=r"bootstrap master at 127\.0\.0\.1:9 from "):
        create_channel(config)


def test_master_command_exits_when_the_workers_do_not_come(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TWISTERNET_CONNECT_TIMEOUT": "1"}
    env.pop("TWISTERNET_TOKEN", None)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "twisternet", "master", "--world", "2", "--host", "127.0.0.1",
                           "--token-file", str(token_file)], env=env, capture_output=True, text=True,
                          timeout=40)
    assert done.returncode == 1, done.stderr
    assert "error: only 0 of 2 workers joined the master at 127.0.0.1:" in done.stderr, done.stderr
    assert time.monotonic() - t0 < 30


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


def test_a_worker_whose_join_deadline_comes_first_still_gets_the_masters_verdict() -> None:
    # The worker gives up 0.3 s before the master would: it waits a short grace for the master's reason.
    master, addr = start_master(2, join_timeout=4.3, fail_linger=0.5)
    with pytest.raises(OperationTimeout) as info:
        join(addr, TOKEN, listen={}, **{**FAST, "timeout": 4.0})
    assert "only 1 of 2 workers joined the master at " + addr in str(info.value), info.value
    assert master.wait(10) == 1
