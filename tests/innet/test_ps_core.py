"""The compiled PS packet path (innet/_pscore.c) against the per-packet Python reference
(``ParameterServer.handle``): the same datagrams in the same order, the same per-job state and the same
statistics, on random traces of every packet kind; then through a real socket and a whole cluster."""

from __future__ import annotations

import logging
import random
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from innet import pscore
from innet.hostio import addr_key
from innet.ps import _STAT_FIELDS, ParameterServer, PSJobConfig, PSJobStats, PSThread
from innet.wire import (FLAG_ACK, FLAG_COLLISION, FLAG_ECN, FLAG_EDGE, FLAG_OVERFLOW, FLAG_RESEND, encode_header,
                        packet_size)

pytestmark = pytest.mark.timeout(120)

needs_c = pytest.mark.skipif(not pscore.c_available(),
                             reason=f"innet._pscore is not built: {pscore.c_unavailable_reason()}")

SWITCH = ("127.0.0.1", 5000)
STRANGER = ("127.0.0.1", 7000)


@dataclass
class _Job:
    cfg: PSJobConfig
    rack_size: int
    racks: int

    def rack_mask(self, r: int) -> int:
        return (1 << min(self.rack_size, self.cfg.world - r * self.rack_size)) - 1


def _jobs(rng: random.Random, count: int, layouts: list[tuple[int, int | None]] | None = None) -> list[_Job]:
    """``count`` random jobs; ``layouts`` (world, rack size) to pick from, else world 2..8 and racks."""
    out = []
    for job_id in rng.sample(range(1, 256), count):
        world = rng.randint(2, 8)
        rack_size = rng.choice([None, None, 1, 2, 3, world])
        if layouts:
            world, rack_size = rng.choice(layouts)
        switch = rng.choice([SWITCH, SWITCH, SWITCH, None])
        workers = tuple(("127.0.0.1", 6000 + 16 * job_id + r) for r in range(world)) if rng.random() < 0.8 else ()
        scale = rng.choice([2.0**20, 2.0**16, 1000.0, 3.7])
        cfg = PSJobConfig(job_id, world, scale, switch, rack_size=rack_size, keep=rng.choice([0, 1, 3, 8, 40]),
                          workers=workers)
        rs = rack_size or world
        out.append(_Job(cfg, rs, -(-world // rs)))
    return out


def _payload(rng: random.Random, V: int, overflow: bool) -> bytes:
    if overflow:
        vals = [rng.choice([rng.uniform(-1e4, 1e4), 0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3e38])
                for _ in range(V)]
        return struct.pack(f">{V}f", *vals)
    big = rng.random() < 0.2
    return struct.pack(f">{V}i", *(rng.randint(-2**31, 2**31 - 1) if big else rng.randint(-2**20, 2**20)
                                   for _ in range(V)))


def _packet(rng: random.Random, jobs: list[_Job], V: int) -> tuple[bytes, tuple[str, int]]:
    """One packet of a random kind (see the module doc), with its sender."""
    j = rng.choice(jobs)
    cfg = j.cfg
    seq = rng.randint(0, 12)                        # a few sequence numbers: collisions, duplicates
    job_id = cfg.job_id
    full_b1 = (1 << j.racks) - 1
    src = cfg.switch_addr or STRANGER
    r = rng.randrange(j.racks)
    i = rng.randrange(j.rack_mask(r).bit_length())
    kind = rng.random()
    flags = 0
    if kind < 0.35:                                 # a collided (or forwarded) single-worker packet
        b0, b1 = 1 << i, 1 << r
        flags = rng.choice([FLAG_COLLISION, FLAG_COLLISION, 0, FLAG_RESEND])
    elif kind < 0.5:                                # a complete switch aggregate
        b0, b1 = (j.rack_mask(0), 1) if j.racks == 1 else (0, full_b1)
        flags = FLAG_EDGE
    elif kind < 0.58:                               # a partial level-0 aggregate (flush)
        b0, b1 = rng.randint(1, j.rack_mask(r)), 1 << r
        flags = FLAG_EDGE | rng.choice([0, FLAG_RESEND])
    elif kind < 0.63:                               # a level-1 aggregate of some racks
        b0, b1 = 0, rng.randint(1, full_b1)
        flags = FLAG_EDGE
    elif kind < 0.78 and cfg.workers:               # a worker sending straight to the PS
        rank = r * j.rack_size + i
        src = cfg.workers[rank]
        b0, b1 = 1 << i, 1 << r
        flags = rng.choice([0, FLAG_RESEND])
        if rng.random() < 0.1:                      # ... speaking for another rank, or as a switch
            if rng.random() < 0.5:
                src = cfg.workers[(rank + 1) % cfg.world]
            else:
                flags |= FLAG_EDGE
    elif kind < 0.82:
        b0, b1 = 1 << i, 1 << r
        src = STRANGER                              # an unregistered sender
    elif kind < 0.88:                               # inconsistent bitmaps
        b0, b1 = rng.choice([(1, 0), (1, 1 << j.racks), (j.rack_mask(r) + 1 << 1, 1 << r), (1, 3), (0, 0),
                             (rng.getrandbits(32), rng.getrandbits(32))])
    else:
        b0, b1 = 1 << i, 1 << r
    flags |= rng.choice([0, 0, 0, 0, FLAG_ECN, FLAG_COLLISION, FLAG_OVERFLOW, FLAG_ACK])
    if rng.random() < 0.02:
        job_id = rng.choice([j2 for j2 in range(1, 256) if all(x.cfg.job_id != j2 for x in jobs)])   # unknown
    b0, b1 = b0 & 0xFFFFFFFF, b1 & 0xFFFFFFFF          # (32 racks: 1 << racks does not fit)
    data = encode_header(b0, b1, rng.randint(1, 32), rng.randint(1, 32), flags, rng.randrange(1 << 16),
                         job_id << 24 | seq) + _payload(rng, V, bool(flags & FLAG_OVERFLOW))
    roll = rng.random()
    if roll < 0.02:
        data = data[:-4]                            # too short
    elif roll < 0.03:
        data = data + b"\x01"                       # too long (the receive rows are one byte wider)
    elif roll < 0.045:
        data = bytes(8) + data[8:12] + bytes(1) + data[13:]     # job 0: garbled
    return data, src


# NaN results compare equal whatever their sign and payload: IEEE leaves them to the operand order, and
# NumPy itself gives different NaN bits for the same sums (its SIMD loops vs short arrays); every other
# bit of every datagram and state must be equal.
def _canon(data: bytes, dtype: str) -> bytes:
    a = np.frombuffer(data, dtype).copy()
    a[np.isnan(a)] = np.nan
    return a.tobytes()


def _canon_outs(outs: list[tuple[tuple[str, int], bytes]]) -> list[tuple[tuple[str, int], bytes]]:
    return [(a, d[:16] + _canon(d[16:], ">f4")) for a, d in outs]


def _snapshot(ps: ParameterServer, jobs: list[_Job]) -> dict:
    snap: dict = {"dropped": ps.dropped, "rejected": ps.rejected}
    for j in jobs:
        jid = j.cfg.job_id
        if ps.has_job(jid):
            state = ps.job_state(jid)
            state["pending"] = {s: v[:2] + (None if v[2] is None else _canon(v[2], "=f8"),) + v[3:]
                                for s, v in state["pending"].items()}
            state["completed"] = _canon_outs(state["completed"])
            snap[jid] = (ps.stats(jid), state)
    return snap


def _rows(part: list[tuple[bytes, tuple[str, int]]], V: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows = np.zeros((len(part), packet_size(V) + 1), np.uint8)
    for k, (data, _) in enumerate(part):
        rows[k, :len(data)] = np.frombuffer(data, np.uint8)
    return (rows, np.array([len(d) for d, _ in part], np.int64),
            np.array([addr_key(s) for _, s in part], np.uint64))


def _differential(seed: int, n_jobs: int, V: int, n: int,
                  layouts: list[tuple[int, int | None]] | None = None) -> tuple[int, int]:
    """Feed one random trace to a Python and a C server; compare after every batch. Returns (outputs,
    completed) for the caller to check the trace did something."""
    rng = random.Random(seed)
    jobs = _jobs(rng, n_jobs, layouts)
    ref = ParameterServer(("127.0.0.1", 0), V, core="python")
    cps = ParameterServer(("127.0.0.1", 0), V, core="c")
    assert ref.core == "python" and cps.core == "c"
    outputs = 0
    try:
        for ps in (ref, cps):
            for j in jobs:
                ps.add_job(j.cfg)
        now = 0.0
        done = 0
        while done < n:
            if rng.random() < 0.03:                 # a job removed, or added again with fresh state
                j = rng.choice(jobs)
                op = rng.choice(["remove", "add"])
                for ps in (ref, cps):
                    ps.remove_job(j.cfg.job_id) if op == "remove" else ps.add_job(j.cfg)
                assert ref.has_job(j.cfg.job_id) == cps.has_job(j.cfg.job_id)
            now += rng.choice([0.001, 0.5, 30.0, 61.0])          # past the pending TTL now and then
            part = [_packet(rng, jobs, V) for _ in range(rng.choice([1, 1, 2, 3, 17, 64]))]
            done += len(part)
            want = [o for data, src in part for o in ref.handle(data, src, now)]
            got = cps.process_batch(*_rows(part, V), now) if rng.random() < 0.7 else \
                [o for data, src in part for o in cps.handle(data, src, now)]
            assert _canon_outs(got) == _canon_outs(want)
            assert _snapshot(cps, jobs) == _snapshot(ref, jobs)
            outputs += len(want)
        return outputs, sum(ref.stats(j.cfg.job_id).completed for j in jobs if ref.has_job(j.cfg.job_id))
    finally:
        ref.transport.close()
        cps.transport.close()


@needs_c
@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n_jobs=st.integers(1, 4), V=st.sampled_from([1, 4, 62]))
def test_c_core_equals_the_reference_on_random_traces(seed: int, n_jobs: int, V: int) -> None:
    _differential(seed, n_jobs, V, 150)


@needs_c
@pytest.mark.parametrize("seed", range(4))
def test_c_core_equals_the_reference_on_long_traces(seed: int) -> None:
    outputs, completed = _differential(1000 + seed, 3, 62, 2500)
    assert outputs > 100 and completed > 10          # the traces complete fragments, not only drop them


@needs_c
@pytest.mark.parametrize("seed", range(3))
def test_c_core_equals_the_reference_for_wide_jobs(seed: int) -> None:
    """The edges of the layout: 32 racks (the whole bitmap1), racks of 32 workers (the whole bitmap0),
    worlds past 64 ranks, a single worker."""
    outputs, _ = _differential(2000 + seed, 3, 4, 1500, [(64, 2), (40, 32), (1024, 32), (32, 1), (1, None)])
    assert outputs > 0


@needs_c
def test_collided_packets_interleaved_complete_with_flags() -> None:
    """The multi-tenant case itself: single-worker packets of several workers for the same fragments,
    interleaved, collision / ECN flags carried to the result, the parameter resent to a late duplicate."""
    V = 8
    cfg = PSJobConfig(3, 4, 2.0**16, SWITCH, keep=2)
    outs = {}
    for core in ("python", "c"):
        ps = ParameterServer(("127.0.0.1", 0), V, core=core)
        ps.add_job(cfg)
        trace = []
        for seq in range(4):
            for w in (0, 2, 1, 3):
                flags = FLAG_COLLISION | (FLAG_ECN if (seq, w) == (1, 2) else 0)
                trace.append(encode_header(1 << w, 1, 4, 1, flags, seq, 3 << 24 | seq)
                             + np.full(V, 1000 * w + seq, ">i4").tobytes())
        trace.insert(5, trace[4])                   # a duplicate before completion
        trace.append(trace[0])                      # ... and after (seq 0 no longer kept: a new fragment)
        trace.append(trace[-2])                     # seq 3 is kept: its parameter again
        try:
            outs[core] = ([o for t in trace for o in ps.handle(t, SWITCH, 1.0)], ps.stats(3), ps.job_state(3))
        finally:
            ps.transport.close()
    assert outs["c"] == outs["python"]
    out, stats, state = outs["c"]
    assert len(out) == 5 and all(a == SWITCH for a, _ in out)
    assert stats.completed == 4 and stats.duplicates == 2 and stats.param_resent == 1 and stats.collisions == 17
    assert [s for s, _ in state["completed"]] == [2, 3] and list(state["pending"]) == [0]
    head = struct.unpack(">IIHHI", out[1][1][:16])
    assert head[2] & (FLAG_ACK | FLAG_ECN | FLAG_COLLISION) == FLAG_ACK | FLAG_ECN | FLAG_COLLISION
    vals = np.frombuffer(out[1][1], ">f4", V, 16)
    assert np.array_equal(vals, np.full(V, (6000 + 4) / 2.0**16, np.float32))


@needs_c
def test_events_are_logged_as_the_reference_logs_them(caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(7)
    jobs = _jobs(rng, 3)
    V = 4
    trace = [_packet(rng, jobs, V) for _ in range(1500)]
    logs = {}
    for core in ("python", "c"):
        ps = ParameterServer(("127.0.0.1", 0), V, core=core)
        for j in jobs:
            ps.add_job(j.cfg)
        caplog.clear()
        try:
            with caplog.at_level(logging.DEBUG, logger="innet.ps"):
                now = 0.0
                for k in range(0, len(trace), 10):
                    now += 7.0
                    ps.process_batch(*_rows(trace[k:k + 10], V), now)
        finally:
            ps.transport.close()
        logs[core] = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "innet.ps"]
    assert logs["c"] == logs["python"]
    assert any("rejected" in m for _, m in logs["c"]) and any("dropped" in m for _, m in logs["c"])
    assert any(lv == logging.WARNING for lv, _ in logs["c"]) and any(lv == logging.INFO for lv, _ in logs["c"])


@needs_c
def test_simulated_host_names_round_trip() -> None:
    """Addresses that are not numeric IPv4 (simulated hosts of the socket-less tests) compare as the
    reference compares tuples, and come back unchanged."""
    V = 4
    cfg = PSJobConfig(1, 2, 1.0, ("top", 0), workers=(("w0", 1), ("w1", 1)))
    res = {}
    for core in ("python", "c"):
        ps = ParameterServer(("127.0.0.1", 0), V, core=core)
        ps.add_job(cfg)
        try:
            a = ps.handle(encode_header(1, 1, 2, 1, 0, 0, 1 << 24 | 5) + bytes(4 * V), ("w0", 1), 0.0)
            b = ps.handle(encode_header(2, 1, 2, 1, FLAG_COLLISION, 0, 1 << 24 | 5) + bytes(4 * V), ("top", 0), 0.0)
            c = ps.handle(encode_header(2, 1, 2, 1, 0, 0, 1 << 24 | 5) + bytes(4 * V), ("w1", 1), 0.0)
            res[core] = (a, b, c, ps.stats(1), ps.job_state(1), ps.rejected)
        finally:
            ps.transport.close()
    assert res["c"] == res["python"]
    assert [d for d, _ in res["c"][1]] == [("top", 0), ("w0", 1)] and res["c"][2][0][0] == ("w1", 1)


def test_stat_fields_follow_psjobstats() -> None:
    assert tuple(f.name for f in fields(PSJobStats) if f.name != "direct_workers") == _STAT_FIELDS


def test_choosing_the_ps_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(pscore.PS_CORE_ENV, "python")
    assert pscore.choose_ps_core() == "python"
    monkeypatch.setenv(pscore.PS_CORE_ENV, "auto")
    assert pscore.choose_ps_core() == ("c" if pscore.c_available() else "python")
    with pytest.raises(ValueError):
        pscore.choose_ps_core("fast")
    if not pscore.c_available():
        with pytest.raises(pscore.PSCoreUnavailable):
            pscore.choose_ps_core("c")
    ps = ParameterServer(("127.0.0.1", 0), 4)
    try:
        assert ps.core == pscore.choose_ps_core()
    finally:
        ps.transport.close()


def test_ps_core_env_is_a_config_key() -> None:
    """TWISTERNET_INNET_PS_CORE is read by the config loader too: a job launched with it set loads."""
    from twisternet.config import load_config
    from twisternet.errors import ConfigError
    assert load_config(env={"TWISTERNET_INNET_PS_CORE": "python"}).innet_ps_core == "python"
    with pytest.raises(ConfigError, match="innet_ps_core"):
        load_config(env={"TWISTERNET_INNET_PS_CORE": "fast"})


# ---------------------------------------------------------------- through a real socket

def _udp() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    s.settimeout(20.0)
    return s


def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the PS did not take the packets in time"
        time.sleep(0.0005)


@needs_c
def test_serve_through_a_socket_equals_the_reference() -> None:
    """A switch socket and two worker sockets talk to a C-core PS thread; every datagram each socket
    receives, in order, equals what the reference answers the same trace, and so do the statistics."""
    V = 62
    sw, w0, w1 = _udp(), _udp(), _udp()
    addrs = [s.getsockname() for s in (sw, w0, w1)]
    cfg = PSJobConfig(9, 2, 2.0**20, addrs[0], keep=16, workers=(addrs[1], addrs[2]))
    rng = random.Random(3)
    trace: list[tuple[int, bytes]] = []            # (sending socket, packet)
    for seq in range(60):
        kind = seq % 4
        if kind == 0:                               # complete switch aggregate
            trace.append((0, encode_header(3, 1, 2, 1, FLAG_EDGE, seq, 9 << 24 | seq) + _payload(rng, V, False)))
        elif kind == 1:                             # two collided packets
            for w in (1, 0):
                trace.append((0, encode_header(1 << w, 1, 2, 1, FLAG_COLLISION, seq, 9 << 24 | seq)
                              + _payload(rng, V, False)))
        elif kind == 2:                             # a direct worker and a collided one (with overflow)
            trace.append((1, encode_header(1, 1, 2, 1, FLAG_RESEND, seq, 9 << 24 | seq) + _payload(rng, V, False)))
            trace.append((0, encode_header(2, 1, 2, 1, FLAG_COLLISION | FLAG_OVERFLOW, seq, 9 << 24 | seq)
                          + _payload(rng, V, True)))
        else:                                       # a duplicate of a completed fragment, from worker 1
            trace.append((2, encode_header(2, 1, 2, 1, FLAG_RESEND, seq, 9 << 24 | (seq - 1))
                          + _payload(rng, V, False)))
    ref = ParameterServer(("127.0.0.1", 0), V, core="python")
    ref.add_job(cfg)
    want: dict[tuple[str, int], list[bytes]] = {a: [] for a in addrs}
    try:
        for who, data in trace:
            for dest, out in ref.handle(data, addrs[who], 1.0):
                want[dest].append(out)
    finally:
        ref.transport.close()
    socks = (sw, w0, w1)
    try:
        with PSThread(("127.0.0.1", 0), V, core="c") as ps:
            assert ps.server.core == "c"
            ps.server.add_job(cfg)
            last = None
            for sent, (who, data) in enumerate(trace):
                if who != last:
                    # datagrams from two sockets may be reordered on the way (per-CPU backlogs): the
                    # PS must have taken every earlier one before another socket sends
                    _wait_for(lambda n=sent: ps.server.stats(9).packets == n)
                    last = who
                socks[who].sendto(data, ps.address)
            for s, a in zip(socks, addrs):
                got = [s.recv(65536) for _ in want[a]]
                assert got == want[a]
            assert sum(map(len, want.values())) > 60
            st_c = ps.server.stats(9)
            # the reference's stats for the same trace
            ref = ParameterServer(("127.0.0.1", 0), V, core="python")
            ref.add_job(cfg)
            for who, data in trace:
                ref.handle(data, addrs[who], 1.0)
            ref.transport.close()
            assert st_c == ref.stats(9) and st_c.direct_workers == {0, 1}
            assert ps.server.transport.sent == sum(map(len, want.values()))
    finally:
        for s in socks:
            s.close()


@needs_c
def test_multitenant_cluster_on_the_c_core(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three jobs on a switch with too few aggregators: the C PS aggregates the collided fragments and
    the results are within the quantization bound."""
    from innet.quantize import error_bound
    from innet.service import InnetCluster, JobSpec
    from tests.innet.rank_threads import run_ranks
    monkeypatch.setenv(pscore.PS_CORE_ENV, "c")
    specs = [JobSpec(1, 2, max_window=32), JobSpec(2, 3, max_window=32, scale=2.0**16)]
    rng = np.random.default_rng(11)
    with InnetCluster(specs, num_aggregators=16) as c:
        assert c.ps.server.core == "c"
        inputs = {s.job_id: [rng.standard_normal(12_000).astype(np.float32) for _ in range(s.world)]
                  for s in specs}
        out = run_ranks([lambda j=s.job_id: c.allreduce(j, inputs[j]) for s in specs])
        for s, res in zip(specs, out):
            ref = np.sum([a.astype(np.float64) for a in inputs[s.job_id]], axis=0)
            for r in res:
                assert np.all(np.abs(r - ref) <= error_bound(ref, s.scale, s.world))
        assert sum(c.ps.server.stats(s.job_id).collisions for s in specs) > 0
        assert sum(c.ps.server.stats(s.job_id).completed for s in specs) > 0
