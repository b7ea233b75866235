"""Network-namespace testbed for live coflow runs: W workers + a master, each in its own namespace,
joined through a bridge namespace by veth pairs shaped with ``tc tbf`` (both directions).

Used by ``benchmarks/coflow.py`` and ``tests/twisternet/coflow/test_coflow_live_netns.py``. Needs root
and iproute2; :func:`netns_unavailable` says why not. Names are unique per process and every namespace
is deleted in :meth:`Testbed.close` (also on failure: use it as a context manager).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "_coflow_worker.py"


def _run(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {r.stderr.strip()}")


def netns_unavailable() -> str | None:
    """None if namespaces and tc work here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "iproute2 (ip, tc) is not installed"
    name = f"cfprobe{os.getpid() % 100000}"
    try:
        _run("ip", "netns", "add", name)
    except Exception as e:  # noqa: BLE001
        return f"cannot create a network namespace: {e}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


class Testbed:
    """``world`` worker namespaces plus one master namespace, all links shaped to ``rate_mbit``."""

    __test__ = False  # not a pytest class

    def __init__(self, world: int, rate_mbit: float = 100.0) -> None:
        self.world = world
        self.rate = rate_mbit
        self.tag = f"cf{os.getpid() % 10000}{int(time.time() * 1000) % 1000}"
        self.bridge_ns = f"{self.tag}br"
        self.spaces = [f"{self.tag}n{i}" for i in range(world + 1)]   # the last is the master's
        self.addrs = [f"10.213.0.{i + 1}" for i in range(world + 1)]
        self._made: list[str] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="twn-coflow-"))

    def __enter__(self) -> Testbed:
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def up(self) -> None:
        """Create the namespaces, bridge and shaped links."""
        _run("ip", "netns", "add", self.bridge_ns)
        self._made.append(self.bridge_ns)
        b = ("ip", "-n", self.bridge_ns)
        _run(*b, "link", "add", "br0", "type", "bridge")
        _run(*b, "link", "set", "br0", "up")
        _run(*b, "link", "set", "lo", "up")
        tbf = ["root", "tbf", "rate", f"{self.rate}mbit", "burst", "64kb", "latency", "20ms"]
        for i, ns in enumerate(self.spaces):
            _run("ip", "netns", "add", ns)
            self._made.append(ns)
            inner, outer = f"{self.tag}a{i}", f"{self.tag}b{i}"
            _run("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", outer, "netns", self.bridge_ns)
            n = ("ip", "-n", ns)
            _run(*n, "link", "set", inner, "name", "eth0")
            _run(*n, "addr", "add", f"{self.addrs[i]}/24", "dev", "eth0")
            _run(*n, "link", "set", "eth0", "up")
            _run(*n, "link", "set", "lo", "up")
            _run(*b, "link", "set", outer, "master", "br0")
            _run(*b, "link", "set", outer, "up")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *tbf)
            _run("ip", "netns", "exec", self.bridge_ns, "tc", "qdisc", "add", "dev", outer, *tbf)

    def close(self) -> None:
        """Delete every namespace made (veth pairs go with them) and the temp dir."""
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self._made.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run_job(self, policy: str, args: list[str], timeout: float = 120.0,
                extra_env: dict[str, str] | None = None) -> list[dict]:
        """Run the coflow worker on every worker namespace with ``coflow_policy=policy``; their JSON lines."""
        py = sys.executable
        token = self.tmp / f"token-{policy}"
        port = 29400 + (os.getpid() % 500)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TWISTERNET_")}
        env.update({"PYTHONPATH": str(REPO), "TWISTERNET_COFLOW_POLICY": policy,
                    "TWISTERNET_FORCE_TCP": "1", "TWISTERNET_SOCKET_BUFFER": "128k"})
        env.update(extra_env or {})
        master = subprocess.Popen(
            ["ip", "netns", "exec", self.spaces[-1], py, "-m", "twisternet", "master", "--world",
             str(self.world), "--host", self.addrs[-1], "--port", str(port), "--token-file", str(token)],
            env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs: list[subprocess.Popen] = []
        try:
            deadline = time.monotonic() + 20
            while not token.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
            for i in range(self.world):
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", self.spaces[i], py, "-m", "twisternet", "worker", "--master",
                     f"{self.addrs[-1]}:{port}", "--token-file", str(token), "--rank", str(i), "--world",
                     str(self.world), str(WORKER), *args],
                    env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            out: list[dict] = []
            end = time.monotonic() + timeout
            for p in procs:
                so, se = p.communicate(timeout=max(1.0, end - time.monotonic()))
                if p.returncode != 0:
                    raise RuntimeError(f"worker failed ({p.returncode}): {se[-2000:]}")
                out += [json.loads(l) for l in so.splitlines() if l.startswith("{")]
            return sorted(out, key=lambda d: d["rank"])
        finally:
            for p in procs + [master]:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)


def ccts(rows: list[dict]) -> dict[str, float]:
    """Coflow completion times from the workers' rows: last finish - first start, per coflow."""
    return {name: max(r[name][1] for r in rows) - min(r[name][0] for r in rows) for name in ("big", "small")}
