"""Packet loss on a real (virtual) network: ATP workers in one network namespace, switch and PS in another,
joined by a veth pair, with nftables dropping 1% / 5% of the UDP packets arriving in *both* namespaces
(gradients and aggregates into the switch/PS side, parameter packets into the workers' side). Results
must stay exact (within the quantization bound) and complete.

Needs root, ``ip netns`` and ``nft`` (Debian's nftables, installed here on first use if apt can); skips
with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)   # ~5 s (plus installing nftables once)

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "scripts"


def _sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    return subprocess.run(full, capture_output=True, text=True, check=check, timeout=60)


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if shutil.which("nft") is None:
        if shutil.which("apt-get") is None:
            return "no `nft` and no apt-get to install nftables"
        r = subprocess.run(["apt-get", "install", "-y", "-q", "nftables"], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if r.returncode != 0 or shutil.which("nft") is None:
            return f"nftables could not be installed: {r.stderr[-300:]}"
    probe = f"tnprobe{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create network namespaces: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture
def two_namespaces():
    why = _unavailable()
    if why:
        print(f"skipping: {why}")
        pytest.skip(why)
    tag = uuid.uuid4().hex[:6]
    sw, wk = f"tnsw{tag}", f"tnwk{tag}"
    net = 10 + int(tag[:2], 16) % 200
    sw_ip, wk_ip = f"10.{net}.7.1", f"10.{net}.7.2"
    try:
        for ns in (sw, wk):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "set", "lo", "up", ns=ns)
        _sh("ip", "link", "add", f"v{tag}a", "netns", sw, "type", "veth", "peer", "name", f"v{tag}b", "netns", wk)
        _sh("ip", "addr", "add", f"{sw_ip}/24", "dev", f"v{tag}a", ns=sw)
        _sh("ip", "addr", "add", f"{wk_ip}/24", "dev", f"v{tag}b", ns=wk)
        _sh("ip", "link", "set", f"v{tag}a", "up", ns=sw)
        _sh("ip", "link", "set", f"v{tag}b", "up", ns=wk)
        # one datagram per frame, as on a wire: a UDP GSO train (switch and workers send them) would
        # otherwise cross the veth, and meet the drop rule, as one unit
        for end, ns in ((f"v{tag}a", sw), (f"v{tag}b", wk)):
            _sh("ip", "link", "set", "dev", end, "gso_max_segs", "1", ns=ns)
        yield sw, wk, sw_ip, wk_ip
    finally:
        for ns in (sw, wk):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _drop(ns: str, percent: int) -> None:
    rules = (f"table inet tnloss {{\n chain input {{\n  type filter hook input priority 0; policy accept;\n"
             f"  meta l4proto udp numgen random mod 100 < {percent} drop\n }}\n}}\n")
    r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("percent", [1, 5])
def test_results_stay_exact_under_random_loss(two_namespaces, percent: int) -> None:
    sw, wk, sw_ip, wk_ip = two_namespaces
    _drop(sw, percent)
    _drop(wk, percent)
    world, sw_port, ps_port, first = 3, 39001, 39002, 40001
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [[wk_ip, first + r] for r in range(world)]
    switch = subprocess.Popen(["ip", "netns", "exec", sw, sys.executable, str(SCRIPTS / "netns_switch.py"), sw_ip,
                               str(sw_port), str(ps_port), json.dumps(workers)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env)
    try:
        assert switch.stdout.readline().strip() == "READY", switch.stderr.read()[-2000:]
        p = subprocess.run(["ip", "netns", "exec", wk, sys.executable, str(SCRIPTS / "netns_workers.py"), sw_ip,
                            wk_ip, str(sw_port), str(ps_port), str(first), str(world)],
                           capture_output=True, text=True, timeout=500, env=env)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        results = [line for line in p.stdout.splitlines() if line.startswith("RESULT")]
        print("\n".join(results))
        assert len(results) == 3 and all("ok=True" in r for r in results), p.stdout[-2000:]
        assert any("retransmits=0" not in r for r in results), "no loss was seen: are the nft rules active?"
    finally:
        switch.stdin.close()
        try:
            switch.wait(20)
        except subprocess.TimeoutExpired:
            switch.kill()
