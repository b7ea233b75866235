"""The compiled dataplane (``innet._fastpath`` via ``innet.fastpath``) against the Python reference.

The same packet traces (gradients, duplicates, collisions, resends, ACKs, ECN depths, forged and
unregistered sources, garbage, saturating sums, stale reclaims; level-0 and level-1 jobs) go through the
per-packet reference ``SoftwareSwitch.process``, the Python batched dataplane and the C core: outputs (in
order), counters and every register must be identical. Then the whole server loop (recvmmsg/sendmmsg)
against the Python batched server on a real socket. The C tests skip, with the reason, only when the
extension is not built.
"""

from __future__ import annotations

import random
import socket
import threading
import time

import numpy as np
import pytest

from innet import fastpath
from innet.control import JobEntry, MulticastGroup
from innet.fastpath import CDataplane, DataplaneUnavailable, choose_dataplane
from innet.switch import SoftwareSwitch
from innet.switch_server import SwitchServer, SwitchThread
from innet.wire import Packet, encode, packet_size
from tests.innet.test_batch_dataplane import _registers, _switch, _trace

needs_c = pytest.mark.skipif(not fastpath.c_available(),
                             reason=f"C dataplane not built: {fastpath.c_unavailable_reason()}")


def _rows(chunk, size: int) -> tuple[np.ndarray, list[int]]:
    rows = np.zeros((len(chunk), size + 1), np.uint8)
    lengths = []
    for i, (data, _, _) in enumerate(chunk):
        m = min(len(data), size + 1)
        rows[i, :m] = np.frombuffer(data[:m], np.uint8)
        lengths.append(m)
    return rows, lengths


def _run_three(trace, V: int, n_agg: int, level: int, rng: random.Random, sweep: bool = False) -> SoftwareSwitch:
    """Reference, Python batched and C on ``trace`` in random chunks; asserts they agree throughout."""
    ref, bat, csw = (_switch(V, n_agg, level, ecn_threshold=64) for _ in range(3))
    core = CDataplane(csw)
    size = packet_size(V)
    now, pos = 0.0, 0
    while pos < len(trace):
        k = rng.choice((1, 2, 7, 32, 200))
        chunk = trace[pos:pos + k]
        pos += k
        now += rng.choice((0.0, 0.01, 0.6, 1.5) if sweep else (0.0, 0.01, 0.6))
        expected = []
        for data, port, depth in chunk:
            expected.extend(ref.process(data, port, now, queue_depth=depth))
        rows, lengths = _rows(chunk, size)
        ports, depths = [p for _, p, _ in chunk], [d for _, _, d in chunk]
        got_py = bat.process_batch(rows, lengths, ports, now, depths)
        got_c = core.process_batch(rows, lengths, ports, now, depths)
        at = pos - len(chunk)
        assert got_py == expected, f"python batched outputs differ in the chunk at {at}"
        assert got_c == expected, f"C outputs differ in the chunk at {at}"
        assert csw.counters() == ref.counters(), at
        assert csw.extra == ref.extra, at
        if sweep and rng.random() < 0.5:  # the stale sweep (control, Python) runs between batches
            assert csw.reclaim_stale(now) == ref.reclaim_stale(now) == bat.reclaim_stale(now)
    ra, rc = _registers(ref), _registers(csw)
    for name in ra:
        assert np.array_equal(ra[name], rc[name]), name
    return ref


@needs_c
@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("seed", range(12))
def test_c_equals_reference_on_random_traces(level: int, seed: int) -> None:
    rng = random.Random(seed * 31 + level)
    V = rng.choice((1, 4, 62))
    n_agg = rng.choice((1, 3, 8))
    ref = _run_three(_trace(rng, V, n_agg, level, 600), V, n_agg, level, rng)
    c = ref.counters()
    assert min(c["aggregated"], c["collisions"], c["resends"], c["acks"], c["dropped"], c["rejected"],
               c["ecn_marked"], c["forwarded"]) > 0, c
    assert ref.extra["emitted"] > 0 and ref.extra["flushed"] > 0


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_c_equals_reference_with_the_stale_sweep_between_batches(seed: int) -> None:
    """The Python control loop's sweep frees registers the C core then sees (shared memory)."""
    rng = random.Random(seed)
    V, n_agg = 4, 3
    ref = _run_three(_trace(rng, V, n_agg, 0, 400), V, n_agg, 0, rng, sweep=True)
    assert ref.extra["reclaimed"] > 0


@needs_c
def test_c_saturates_and_counts_like_the_reference() -> None:
    big = 2**31 - 10
    trace = []
    for seq, vals in enumerate(([[big, 1], [100, 1], [-200, 1]], [[-big, 0], [-100, 0], [300, 0]])):
        for w, v in enumerate(vals):
            trace.append((encode(Packet(job_id=1, seq=seq, values=np.array(v, np.int32), bitmap0=1 << w,
                                        bitmap1=1, fan_in0=3, agg_index=seq)), w + 1, 0))
    ref = _run_three(trace, 2, 4, 0, random.Random(1))
    assert ref.extra["saturated"] == 2


@needs_c
def test_c_sees_control_changes_between_batches() -> None:
    """Tables are handed over again when the control plane changes them: a removed member is rejected,
    a deleted job's packets are dropped, a new ECN threshold marks."""
    V = 4
    sw = _switch(V, 8, 0, ecn_threshold=64)
    core = CDataplane(sw)
    size = packet_size(V)

    def pkt(port: int, seq: int, depth: int = 0) -> tuple[bytes, int, int]:
        return (encode(Packet(job_id=1, seq=seq, values=np.ones(V, np.int32), bitmap0=1 << (port - 1),
                              bitmap1=1, fan_in0=3, agg_index=seq)), port, depth)

    def run(*chunk: tuple[bytes, int, int]) -> list[tuple[int, bytes]]:
        rows, lengths = _rows(chunk, size)
        return core.process_batch(rows, lengths, [p for _, p, _ in chunk], 0.0, [d for _, _, d in chunk])

    run(pkt(1, 0))
    assert sw.counters()["aggregated"] == 1
    sw.delete_member(1, 2)
    run(pkt(2, 0))
    assert sw.counters()["rejected"] == 1
    sw.set_ecn_threshold(0)
    run(pkt(3, 1, depth=1))
    assert sw.counters()["ecn_marked"] == 1
    sw.delete_job(1)
    run(pkt(1, 2))
    assert sw.counters()["dropped"] == 1 and sw.counters()["aggregated"] == 2


def test_choose_dataplane(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fastpath.DATAPLANE_ENV, "python")
    assert choose_dataplane() == "python"
    assert choose_dataplane("auto") == ("c" if fastpath.c_available() else "python")
    with pytest.raises(ValueError, match="auto, c or python"):
        choose_dataplane("fast")
    monkeypatch.setattr(fastpath, "_fastpath", None)
    monkeypatch.setenv(fastpath.DATAPLANE_ENV, "auto")
    assert choose_dataplane() == "python"
    with pytest.raises(DataplaneUnavailable, match="not built"):
        choose_dataplane("c")
    with pytest.raises(DataplaneUnavailable):
        SwitchServer(SoftwareSwitch(4, 4), dataplane="c")
    assert SwitchServer(SoftwareSwitch(4, 4)).dataplane == "python"


# ---------------------------------------------------------------------- the server loop on a socket

def _socket_trace(V: int, n: int, rng: random.Random) -> list[tuple[int, bytes]]:
    """(sender, packet): workers 0..2, the PS (3) and an unregistered process (4) of one job, with
    duplicates, collisions (two fragments on one slot), resends, overflow and forged packets."""
    out = []
    for s in range(n):
        idx = s % 5
        for w in range(3):
            if rng.random() < 0.1:
                continue                                   # lost: the slot stays partial
            vals = np.array([rng.randrange(-1000, 1000) for _ in range(V)], np.int32)
            p = Packet(job_id=1, seq=s, values=vals, bitmap0=1 << w, bitmap1=1, fan_in0=3, agg_index=idx,
                       resend=rng.random() < 0.05, overflow=rng.random() < 0.03)
            out.append((w, encode(p)))
            if rng.random() < 0.1:
                out.append((w, encode(p)))                 # duplicate
            if rng.random() < 0.05:
                out.append((4, encode(p)))                 # forged from an unregistered address
        if s >= 3 and rng.random() < 0.8:
            a = s - 3
            out.append((3, encode(Packet(job_id=1, seq=a, values=np.zeros(V, np.int32), bitmap0=7, bitmap1=1,
                                         fan_in0=3, agg_index=a % 5, is_ack=True))))
    return out


def _serve_trace(dataplane: str, trace: list[tuple[int, bytes]], V: int, gso: bool = True
                 ) -> tuple[dict, dict, list]:
    """Prefill a switch server's socket with ``trace``, run it with ``dataplane`` until drained; the
    counters, extra counters and what each port's socket received (in order)."""
    sw = SoftwareSwitch(4, V, ecn_threshold=1 << 30, stale_timeout=3600.0)
    server = SwitchServer(sw, dataplane=dataplane)
    assert server.dataplane == dataplane
    server.gso = gso
    socks = []
    for _ in range(5):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    for r in range(4):                                      # port r + 1; the 5th socket has no port
        sw.set_port(r + 1, socks[r].getsockname())
    sw.insert_mcast_group(MulticastGroup(1, (1, 2, 3)))
    sw.insert_job(JobEntry(1, 3, 4, 1, 0))
    for r in range(3):
        sw.insert_member(1, r + 1)
    server.transport.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    for who, data in trace:
        socks[who].sendto(data, server.address)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 120
    while server.packets_in < len(trace) and time.monotonic() < deadline:
        time.sleep(0.01)
    server.stop()
    t.join(30)
    assert server.packets_in == len(trace), "the switch did not receive the whole trace"
    got = []
    for s in socks:
        s.setblocking(False)
        mine = []
        while True:
            try:
                mine.append(s.recv(65536))
            except BlockingIOError:
                break
        got.append(mine)
        s.close()
    return sw.counters(), dict(sw.extra), got


@needs_c
@pytest.mark.parametrize("gso", [True, False])
def test_c_server_equals_python_server_on_a_socket(gso: bool) -> None:
    """Every port's socket receives the same datagrams in the same order from both servers (the C
    loop with UDP GSO trains and with one datagram per message)."""
    V = 8
    trace = _socket_trace(V, 300, random.Random(3))
    c_counts, c_extra, c_out = _serve_trace("c", trace, V, gso)
    p_counts, p_extra, p_out = _serve_trace("python", trace, V)
    assert c_counts == p_counts
    assert c_extra == p_extra
    assert c_out == p_out
    assert c_counts["rejected"] > 0 and c_counts["collisions"] > 0 and c_counts["resends"] > 0
    assert c_counts["dropped"] > 0 and c_extra["emitted"] > 0 and len(c_out[3]) > 0


@needs_c
def test_switch_thread_runs_c_with_loss_injection_falling_back() -> None:
    from innet.transport import LossConfig
    with SwitchThread(4, 4, dataplane="c") as st:
        assert st.server.dataplane == "c"
    with SwitchThread(4, 4, dataplane="c", loss=LossConfig.uniform(0.1)) as st:
        assert st.server.dataplane == "python"



def test_dataplane_env_is_a_config_key() -> None:
    """TWISTERNET_INNET_DATAPLANE is read by the config loader too: a job launched with it set loads,
    a wrong value is a ConfigError naming the key (before: 'unknown key' for any value)."""
    from twisternet.config import load_config
    from twisternet.errors import ConfigError
    assert load_config(env={"TWISTERNET_INNET_DATAPLANE": "c"}).innet_dataplane == "c"
    with pytest.raises(ConfigError, match="innet_dataplane"):
        load_config(env={"TWISTERNET_INNET_DATAPLANE": "fast"})
