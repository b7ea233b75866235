"""Batched end hosts: the compiled and Python row I/O, window-wide packet building and quantization, the
PS's batch function against its per-packet reference, and the worker window's socket-buffer cap."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from innet import hostio
from innet.fragments import FragmentPackets, aggregator_indices, rehash_indices
from innet.hostio import RowIO, addr_key, datagram_truesize, key_addr, socket_buffer_window
from innet.ps import ParameterServer, PSJobConfig, PSThread
from innet.ps_batch import handle_batch
from innet.quantize import Quantizer, error_bound
from innet.service import InnetJob
from innet.transport import UdpTransport
from innet.wire import (FLAG_ACK, FLAG_COLLISION, FLAG_ECN, FLAG_EDGE, FLAG_OVERFLOW, FLAG_RESEND,
                        HEADER_SIZE, encode_flags, encode_header, packet_size)
from innet.worker import aggregator_index, rehash_index

pytestmark = pytest.mark.timeout(120)

needs_c = pytest.mark.skipif(not hostio.c_hostio_available(), reason="innet._hostio is not built")
MODES = [pytest.param(True, marks=needs_c, id="compiled"), pytest.param(False, id="python")]


# ---------------------------------------------------------------- row I/O
def _pair() -> tuple[UdpTransport, UdpTransport]:
    rx = UdpTransport(("127.0.0.1", 0))
    tx = UdpTransport(("127.0.0.1", 0))
    return rx, tx


def _drain(io: RowIO, width: int, expect: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    buf = np.zeros((expect + 8, width), np.uint8)
    lengths = np.zeros(expect + 8, np.int64)
    addrs = np.zeros(expect + 8, np.uint64)
    got = 0
    while got < expect:                       # loopback delivers at once; select bounds each wait
        import select
        if not select.select([io.transport.sock], [], [], 10)[0]:
            break
        got += io.recv(buf[got:], lengths[got:], addrs[got:], expect + 8 - got)
    return buf[:got], lengths[:got], addrs[:got]


@pytest.mark.parametrize("compiled", MODES)
@pytest.mark.parametrize("size", [24, 264, 4000])
def test_send_and_receive_rows_deliver_every_datagram_unchanged(compiled: bool, size: int) -> None:
    rx, tx = _pair()
    try:
        rng = np.random.default_rng(size)
        mat = rng.integers(0, 256, (150, size), dtype=np.uint8)
        rows = rng.permutation(150)[:100]
        sent = RowIO(tx, compiled=compiled).send(mat, rows, size, np.full(100, addr_key(rx.address), np.uint64))
        assert sent == 100
        buf, lengths, addrs = _drain(RowIO(rx, compiled=compiled), size + 1, 100)
        assert len(buf) == 100
        assert (lengths == size).all() and (addrs == addr_key(tx.address)).all()
        assert np.array_equal(buf[:, :size], mat[rows])          # same datagrams, in order
    finally:
        rx.close()
        tx.close()


@pytest.mark.parametrize("compiled", MODES)
def test_rows_to_a_connected_peer_and_oversize_datagrams_show_as_too_long(compiled: bool) -> None:
    rx, tx = _pair()
    try:
        tx.sock.connect(rx.address)
        mat = np.arange(40 * 64, dtype=np.uint32).astype(np.uint8).reshape(40, 64)
        assert RowIO(tx, compiled=compiled).send(mat, np.arange(40), 64) == 40
        tx.sock.send(b"y" * 100)                                   # longer than a row
        buf, lengths, _ = _drain(RowIO(rx, compiled=compiled), 65, 41)
        assert np.array_equal(buf[:40, :64], mat) and (lengths[:40] == 64).all()
        assert lengths[40] in (65, 100)          # truncated to the row: never mistaken for a packet
    finally:
        rx.close()
        tx.close()


@needs_c
def test_gso_trains_and_single_datagrams_arrive_alike() -> None:
    rx, tx = _pair()
    try:
        mat = np.random.default_rng(3).integers(0, 256, (200, 280), dtype=np.uint8)
        io = RowIO(tx, compiled=True)
        dest = np.full(200, addr_key(rx.address), np.uint64)
        io.gso = False
        assert io.send(mat, np.arange(100), 280, dest[:100]) == 100
        io.gso = True
        assert io.send(mat, np.arange(100, 200), 280, dest[100:]) == 100
        buf, lengths, _ = _drain(RowIO(rx, compiled=True), 281, 200)
        assert np.array_equal(buf[:, :280], mat) and (lengths == 280).all()
    finally:
        rx.close()
        tx.close()


def test_addr_keys_round_trip() -> None:
    for a in [("127.0.0.1", 1), ("10.1.2.3", 65535), ("0.0.0.0", 0)]:
        assert key_addr(addr_key(a)) == a


# ---------------------------------------------------------------- packet building
@pytest.mark.parametrize("scale", [2.0**20, 2.0**3, 1e6, 0.5])
@pytest.mark.parametrize("world", [1, 2, 7])
def test_quantize_into_equals_quantize_fragments(scale: float, world: int) -> None:
    rng = np.random.default_rng(world)
    q = Quantizer(scale, world)
    for n, width in [(1, 62), (1000, 62), (4097, 64), (10, 8192)]:
        x = (rng.standard_normal(n) * 100).astype(np.float32)
        x[rng.integers(0, n, 3)] = rng.choice(np.array([np.nan, np.inf, -np.inf, 3e9, 1e30, 1e-30], np.float32), 3)
        nrow = -(-n // width)
        padded = np.zeros(nrow * width, np.float32)
        padded[:n] = x
        ref, ref_ovf = q.quantize_fragments(padded.reshape(nrow, width))
        out = np.full((nrow, width), 7, ">i4")
        ovf = q.quantize_into(x, out)
        assert np.array_equal(ovf, ref_ovf)
        assert np.array_equal(out.astype(np.int32), ref)


def test_quantize_into_float64_keeps_float64_precision() -> None:
    q = Quantizer(2.0**20, 2)
    x = np.array([0.1 + 2**-40, -3.3, 1e12], np.float64)
    out = np.zeros((1, 4), np.int32)
    ref, ref_ovf = q.quantize_fragments(np.concatenate([x, [0.0]]).reshape(1, 4))
    assert np.array_equal(q.quantize_into(x, out), ref_ovf) and np.array_equal(out, ref)


def test_vectorized_aggregator_indices_equal_the_scalar_ones() -> None:
    seqs = np.array([0, 1, 5, 2**24 - 1, 2**24, 2**24 + 7, 123_456_789], np.int64)
    for job, n in [(1, 4096), (200, 1), (77, 65536), (255, 1000)]:
        assert aggregator_indices(job, seqs, n).tolist() == [aggregator_index(job, int(s), n) for s in seqs]
        idx = (seqs * 31) % n
        assert rehash_indices(idx, seqs, n).tolist() == [rehash_index(int(i), int(s), n) for i, s in zip(idx, seqs)]


def test_fragment_packets_are_the_wire_format() -> None:
    V, q = 62, Quantizer(2.0**20, 3)
    x = (np.random.default_rng(1).standard_normal(300) * 5).astype(np.float32)
    x[70] = 1e20                                          # fragment 1 overflows
    pk = FragmentPackets(5, V)
    fan = encode_flags(3, 1, 0)
    base = 2**24 - 2                                      # the seq wraps inside the call
    ovf = pk.fill(x, q, bitmap0=0b100, bitmap1=1, flags_word=fan, job_seq0=(9 << 24) | base)
    pk.set_indices(np.array([0, 3]), np.array([513, 7]))
    pk.mark_resend(np.array([3]))
    padded = np.zeros(5 * V, np.float32)
    padded[:300] = x
    qi, ref_ovf = q.quantize_fragments(padded.reshape(5, V))
    assert np.array_equal(ovf, ref_ovf) and ovf.tolist() == [False, True, False, False, False]
    for i in range(5):
        flags = (FLAG_OVERFLOW if ovf[i] else 0) | (FLAG_RESEND if i == 3 else 0)
        head = encode_header(0b100, 1, 3, 1, flags, {0: 513, 3: 7}.get(i, 0), (9 << 24) | ((base + i) % 2**24))
        assert pk.rows[i].tobytes() == head + qi[i].astype(">i4").tobytes()


# ---------------------------------------------------------------- the PS's batch function
SWITCH = ("127.0.0.1", 5000)
WORKERS = {1: [("127.0.0.1", 6000 + r) for r in range(2)], 2: [("127.0.0.1", 6100 + r) for r in range(4)]}
STRANGER = ("127.0.0.1", 7000)


def _server(V: int) -> ParameterServer:
    ps = ParameterServer(("127.0.0.1", 0), V, core="python")      # the Python batch function's server
    ps.add_job(PSJobConfig(1, 2, 2.0**20, SWITCH, keep=40, workers=tuple(WORKERS[1])))
    ps.add_job(PSJobConfig(2, 4, 2.0**20, SWITCH, rack_size=2, keep=40, workers=tuple(WORKERS[2])))
    return ps


def _trace(rng: np.random.Generator, V: int, n: int) -> list[tuple[bytes, tuple[str, int]]]:
    out = []
    for _ in range(n):
        job = int(rng.choice([1, 1, 1, 2, 3]))
        seq = int(rng.integers(0, 60))
        kind = rng.random()
        src, b0, b1, flags = SWITCH, 0b11, 1, FLAG_EDGE           # a complete level-0 aggregate
        if job == 2:
            b0, b1 = (0, 0b11) if kind < 0.5 else (0b11, 1 << int(rng.integers(0, 2)))
        if kind < 0.15:                                        # a worker's raw fragment, direct
            r = int(rng.integers(0, len(WORKERS.get(job, WORKERS[1]))))
            src, b0, b1, flags = WORKERS.get(job, WORKERS[1])[r], 1 << (r % 2), 1 << (r // 2), 0
        elif kind < 0.2:
            src = STRANGER                                     # forged source
        elif kind < 0.27:
            b0, flags = 1 << int(rng.integers(0, 2)), FLAG_EDGE | FLAG_RESEND    # a partial flush
        elif kind < 0.45 and job == 1:
            b0, flags = 1 << int(rng.integers(0, 2)), FLAG_COLLISION             # a collided worker packet
        flags |= int(rng.choice([0, 0, 0, FLAG_COLLISION, FLAG_ECN, FLAG_OVERFLOW, FLAG_ACK, FLAG_RESEND]))
        payload = rng.integers(-2**20, 2**20, V).astype(">i4")
        if flags & FLAG_OVERFLOW:
            payload = (rng.standard_normal(V) * 1e4).astype(">f4").view(">i4")
        data = encode_header(b0, b1, 2, 1, flags, int(rng.integers(0, 4096)), (job << 24) | seq) + payload.tobytes()
        if rng.random() < 0.03:
            data = data[:-4]                                   # wrong length
        if rng.random() < 0.02:
            data = b"\0" * len(data)                           # job 0: garbled
        out.append((data, src))
    return out


def _snapshot(ps: ParameterServer) -> dict:
    snap: dict = {"dropped": ps.dropped, "rejected": ps.rejected}
    for job, js in ps._jobs.items():
        snap[job] = (ps.stats(job).__dict__, {s: bytes(v) for s, v in js.completed.items()},
                     {s: (p.have, p.int_sum.tolist(), None if p.float_sum is None else p.float_sum.tolist(),
                          p.ecn, p.collision, p.agg_index) for s, p in js.pending.items()}, dict(js.direct))
    return snap


@pytest.mark.parametrize("seed", range(6))
def test_handle_batch_equals_the_per_packet_reference(seed: int) -> None:
    V = [62, 8, 300][seed % 3]
    rng = np.random.default_rng(seed)
    trace = _trace(rng, V, 600)
    ref, bat = _server(V), _server(V)
    try:
        ref_out = [o for data, src in trace for o in ref.handle(data, src, 1.0)]
        bat_out = []
        width = packet_size(V) + 1
        i = 0
        while i < len(trace):
            part = trace[i:i + int(rng.integers(1, 120))]
            rows = np.zeros((len(part), width), np.uint8)
            for k, (data, _) in enumerate(part):
                rows[k, :len(data)] = np.frombuffer(data, np.uint8)
            lengths = np.array([len(d) for d, _ in part], np.int64)
            keys = np.array([addr_key(s) for _, s in part], np.uint64)
            bat_out.extend(handle_batch(bat, rows, lengths, keys, 1.0).datagrams())
            i += len(part)
        assert len(ref_out) > 100
        assert bat_out == ref_out
        assert _snapshot(bat) == _snapshot(ref)
    finally:
        ref.transport.close()
        bat.transport.close()


def test_handle_batch_takes_the_fast_path_for_complete_aggregates() -> None:
    """Guards the point of the batch function: a batch of new complete aggregates never reaches handle."""
    V = 62
    ps = _server(V)
    calls = []
    real = ps.handle
    ps.handle = lambda *a: calls.append(a) or real(*a)  # type: ignore[method-assign]
    try:
        rows = np.zeros((50, packet_size(V) + 1), np.uint8)
        for s in range(50):
            rows[s, :packet_size(V)] = np.frombuffer(
                encode_header(0b11, 1, 2, 1, FLAG_EDGE, s, (1 << 24) | s) + np.full(V, s, ">i4").tobytes(), np.uint8)
        out = handle_batch(ps, rows, np.full(50, packet_size(V), np.int64), np.full(50, addr_key(SWITCH), np.uint64),
                           1.0).datagrams()
        assert not calls and len(out) == 50 and ps.stats(1).completed == 50
        assert all(a == SWITCH for a, _ in out)
        vals = np.frombuffer(out[7][1], ">f4", V, HEADER_SIZE)
        assert np.array_equal(vals, np.full(V, 7 / 2.0**20, np.float32))
    finally:
        ps.transport.close()


# ---------------------------------------------------------------- the worker window
def test_socket_buffer_window_counts_the_kernel_charge() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 256 * 1024)
        rcv = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        assert socket_buffer_window(s, 264, 1) == rcv // 1280
        assert socket_buffer_window(s, 264, 4) == rcv // (4 * 1280)
        assert socket_buffer_window(s, 32784, 2) == max(1, rcv // (2 * (32784 + 1024)))
        assert datagram_truesize(8208) == 16384 + 256
    finally:
        s.close()


def _direct_jobs(ps: PSThread, world: int, V: int, **opts) -> tuple[list[InnetJob], socket.socket]:
    """Workers of job 1 that talk to the PS straight (no switch), registered at ``ps``."""
    nowhere = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    nowhere.bind(("127.0.0.1", 0))
    jobs = [InnetJob(1, r, world, None, ps.address, value_count=V, **opts) for r in range(world)]
    ps.server.add_job(PSJobConfig(1, world, 2.0**20, nowhere.getsockname(),
                                  workers=tuple(j.direct_address for j in jobs)))
    return jobs, nowhere


def _sum_checked(jobs: list[InnetJob], n: int, seed: int) -> None:
    from tests.innet.rank_threads import run_ranks
    xs = [np.random.default_rng([seed, r]).standard_normal(n).astype(np.float32) for r in range(len(jobs))]
    outs = run_ranks([lambda j=j, x=x: j.allreduce(x) for j, x in zip(jobs, xs)])
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for o in outs:
        assert (np.abs(o - ref) <= error_bound(ref, 2.0**20, len(jobs))).all()


def test_the_window_never_exceeds_what_the_receive_buffer_holds(monkeypatch) -> None:
    monkeypatch.setattr("innet.transport._RECV_BUF", 64 * 1024)
    with PSThread(("127.0.0.1", 0), 62) as ps:
        jobs, nowhere = _direct_jobs(ps, 2, 62, max_window=1024, initial_window=1024)
        try:
            _sum_checked(jobs, 40_000, 1)
            for j in jobs:
                cap = j.worker.window_cap
                assert cap < 1024
                assert 0 < j.last_stats.peak_inflight <= cap
        finally:
            for j in jobs:
                j.close()
            nowhere.close()


@pytest.mark.parametrize("keep", [True, False])
def test_a_call_starts_with_the_window_the_last_one_ended_with(keep: bool) -> None:
    with PSThread(("127.0.0.1", 0), 62) as ps:
        jobs, nowhere = _direct_jobs(ps, 2, 62, max_window=256, initial_window=4, keep_window=keep)
        try:
            _sum_checked(jobs, 20_000, 2)
            first = [j.last_stats.final_window for j in jobs]
            assert all(w > 4 for w in first)
            _sum_checked(jobs, 20_000, 3)
            for j, w in zip(jobs, first):
                # min_window starts at the call's initial window (it only goes down from there)
                assert j.last_stats.min_window == (min(w, j.last_stats.min_window) if keep else 4)
                if keep:
                    assert j.last_stats.min_window > 4
        finally:
            for j in jobs:
                j.close()
            nowhere.close()


@needs_c
def test_compiled_and_python_host_io_give_the_same_sums(monkeypatch) -> None:
    from innet.service import InnetCluster, JobSpec
    xs = [np.random.default_rng(10 + r).standard_normal(20_000).astype(np.float32) * 3 for r in range(3)]
    results = {}
    for mode in ("python", "auto"):
        monkeypatch.setenv(hostio.HOSTIO_ENV, mode)
        with InnetCluster([JobSpec(1, 3)], value_count=100) as c:
            assert all(h.worker._io.compiled == (mode == "auto") for h in c.jobs[1])
            results[mode] = c.allreduce(1, xs)
    ref = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for a, b in zip(results["python"], results["auto"]):
        assert np.array_equal(a.view(np.int32), b.view(np.int32))
        assert (np.abs(a - ref) <= error_bound(ref, 2.0**20, 3)).all()


def test_hostio_env_is_a_config_key(monkeypatch) -> None:
    """TWISTERNET_INNET_HOSTIO is read by the config loader too: a job launched with it set loads, a
    wrong value is a ConfigError naming the key."""
    from twisternet.config import load_config
    from twisternet.errors import ConfigError
    assert load_config(env={"TWISTERNET_INNET_HOSTIO": "python"}).innet_hostio == "python"
    with pytest.raises(ConfigError, match="innet_hostio"):
        load_config(env={"TWISTERNET_INNET_HOSTIO": "fast"})
    monkeypatch.setattr(hostio, "_hostio", None)           # as on a machine without a compiler
    monkeypatch.setenv(hostio.HOSTIO_ENV, "c")
    tr = UdpTransport(("127.0.0.1", 0))
    try:
        with pytest.raises(RuntimeError, match="not built"):
            RowIO(tr)
        monkeypatch.setenv(hostio.HOSTIO_ENV, "auto")
        assert not RowIO(tr).compiled
    finally:
        tr.close()
