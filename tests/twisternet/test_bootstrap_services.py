"""Services of the bootstrap master (twisternet.bootstrap): echo, errors and timer ticks."""

from __future__ import annotations

import time

import pytest

from tests.twisternet.bootstrap_harness import Events, join_all, start_master
from twisternet.bootstrap import MAX_MESSAGE
from twisternet.errors import TwisternetError

pytestmark = pytest.mark.timeout(60)


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
