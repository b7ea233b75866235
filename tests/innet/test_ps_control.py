"""A standing parameter server (``twisternet ps --control-port``, ``innet.ps_control``): jobs placed on
it at run time with the token, refused without it, and ``AllReduce(via="innet")`` using it through the
config key ``innet_ps`` beside a shared switch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import collectives as C
from innet import DEFAULT_SCALE, error_bound
from innet.ps import ParameterServer
from innet.ps_control import PSControlError, PSControlServer, ps_request
from twisternet.config import load_config
from twisternet.errors import ConfigError
from twisternet.testing import run_local

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "f" * 64


@pytest.fixture
def standing():
    ps = ParameterServer(("127.0.0.1", 0), value_count=100)
    control = PSControlServer(ps, "127.0.0.1", 0, TOKEN)
    try:
        yield ps, control.address
    finally:
        control.close()
        ps.transport.close()


def job(job_id: int = 7) -> dict:
    return {"job_id": job_id, "world": 2, "scale": DEFAULT_SCALE, "switch": ["127.0.0.1", 9],
            "workers": [["127.0.0.1", 40001], ["127.0.0.1", 40002]]}


def test_info_add_remove(standing) -> None:
    ps, addr = standing
    info = ps_request(addr, TOKEN, "info")
    assert tuple(info["address"]) == ps.address and info["values"] == 100
    ps_request(addr, TOKEN, "add", job=job())
    assert ps.has_job(7) and ps.stats(7) is not None
    with pytest.raises(PSControlError, match="job id 7 is served already"):
        ps_request(addr, TOKEN, "add", job=job())
    ps_request(addr, TOKEN, "remove", job_id=7)
    assert not ps.has_job(7)


def test_a_wrong_token_changes_nothing(standing) -> None:
    ps, addr = standing
    for bad in ("", "e" * 64):
        with pytest.raises(PSControlError, match="wrong token"):
            ps_request(addr, bad, "add", job=job(8))
    assert not ps.has_job(8)


def test_bad_requests_are_answered_with_errors(standing) -> None:
    _, addr = standing
    with pytest.raises(PSControlError, match="unknown op"):
        ps_request(addr, TOKEN, "shutdown")
    with pytest.raises(PSControlError, match="bad request"):
        ps_request(addr, TOKEN, "add", job={"world": 2})


def test_innet_ps_needs_a_shared_switch() -> None:
    with pytest.raises(ConfigError, match="innet_ps"):
        load_config(env={}, innet_ps="127.0.0.1:9201")
    assert load_config(env={}, innet_ps="127.0.0.1:9201", innet_switch="127.0.0.1:9",
                       innet_p4runtime="127.0.0.1:10").innet_ps == "127.0.0.1:9201"


@pytest.mark.timeout(180)
def test_allreduce_places_its_job_on_the_standing_ps(tmp_path) -> None:
    """With innet_ps the first rank starts no PS: the job's parameter packets come from the standing one
    (its address in the workers), results are exact within the bound, and the job leaves it on close."""
    from innet.service import start_switch
    from innet.tokens import p4runtime_token

    job_token = b"9c1e5f7a2b8d4c6e0f3a9b7d5e1c2f8a"           # any strong token will do
    token_file = tmp_path / "ps-token"
    token_file.write_text(p4runtime_token(job_token) + "\n")
    os.chmod(token_file, 0o600)
    ps = subprocess.Popen([sys.executable, "-m", "twisternet", "ps", "--host", "127.0.0.1", "--values", "200",
                           "--control-port", "0", "--control-token-file", str(token_file)],
                          stdout=subprocess.PIPE, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    switch = None
    try:
        assert ps.stdout is not None
        udp = re.search(r"listening on udp (\S+):(\d+)", ps.stdout.readline())
        control = re.search(r"ps control on (\S+):(\d+)", ps.stdout.readline())
        assert udp and control
        switch = start_switch("127.0.0.1", value_count=200, p4runtime_token=p4runtime_token(job_token))
        world, size = 2, 5_000

        def value(r: int) -> np.ndarray:
            return (np.random.default_rng([r, size]).standard_normal(size) * 20).astype(np.float32)

        def body(ctx):
            with C.AllReduce(ctx, edge=9, op="sum", via="innet") as op:
                out = op.allreduce(value(ctx.rank))
                w = op._rank_allreduce.innet.job.worker
                return out, w.ps_addr, w.value_count, op._rank_allreduce.innet.last_stats.fallback

        res = run_local(world, body, timeout=150, token=job_token.decode(),
                        innet_switch="{}:{}".format(*switch.udp_addr),
                        innet_p4runtime="{}:{}".format(*switch.p4runtime_addr),
                        innet_ps=f"{control.group(1)}:{control.group(2)}")
        ref = sum(value(r).astype(np.float64) for r in range(world))
        for out, ps_addr, values, fallback in res:
            assert ps_addr == (udp.group(1), int(udp.group(2))) and values == 200 and not fallback
            assert (np.abs(out - ref) <= error_bound(ref, DEFAULT_SCALE, world)).all()
        info = ps_request((control.group(1), int(control.group(2))), p4runtime_token(job_token), "info")
        assert info["values"] == 200
    finally:
        if switch is not None:
            switch.close()
        ps.kill()
        ps.wait()
        if ps.stdout:
            ps.stdout.close()


def test_held_connections_do_not_pile_up_threads(monkeypatch) -> None:
    """Connections that send nothing hold at most MAX_CONNECTIONS handler threads; the rest are closed
    at once (counted), and once the held ones are gone a request is served again."""
    import socket
    import threading
    import time

    from innet import ps_control

    monkeypatch.setattr(ps_control, "_TIMEOUT", 300.0)  # the held ones stay held however slow the test
    ps = ParameterServer(("127.0.0.1", 0), value_count=100)
    control = PSControlServer(ps, "127.0.0.1", 0, TOKEN)
    addr = control.address
    before = threading.active_count()
    held = [socket.create_connection(addr) for _ in range(ps_control.MAX_CONNECTIONS + 20)]
    try:
        for s in held[ps_control.MAX_CONNECTIONS:]:   # past the cap: closed by the server, unanswered
            s.settimeout(60)
            assert s.recv(1) == b""
        assert threading.active_count() - before <= ps_control.MAX_CONNECTIONS
        assert control.refused == 20
        for s in held:
            s.close()
        deadline = time.monotonic() + 60
        while True:     # polling a condition: the held connections' threads end as they see EOF
            try:
                info = ps_request(addr, TOKEN, "info", timeout=30)
                break
            except PSControlError:
                assert time.monotonic() < deadline, "no request served after the held connections closed"
        assert info["values"] == 100
    finally:
        for s in held:
            s.close()
        control.close()
        ps.transport.close()
