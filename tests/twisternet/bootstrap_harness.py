"""Shared parts of the bootstrap tests (test_bootstrap_*.py): a master on loopback, sessions joined in
threads or in joiner processes (scripts/boot_joiner.py), and an event recorder. Not a test module."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from twisternet.bootstrap import Master, MasterSession, join


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
