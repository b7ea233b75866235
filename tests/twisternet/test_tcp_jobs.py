"""Real multi-process jobs over the TCP channel, started with `twisternet run`."""

import re
from pathlib import Path

import pytest

from tests.jobs import assert_survivors_saw_the_kill, lines, run_tcp

S = Path(__file__).parent / "scripts"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("force_tcp", ["0", "1"])
def test_mixed_exchange(n, force_tcp):
    p = run_tcp(n, S / "tcp_exchange.py", "64" if n == 2 else "16", "240", TWISTERNET_FORCE_TCP=force_tcp,
                timeout=200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = lines(p, "RESULT")
    assert len(res) == n
    for r in res:
        assert "bad=0" in r and f"received={240 * (n - 1)}" in r
        assert ("links=tcp" if force_tcp == "1" else "links=uds") in r


@pytest.mark.timeout(300)
def test_256mb_arrays():
    p = run_tcp(2, S / "tcp_exchange.py", "256", "12", timeout=280)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert all("bad=0" in r for r in lines(p, "RESULT"))


@pytest.mark.timeout(240)
def test_back_pressure_bounds_producer_memory():
    p = run_tcp(2, S / "tcp_backpressure.py", "300", TWISTERNET_BUFFER_SIZE="65536",
                TWISTERNET_BUFFER_COUNT="4", TWISTERNET_POOL_BUFFERS="8", timeout=220)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    prod = lines(p, "PRODUCER")[0]
    cons = lines(p, "CONSUMER")[0]
    growth = float(re.search(r"growth_mb=([\d.]+)", prod).group(1))
    budget = float(re.search(r"budget_mb=([\d.]+)", prod).group(1))
    send_s = float(re.search(r"send_seconds=([\d.]+)", prod).group(1))
    cons_s = float(re.search(r"seconds=([\d.]+)", cons).group(1))
    assert "consumed=9600" in cons
    # 300 MB went through; the producer held at most its buffer budget plus a small constant
    assert growth < budget + 40, prod
    # and it was held back by the consumer rather than running ahead
    assert send_s > 0.5 * cons_s, (prod, cons)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("force_tcp", ["0", "1"])
def test_sigkill_mid_transfer_raises_peer_lost(force_tcp):
    p = run_tcp(3, S / "tcp_kill.py", TWISTERNET_PEER_TIMEOUT="10", TWISTERNET_FORCE_TCP=force_tcp,
                timeout=100, grace=20)
    assert_survivors_saw_the_kill(p, victim=2, survivors=2, within=10)
    assert p.returncode == 128 + 9


@pytest.mark.timeout(120)
def test_garbage_wrong_token_and_silent_connections_are_refused():
    p = run_tcp(2, S / "tcp_intruder.py", TWISTERNET_HANDSHAKE_TIMEOUT="2", timeout=100)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    attacks = lines(p, "ATTACKS")[0]
    assert "ACCEPTED" not in attacks and attacks.count("wrongtoken=refused") == 2
    assert float(re.search(r"silent_dropped_after=([\d.]+)", attacks).group(1)) < 2 + 5
    assert lines(p, "RESULT") == ["RESULT rank=0 ok=True", "RESULT rank=1 ok=True"] or \
        sorted(lines(p, "RESULT")) == ["RESULT rank=0 ok=True", "RESULT rank=1 ok=True"]
    assert "dropped a connection" in p.stderr


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_three_gib_object_round_trips():
    # Copying 3 GiB holds the GIL for seconds; on a loaded machine heartbeats may pause that long.
    p = run_tcp(2, S / "tcp_huge.py", "3", timeout=1100, TWISTERNET_PEER_TIMEOUT="120")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert lines(p, "HUGE") == [f"HUGE size={3 << 30} same=True"]


@pytest.mark.timeout(120)
def test_isend_handles_guard_the_sent_memory():
    p = run_tcp(2, S / "tcp_isend.py", timeout=100)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert lines(p, "RESULT") == ["RESULT ok=True received=21"], p.stdout[-2000:]
