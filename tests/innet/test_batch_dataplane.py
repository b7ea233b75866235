"""The batched dataplane (``SoftwareSwitch.process_batch``) against the per-packet reference (``process``).

Identical packet traces (gradients, duplicates, collisions between jobs and fragments, resends of held
and freed aggregates, ACKs, forged sources, garbage, ECN depths, saturating sums, stale reclaims, level-0
and level-1 jobs) go through both; outputs (in order), counters and every register must be identical.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from innet.control import JobEntry, MulticastGroup
from innet.switch import SoftwareSwitch
from innet.wire import Packet, encode, packet_size

PS1, PS2 = 100, 101
MEMBERS = {1: (1, 2, 3), 2: (4, 5)}


def _switch(V: int, n_agg: int, level: int, ecn_threshold: int) -> SoftwareSwitch:
    sw = SoftwareSwitch(n_agg, V, ecn_threshold=ecn_threshold, stale_timeout=1.0)
    for p in range(1, 7):
        sw.set_port(p, ("127.0.0.1", 40000 + p))
    sw.set_port(PS1, ("127.0.0.1", 41000))     # PS2 has no address: its packets are dropped and counted
    sw.insert_mcast_group(MulticastGroup(1, (1, 2, 3)))
    sw.insert_mcast_group(MulticastGroup(2, (4, 5, 6)))
    sw.insert_job(JobEntry(1, 3, PS1, 1, level))
    sw.insert_job(JobEntry(2, 2, PS2 if level else PS1, 2 if level == 0 else 9, 0))
    for j, ports in MEMBERS.items():
        for p in ports:
            sw.insert_member(j, p)
    return sw


def _trace(rng: random.Random, V: int, n_agg: int, level: int, n: int) -> list[tuple[bytes, int, int]]:
    """n packets (bytes, in_port, queue_depth) of two jobs on few aggregators, with every kind of event."""
    out: list[tuple[bytes, int, int]] = []
    big = 2**31 - 5
    for _ in range(n):
        job = rng.choice((1, 1, 1, 2))
        seq = rng.randrange(6)
        idx = rng.randrange(2 * n_agg)
        kind = rng.random()
        depth = rng.choice((0, 0, 0, 5, 80))
        if rng.random() < 0.3:
            vals = np.array([rng.choice((big, -big, 7, -3)) for _ in range(V)], np.int32)
        else:
            vals = np.array([rng.randrange(-1000, 1000) for _ in range(V)], np.int32)
        port = rng.choice(MEMBERS[job])
        if rng.random() < 0.05:
            port = rng.choice((7, 0xFFFFFFFF, PS1))          # forged source
        flags = {}
        if kind < 0.15:
            flags["is_ack"] = True
            port = PS1 if job == 1 or level == 0 else PS2
            if rng.random() < 0.1:
                port = 2                                   # a forged ACK
        elif kind < 0.27:
            flags["resend"] = True
        elif kind < 0.30:
            flags[rng.choice(("overflow", "collision", "edge"))] = True
        if level and job == 1 and not flags.get("is_ack"):
            # level-1 packets: rack aggregates keyed by bitmap1 (multi-bit keys overlap partially)
            b0 = rng.choice((0b111, 0b111, 0b011))
            b1 = rng.randrange(1, 8)
            flags.setdefault("edge", rng.random() < 0.9)
        else:
            b0 = 1 << rng.randrange(3 if job == 1 else 2)
            if rng.random() < 0.05:
                b0 = 0b11
            b1 = 1
        data = encode(Packet(job_id=job, seq=seq, values=vals, bitmap0=b0, bitmap1=b1, fan_in0=3,
                             fan_in1=rng.choice((1, 3)), agg_index=idx, **flags))
        r = rng.random()
        if r < 0.02:
            data = data[:-1]                               # short
        elif r < 0.03:
            data = data + b"\0"                            # long
        elif r < 0.04:
            data = data[:12] + b"\0\0\0\x05" + data[16:]   # job 0
        elif r < 0.05:
            data = data[:12] + b"\x09" + data[13:]         # unknown job 9
        out.append((data, port, depth))
        if rng.random() < 0.1:
            out.append(out[-1])                            # duplicate right behind
    return out


def _registers(sw: SoftwareSwitch) -> dict:
    return {k: getattr(sw, k).copy() for k in ("_job_seq", "_bitmap", "_counter", "_ecn", "_timestamp",
                                                "_values", "_meta_index", "_meta_b1", "_meta_fan", "_collided")}


def _run_both(trace, V, n_agg, level, rng):
    ref = _switch(V, n_agg, level, ecn_threshold=64)
    bat = _switch(V, n_agg, level, ecn_threshold=64)
    size = packet_size(V)
    now = 0.0
    pos = 0
    while pos < len(trace):
        k = rng.choice((1, 2, 7, 32, 200))
        chunk = trace[pos:pos + k]
        pos += k
        now += rng.choice((0.0, 0.01, 0.6))
        expected = []
        for data, port, depth in chunk:
            expected.extend(ref.process(data, port, now, queue_depth=depth))
        rows = np.zeros((len(chunk), size + 1), np.uint8)
        lengths = []
        for i, (data, _, _) in enumerate(chunk):
            m = min(len(data), size + 1)
            rows[i, :m] = np.frombuffer(data[:m], np.uint8)
            lengths.append(m)
        got = bat.process_batch(rows, lengths, [p for _, p, _ in chunk], now,
                                [d for _, _, d in chunk])
        assert got == expected, f"outputs differ in the chunk at {pos - len(chunk)}"
        assert bat.counters() == ref.counters()
        assert bat.extra == ref.extra
    ra, rb = _registers(ref), _registers(bat)
    for k in ra:
        assert np.array_equal(ra[k], rb[k]), k
    return ref


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("seed", range(12))
def test_batch_equals_reference_on_random_traces(level: int, seed: int) -> None:
    rng = random.Random(seed * 31 + level)
    V = rng.choice((1, 4, 62))
    n_agg = rng.choice((1, 3, 8))
    ref = _run_both(_trace(rng, V, n_agg, level, 600), V, n_agg, level, rng)
    c = ref.counters()
    # the traces exercise every path (else the comparison proves little)
    assert min(c["aggregated"], c["collisions"], c["resends"], c["acks"], c["dropped"], c["rejected"],
               c["ecn_marked"], c["forwarded"]) > 0, c
    assert ref.extra["emitted"] > 0 and ref.extra["flushed"] > 0


def test_batch_equals_reference_on_a_clean_allreduce_trace() -> None:
    """The common case: 3 workers' fragments, then the PS's ACKs, slots reused within one batch."""
    V, n_agg = 62, 16
    rng = random.Random(5)
    trace = []
    for seq in range(200):
        for w, port in enumerate((1, 2, 3)):
            vals = np.arange(V, dtype=np.int32) * (w + 1) + seq
            trace.append((encode(Packet(job_id=1, seq=seq, values=vals, bitmap0=1 << w, bitmap1=1,
                                        fan_in0=3, agg_index=seq % n_agg)), port, 0))
        if seq >= 4:
            trace.append((encode(Packet(job_id=1, seq=seq - 4, values=np.zeros(V, np.int32), bitmap0=7,
                                        bitmap1=1, fan_in0=3, agg_index=(seq - 4) % n_agg, is_ack=True)),
                          PS1, 0))
    ref = _run_both(trace, V, n_agg, 0, rng)
    assert ref.counters()["aggregated"] == 600 and ref.extra["emitted"] == 200
    assert ref.counters()["collisions"] == 0


def test_saturation_counted_like_the_reference() -> None:
    V = 2
    big = 2**31 - 10
    trace = []
    for seq, vals in enumerate(([[big, 1], [100, 1], [-200, 1]], [[-big, 0], [-100, 0], [300, 0]])):
        for w, v in enumerate(vals):
            trace.append((encode(Packet(job_id=1, seq=seq, values=np.array(v, np.int32), bitmap0=1 << w,
                                        bitmap1=1, fan_in0=3, agg_index=seq)), w + 1, 0))
    ref = _run_both(trace, V, 4, 0, random.Random(1))
    assert ref.extra["saturated"] == 2
