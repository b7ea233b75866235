"""Joining the bootstrap master (twisternet.bootstrap): consistent tables, host ids, junk and wrong-token
connections, rank conflicts, join timeouts, bad arguments, and a worker that meets a busy master."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.twisternet.bootstrap_harness import FAST, TOKEN, join_all, start_master
from twisternet.bootstrap import Master, host_id, join, parse_address
from twisternet.errors import AuthError, ConfigError, OperationTimeout, TwisternetError

pytestmark = pytest.mark.timeout(60)


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
