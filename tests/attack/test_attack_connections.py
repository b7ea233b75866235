"""A running TCP job under a connection flood, every process limited to 1,024 descriptors.

3,000 connections are opened and held against a worker's data port (TCP), more against its Unix
socket and the bootstrap master, plus garbage, half-open (a partial opening) and wrong-token ones,
while the job exchanges arrays and checks every answer. The job must finish with exact results, the
attacked worker's threads and memory must stay bounded (at most MAX_PENDING_HANDSHAKES handshakes at a
time; the rest are closed unread), and the logs must stay short (rate-limited). All traffic is on
loopback; the attack is bounded in count and time.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from channels import tcp
from tests.jobs import ROOT, job_env
from twisternet import bootstrap
from twisternet.auth import MAGIC, VERSION, handshake
from twisternet.errors import AuthError, ProtocolError

SCRIPT = ROOT / "tests" / "twisternet" / "scripts" / "attack_target.py"
FD_LIMIT = 1024
HELD_WORKER = 3000
HELD_WORKER_UDS = 500
HELD_MASTER = 1000
GARBAGE = 100
HALF_OPEN = 100
WRONG_TOKEN = 10
HOLD_SECONDS = 4.0


def _limit_descriptors() -> None:   # runs in the launcher before exec; its workers inherit it
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))


def _wait_for(path: Path, proc: subprocess.Popen, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"the job ended (exit {proc.returncode}) before {path.name} appeared")
        if time.monotonic() > deadline:
            pytest.fail(f"{path.name} did not appear within {limit}s")
        time.sleep(0.05)


class Sampler(threading.Thread):
    """Records the largest thread count and RSS of some processes while the attack runs."""

    def __init__(self, pids: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.procs = {k: psutil.Process(p) for k, p in pids.items()}
        self.threads = {k: p.num_threads() for k, p in self.procs.items()}
        self.rss = {k: p.memory_info().rss for k, p in self.procs.items()}
        self.base_threads = dict(self.threads)
        self.base_rss = dict(self.rss)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.05):
            for k, p in self.procs.items():
                try:
                    self.threads[k] = max(self.threads[k], p.num_threads())
                    self.rss[k] = max(self.rss[k], p.memory_info().rss)
                except psutil.Error:
                    pass


def _hold(addr, family: int, count: int, out: list[socket.socket]) -> None:
    """Open ``count`` connections without sending anything (non-blocking connects, kept open)."""
    for _ in range(count):
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(addr)
        except (BlockingIOError, InterruptedError):
            if family == socket.AF_UNIX:   # a full Unix backlog refuses at once
                s.close()
                continue
        except OSError:
            s.close()
            continue
        out.append(s)


def _connect(addr, family: int) -> socket.socket | None:
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(addr)
    except OSError:
        s.close()
        return None
    return s


def _garbage(addr, family: int, out: list[socket.socket]) -> None:
    for i in range(GARBAGE):
        s = _connect(addr, family)
        if s is not None:
            try:
                s.send(os.urandom(64 + i) if i % 2 else b"GET / HTTP/1.0\r\n\r\n")
            except OSError:
                pass
            out.append(s)


def _half_open(addr, family: int, out: list[socket.socket]) -> None:
    for _ in range(HALF_OPEN):
        s = _connect(addr, family)
        if s is not None:
            try:
                s.send(MAGIC + bytes([VERSION]) + os.urandom(10))   # the opening, cut short
            except OSError:
                pass
            out.append(s)


def _wrong_token(addr, family: int, outcomes: list[str]) -> None:
    for _ in range(WRONG_TOKEN):
        s = _connect(addr, family)
        if s is None:
            outcomes.append("unreachable")
            continue
        try:
            handshake(s, b"not-the-job-token-5f1c2a9e", initiator=True, hello={"rank": 0}, timeout=10)
            outcomes.append("ACCEPTED")
        except (AuthError, ProtocolError):
            outcomes.append("refused")
        finally:
            s.close()


@pytest.mark.timeout(400)
def test_a_job_finishes_exactly_under_a_connection_flood_with_bounded_threads_memory_and_logs(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = HELD_WORKER + HELD_WORKER_UDS + HELD_MASTER + 4 * (GARBAGE + HALF_OPEN) + 500
    if soft < need:
        if hard != resource.RLIM_INFINITY and hard < need:
            pytest.skip(f"the attacker needs {need} descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    env = job_env(ATTACK_DIR=str(tmp_path))
    cmd = [sys.executable, "-m", "twisternet", "run", "-n", "2", "--grace", "20", str(SCRIPT)]
    held: list[socket.socket] = []
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=err,
                                preexec_fn=_limit_descriptors, start_new_session=True)
    try:
        _wait_for(tmp_path / "job-running", proc, 120)
        target = json.loads((tmp_path / "target.json").read_text())
        victim = int((tmp_path / "pid-1").read_text())
        assert psutil.Process(victim).rlimit(psutil.RLIMIT_NOFILE) == (FD_LIMIT, FD_LIMIT)
        worker = (target["worker"][0], target["worker"][1])
        mhost, _, mport = target["master"].rpartition(":")
        master = (mhost, int(mport))
        uds = "\0" + target["uds"] if target.get("uds") else None
        assert worker[0].startswith("127."), worker
        sampler = Sampler({"worker": victim, "master": proc.pid})
        sampler.start()
        started = time.monotonic()
        outcomes: list[str] = []
        threads = [threading.Thread(target=_wrong_token, args=(a, socket.AF_INET, outcomes))
                   for a in (worker, master)]
        for t in threads:
            t.start()
        _hold(worker, socket.AF_INET, HELD_WORKER, held)
        if uds is not None:
            _hold(uds, socket.AF_UNIX, HELD_WORKER_UDS, held)
        _hold(master, socket.AF_INET, HELD_MASTER, held)
        for addr in (worker, master):
            _garbage(addr, socket.AF_INET, held)
            _half_open(addr, socket.AF_INET, held)
        for t in threads:
            t.join(60)
        while time.monotonic() < started + HOLD_SECONDS:
            time.sleep(0.1)   # the flood is held while the job keeps exchanging arrays
        attacked_for = time.monotonic() - started
        for s in held:
            s.close()
        held.clear()
        (tmp_path / "attack-done").write_text("")
        try:
            rc = proc.wait(timeout=240)
        finally:
            sampler.stop.set()
            sampler.join(5)
    finally:
        for s in held:
            s.close()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            for p in tmp_path.glob("pid-*"):
                try:
                    os.kill(int(p.read_text()), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            proc.wait(30)
    stdout = out_path.read_text(errors="replace")
    stderr = err_path.read_text(errors="replace")
    report = (f"threads {sampler.base_threads} -> {sampler.threads}; rss {sampler.base_rss} -> "
              f"{sampler.rss}; {len(stderr.splitlines())} log lines; attack {attacked_for:.1f}s\n"
              f"stdout:\n{stdout[-2000:]}\nstderr (end):\n{stderr[-3000:]}")
    assert rc == 0, report
    results = sorted(line.split("] ", 1)[-1] for line in stdout.splitlines() if "RESULT" in line)
    assert len(results) == 2 and all(r.endswith("ok=True") for r in results), report
    assert outcomes.count("ACCEPTED") == 0 and outcomes.count("refused") >= 1, outcomes
    # handshakes in flight, plus the job's own threads (baseline) and a little slack
    assert sampler.threads["worker"] - sampler.base_threads["worker"] <= tcp.MAX_PENDING_HANDSHAKES + 4, report
    assert sampler.threads["master"] - sampler.base_threads["master"] <= \
        bootstrap.MAX_PENDING_HANDSHAKES + 4, report
    assert sampler.rss["worker"] - sampler.base_rss["worker"] < 64 << 20, report
    # rate-limited: a few lines per kind of event per 10 s in each process, not one per connection
    assert len(stderr.splitlines()) < 300, report
