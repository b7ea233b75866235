"""Failures after the join (twisternet.bootstrap): killed, silent and cleanly closing workers, lost-rank
reports, and a killed or stopped master."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.twisternet.bootstrap_harness import (FAST, ROOT, TOKEN, Events, join_all, spawn_joiner,
                                              start_master, wait_joined)
from twisternet.bootstrap import join
from twisternet.errors import PeerLostError

pytestmark = pytest.mark.timeout(60)


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
