"""Join failures say why (twisternet.bootstrap): missing and wrong-token workers, world mismatches, no
route to the master, and a worker whose join deadline comes before the master's verdict."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.twisternet.bootstrap_harness import FAST, ROOT, TOKEN, start_master
from twisternet.bootstrap import join
from twisternet.errors import AuthError, ConfigError, OperationTimeout, TwisternetError

pytestmark = pytest.mark.timeout(60)


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


def test_a_worker_whose_join_deadline_comes_first_still_gets_the_masters_verdict() -> None:
    # The worker gives up 0.3 s before the master would: it waits a short grace for the master's reason.
    master, addr = start_master(2, join_timeout=4.3, fail_linger=0.5)
    with pytest.raises(OperationTimeout) as info:
        join(addr, TOKEN, listen={}, **{**FAST, "timeout": 4.0})
    assert "only 1 of 2 workers joined the master at " + addr in str(info.value), info.value
    assert master.wait(10) == 1
