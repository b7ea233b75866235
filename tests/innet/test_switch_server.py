"""The switch as a UDP service: SwitchThread, JSON config, the CLI main, and loss injection."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from innet.control import InvalidArgument, JobEntry, MulticastGroup
from innet.switch import SoftwareSwitch
from innet.switch_server import SwitchThread, apply_config
from innet.transport import ROLE_PS, ROLE_WORKER, LossConfig, UdpTransport
from innet.wire import Packet, decode, encode

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
V = 62
CLI = [sys.executable, "-c", "import sys; from innet.switch_server import main; sys.exit(main(sys.argv[1:]))"]


def _udp() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(5.0)
    return s


def _config(workers, ps) -> dict:
    return {"ports": {"1": list(workers[0].getsockname()), "2": list(workers[1].getsockname()),
                      "9": list(ps.getsockname())},
            "groups": [{"group_id": 1, "ports": [1, 2]}],
            "jobs": [{"job_id": 3, "fan_in": 2, "ps_port": 9, "mcast_group": 1, "level": 0}],
            "ecn_threshold": 1000}


def _exchange(switch_addr, workers, ps) -> None:
    """Two workers send one fragment; the PS gets the sum; its ACK is multicast to both workers."""
    rng = np.random.default_rng(0)
    vals = rng.integers(-2**20, 2**20, (2, V)).astype(np.int32)
    for w in range(2):
        workers[w].sendto(encode(Packet(3, 11, vals[w], bitmap0=1 << w, bitmap1=1, fan_in0=2,
                                        agg_index=17)), switch_addr)
    agg = decode(ps.recvfrom(65536)[0], V)
    assert (agg.job_id, agg.seq, agg.bitmap0, agg.edge) == (3, 11, 0b11, True)
    assert np.array_equal(agg.values, vals.sum(axis=0))
    result = np.arange(V, dtype=np.float32)
    ps.sendto(encode(Packet(3, 11, result, bitmap0=3, bitmap1=1, fan_in0=2, agg_index=17, is_ack=True)),
              switch_addr)
    for w in range(2):
        p = decode(workers[w].recvfrom(65536)[0], V)
        assert p.is_ack and np.array_equal(p.float_values(), result)


def test_switch_thread_end_to_end() -> None:
    workers, ps = [_udp(), _udp()], _udp()
    try:
        with SwitchThread(64, V, config=_config(workers, ps)) as st:
            _exchange(st.address, workers, ps)
            c = st.switch.counters()
            assert (c["aggregated"], c["acks"]) == (2, 1)
            assert st.switch.read_aggregator(17).job_seq == 0
    finally:
        for s in (*workers, ps):
            s.close()


def test_cli_main_subprocess() -> None:
    workers, ps = [_udp(), _udp()], _udp()
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([*CLI, "--port", "0", "--aggregators",
                             "64", "--values", str(V), "--config", json.dumps(_config(workers, ps))],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert "listening on udp" in line
        host, port = line.split()[-1].rsplit(":", 1)
        _exchange((host, int(port)), workers, ps)
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        proc.stdout.close()
        for s in (*workers, ps):
            s.close()


def test_cli_rejects_bad_arguments() -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    for args in (["--aggregators", "0"], ["--config", '{"bogus": 1}']):
        r = subprocess.run([*CLI, *args], capture_output=True,
                           text=True, env=env, cwd=ROOT, timeout=30)
        assert r.returncode == 2
        assert "aggregators" in r.stderr or "bogus" in r.stderr


def test_apply_config_upserts_and_rejects_unknown_keys() -> None:
    sw = SoftwareSwitch(8, 4)
    cfg = {"ports": {"1": ["127.0.0.1", 5000]}, "groups": [{"group_id": 1, "ports": [1]}],
           "jobs": [{"job_id": 1, "fan_in": 2, "ps_port": 1, "mcast_group": 1}], "ecn_threshold": 5}
    apply_config(sw, cfg)
    cfg["jobs"][0]["fan_in"] = 3
    cfg["groups"][0]["ports"] = [1, 2]
    apply_config(sw, cfg)                    # second time: modify
    assert sw.read_jobs() == [JobEntry(1, 3, 1, 1, 0)]
    assert sw.read_mcast_groups() == [MulticastGroup(1, (1, 2))]
    assert sw.ecn_threshold() == 5
    apply_config(sw, {"ports": [{"port": 4, "host": "127.0.0.1", "udp_port": 6000}]})
    assert sw.read_ports()[4] == ("127.0.0.1", 6000)
    with pytest.raises(InvalidArgument, match="bogus"):
        apply_config(sw, {"bogus": []})
    with pytest.raises(InvalidArgument, match="jobs"):
        apply_config(sw, {"jobs": [{"job_id": 1}]})


def test_loss_injection_is_seeded_and_by_kind() -> None:
    sink = _udp()
    grad = encode(Packet(1, 0, np.zeros(4, np.int32)))
    ackp = encode(Packet(1, 0, np.zeros(4, np.int32), is_ack=True))

    def drops(role: str, loss: LossConfig, data: bytes, n: int = 2000) -> int:
        t = UdpTransport(role=role, loss=loss)
        try:
            for _ in range(n):
                t.send(data, sink.getsockname())
            return t.dropped
        finally:
            t.close()

    try:
        cfg = LossConfig(gradient=0.1, aggregate=0.0, parameter=0.5, seed=3)
        d1 = drops(ROLE_WORKER, cfg, grad)
        assert d1 == drops(ROLE_WORKER, cfg, grad)          # reproducible
        assert 120 < d1 < 280                               # ~10 % of 2000
        assert drops(ROLE_PS, cfg, grad) == 0                # a PS/switch gradient is an "aggregate"
        assert 850 < drops(ROLE_PS, cfg, ackp) < 1150        # parameter packets: 50 %
        with pytest.raises(ValueError):
            LossConfig(gradient=1.5)
    finally:
        sink.close()


def test_cli_serves_p4runtime_when_asked(tmp_path) -> None:
    pytest.importorskip("grpc")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        grpc_port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT)
    # a P4Runtime port without a token is refused (unless --p4runtime-insecure says so)
    r = subprocess.run([*CLI, "--p4runtime-port", str(grpc_port)], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 2 and "--p4runtime-token-file" in r.stderr
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    proc = subprocess.Popen([*CLI, "--p4runtime-port", str(grpc_port), "--p4runtime-token-file", str(token_file)],
                            stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert "listening on udp" in proc.stdout.readline()
        with socket.create_connection(("127.0.0.1", grpc_port), timeout=10):
            pass                                             # the gRPC server accepts connections
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
        proc.stdout.close()


def test_rate_limited_port_tail_drops_and_marks_ecn() -> None:
    """A 20 packets/s port with a 4-packet buffer: a burst of 60 gradients mostly tail-drops; every packet
    is either processed or counted as dropped. (ECN marking on that queue: tests/innet/test_bench_innet.py.)"""
    workers, ps = [_udp(), _udp()], _udp()
    cfg = _config(workers, ps)
    try:
        with SwitchThread(256, V, config=cfg, line_rate=20, queue_limit=4) as st:
            vals = np.ones(V, np.int32)
            for seq in range(60):   # fan-in 2 but only worker 0 sends: nothing completes; the switch
                workers[0].sendto(encode(Packet(3, seq, vals, bitmap0=1, bitmap1=1, fan_in0=2,  # holds them
                                                agg_index=seq)), st.address)
            deadline = time.monotonic() + 10
            while st.server.packets_in + st.server.tail_drops < 60 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert st.server.tail_drops >= 60 - 4 - 2          # the buffer plus what the port drained
            assert st.server.packets_in + st.server.tail_drops == 60
    finally:
        for s in (*workers, ps):
            s.close()


def test_rate_limit_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="line_rate"):
        SwitchThread(8, V, line_rate=0)
    with pytest.raises(ValueError, match="queue_limit"):
        SwitchThread(8, V, queue_limit=0)


@pytest.mark.parametrize("batched", [True, False])
def test_both_server_loops_aggregate_and_drop_oversize_and_forged(batched: bool) -> None:
    """The batched loop (recvfrom_into preallocated rows) and the per-packet loop: same service, and an
    oversize datagram (longer than the row) and a forged gradient are dropped, not aggregated."""
    workers, ps, stranger = [_udp(), _udp()], _udp(), _udp()
    with SwitchThread(64, V, config=_config(workers, ps), batched=batched) as st:
        assert st.server.batched is batched
        good = encode(Packet(3, 11, np.ones(V, np.int32), bitmap0=1, bitmap1=1, fan_in0=2, agg_index=17))
        workers[0].sendto(good + b"\0" * 8, st.address)      # oversize: dropped
        stranger.sendto(good, st.address)                     # not a member: rejected
        deadline = time.monotonic() + 30
        while st.switch.counters()["rejected"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        _exchange(st.address, workers, ps)
        c = st.switch.counters()
        assert (c["dropped"], c["rejected"], c["aggregated"]) == (1, 1, 2)
    for s in (*workers, ps, stranger):
        s.close()
