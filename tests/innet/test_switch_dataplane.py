"""Unit tests of the software switch's pure packet function (no sockets) and its control API."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from innet.control import AlreadyExists, InvalidArgument, JobEntry, MulticastGroup, NotFound
from innet.ps import ParameterServer, PSJobConfig
from innet.switch import COUNTER_NAMES, SoftwareSwitch
from innet.wire import Packet, decode, encode

V = 4
PS = 100


def make_switch(fan_in: int = 3, n_agg: int = 8, level: int = 0, jobs=(1,), **kw) -> SoftwareSwitch:
    sw = SoftwareSwitch(n_agg, V, **kw)
    for p in range(1, 9):
        sw.set_port(p, ("127.0.0.1", 40000 + p))
    sw.set_port(PS, ("127.0.0.1", 41000))
    sw.set_port(PS + 1, ("127.0.0.1", 41001))
    sw.insert_mcast_group(MulticastGroup(1, (1, 2, 3)))
    sw.insert_mcast_group(MulticastGroup(2, (4, 5)))
    for j in jobs:
        sw.insert_job(JobEntry(j, fan_in, PS if j == 1 else PS + 1, 1 if j == 1 else 2, level))
        for p in ((1, 2, 3) if j == 1 else (4, 5)):
            sw.insert_member(j, p)
    return sw


def grad(seq: int, worker: int, values, *, job: int = 1, idx: int = 0, fan0: int = 3, rack: int = 0,
         **flags) -> bytes:
    return encode(Packet(job_id=job, seq=seq, values=np.asarray(values, np.int32), bitmap0=1 << worker,
                         bitmap1=1 << rack, fan_in0=fan0, fan_in1=1, agg_index=idx, **flags))


def ack(seq: int, *, job: int = 1, idx: int = 0) -> bytes:
    return encode(Packet(job_id=job, seq=seq, values=np.zeros(V, np.int32), bitmap0=7, bitmap1=1,
                         fan_in0=3, agg_index=idx, is_ack=True))


def test_reserve_hit_complete_and_hold_until_ack() -> None:
    sw = make_switch()
    vals = [np.array([1, 2, 3, 4]), np.array([10, -20, 30, 0]), np.array([-5, 5, 7, 2**20])]
    assert sw.process(grad(5, 0, vals[0], idx=3), 1, 0.0) == []
    st0 = sw.read_aggregator(3)
    assert (st0.job_seq, st0.bitmap, st0.counter) == ((1 << 24) | 5, 1, 1)
    assert np.array_equal(st0.values, vals[0])
    assert sw.process(grad(5, 1, vals[1], idx=3), 2, 0.1) == []
    out = sw.process(grad(5, 2, vals[2], idx=3), 3, 0.2)
    assert len(out) == 1 and out[0][0] == PS
    p = decode(out[0][1], V)
    assert (p.job_id, p.seq, p.bitmap0, p.bitmap1, p.agg_index) == (1, 5, 0b111, 1, 3)
    assert p.edge and not p.resend and not p.is_ack and not p.collision
    assert np.array_equal(p.values, np.sum(vals, axis=0))
    assert sw.read_aggregator(3).counter == 3          # still held: a lost aggregate can be re-sent
    mc = sw.process(ack(5, idx=3), PS, 0.3)
    assert sorted(port for port, _ in mc) == [1, 2, 3]
    assert all(decode(d, V).is_ack for _, d in mc)
    assert sw.read_aggregator(3).job_seq == 0
    c = sw.counters()
    assert set(c) == set(COUNTER_NAMES)
    assert (c["aggregated"], c["acks"], c["collisions"]) == (3, 1, 0)


def test_duplicate_is_not_added_twice() -> None:
    sw = make_switch()
    sw.process(grad(1, 0, [1, 1, 1, 1]), 1, 0.0)
    assert sw.process(grad(1, 0, [1, 1, 1, 1]), 1, 0.0) == []
    s = sw.read_aggregator(0)
    assert (s.counter, s.values.tolist()) == (1, [1, 1, 1, 1])
    assert sw.counters()["dropped"] == 1


def test_collision_forwards_unaggregated_with_flag() -> None:
    sw = make_switch(jobs=(1, 2))
    sw.process(grad(1, 0, [1, 2, 3, 4], idx=2), 1, 0.0)
    payload = [9, 8, 7, 6]
    for job, seq, port, src in ((1, 2, PS, 2), (2, 1, PS + 1, 4)):   # same job other seq; other job
        out = sw.process(grad(seq, 1, payload, job=job, idx=2), src, 0.0)
        assert len(out) == 1 and out[0][0] == port
        p = decode(out[0][1], V)
        assert p.collision and not p.edge and (p.job_id, p.seq) == (job, seq)
        assert p.values.tolist() == payload
    assert sw.counters()["collisions"] == 2
    assert sw.read_aggregator(2).values.tolist() == [1, 2, 3, 4]


def test_resend_flushes_partial_and_frees() -> None:
    sw = make_switch()
    sw.process(grad(4, 0, [1, 0, 0, 0], idx=1), 1, 0.0)
    sw.process(grad(4, 1, [0, 2, 0, 0], idx=1), 2, 0.0)
    out = sw.process(grad(4, 2, [0, 0, 3, 0], idx=1, resend=True), 3, 0.0)
    assert [port for port, _ in out] == [PS, PS]
    flush, fwd = decode(out[0][1], V), decode(out[1][1], V)
    assert flush.resend and flush.edge and flush.bitmap0 == 0b011 and flush.values.tolist() == [1, 2, 0, 0]
    assert fwd.resend and not fwd.edge and fwd.bitmap0 == 0b100 and fwd.values.tolist() == [0, 0, 3, 0]
    assert sw.read_aggregator(1).job_seq == 0
    # a resend with nothing held is just forwarded and reserves nothing
    out = sw.process(grad(4, 0, [1, 0, 0, 0], idx=1, resend=True), 1, 0.0)
    assert len(out) == 1 and decode(out[0][1], V).bitmap0 == 1
    assert sw.read_aggregator(1).job_seq == 0
    assert sw.counters()["resends"] == 2


def test_resend_of_complete_aggregate_re_emits_it() -> None:
    sw = make_switch(fan_in=2)
    sw.process(grad(7, 0, [1, 1, 1, 1], fan0=2), 1, 0.0)
    sw.process(grad(7, 1, [2, 2, 2, 2], fan0=2), 2, 0.0)       # complete (and suppose it was lost)
    out = sw.process(grad(7, 1, [2, 2, 2, 2], fan0=2, resend=True), 2, 0.0)
    flush = decode(out[0][1], V)
    assert flush.bitmap0 == 0b11 and flush.values.tolist() == [3, 3, 3, 3] and flush.resend


def test_ack_of_other_fragment_does_not_free() -> None:
    sw = make_switch()
    sw.process(grad(1, 0, [1, 1, 1, 1], idx=5), 1, 0.0)
    sw.process(ack(2, idx=5), PS, 0.0)
    assert sw.read_aggregator(5).job_seq == (1 << 24) | 1


def test_saturating_add() -> None:
    sw = make_switch(fan_in=2)
    big = 2**31 - 10
    sw.process(grad(1, 0, [big, -big, 5, 0], fan0=2), 1, 0.0)
    out = sw.process(grad(1, 1, [100, -100, -5, 0], fan0=2), 2, 0.0)
    assert decode(out[0][1], V).values.tolist() == [2**31 - 1, -(2**31), 0, 0]
    assert sw.extra["saturated"] == 1


def test_overflow_and_edge_packets_forwarded_at_level0() -> None:
    sw = make_switch()
    for kw in ({"overflow": True}, {"edge": True}):
        out = sw.process(grad(3, 0, [1, 2, 3, 4], **kw), 1, 0.0)
        assert len(out) == 1 and out[0][0] == PS and decode(out[0][1], V).values.tolist() == [1, 2, 3, 4]
    assert sw.read_aggregator(0).job_seq == 0
    assert sw.counters()["forwarded"] == 2


def test_stale_aggregator_is_reclaimed() -> None:
    sw = make_switch(stale_timeout=1.0)
    sw.process(grad(1, 0, [1, 1, 1, 1]), 1, 0.0)
    out = sw.process(grad(2, 0, [5, 5, 5, 5]), 1, 0.5)          # not stale yet: collision
    assert decode(out[0][1], V).collision
    assert sw.process(grad(3, 0, [5, 5, 5, 5]), 1, 1.6) == []   # stale: reclaimed and reserved
    s = sw.read_aggregator(0)
    assert s.job_seq == (1 << 24) | 3 and s.values.tolist() == [5, 5, 5, 5] and s.counter == 1
    assert sw.extra["reclaimed"] == 1
    assert sw.reclaim_stale(2.0) == 0
    assert sw.reclaim_stale(2.7) == 1 and sw.occupied() == 0


def test_a_collided_fragment_sends_its_later_packets_to_the_ps_too() -> None:
    """Job 2's fragment meets job 1's aggregator with its first packet; when the second arrives the
    aggregator is free, but reserving it would strand that contribution: it follows the first to the PS
    (the PS holds one of two, the switch the other, and neither completes until a resend)."""
    sw = make_switch(jobs=(1, 2))
    assert sw.process(grad(1, 0, [1, 1, 1, 1]), 1, 0.0) == []                # job 1 reserves slot 0
    out = sw.process(grad(7, 0, [2, 2, 2, 2], job=2), 4, 0.0)                 # job 2 collides
    assert out[0][0] == PS + 1 and decode(out[0][1], V).collision
    assert sw.read_aggregator(0).collided == (2 << 24) | 7
    sw.process(ack(1), PS, 0.1)                                                 # job 1 done: slot free
    assert sw.occupied() == 0
    out = sw.process(grad(7, 1, [3, 3, 3, 3], job=2), 5, 0.2)
    assert len(out) == 1 and out[0][0] == PS + 1                                # to the PS, unaggregated
    got = decode(out[0][1], V)
    assert got.collision and got.bitmap0 == 0b10 and got.values.tolist() == [3, 3, 3, 3]
    assert sw.occupied() == 0 and sw.counters()["collisions"] == 2
    # another fragment of job 2 is not affected; the fragment's parameter packet clears the mark
    assert sw.process(grad(8, 0, [4, 4, 4, 4], job=2), 4, 0.3) == [] and sw.occupied() == 1
    sw.process(ack(8, job=2), PS + 1, 0.3)
    sw.process(ack(7, job=2), PS + 1, 0.4)
    assert sw.read_aggregator(0).collided == 0
    assert sw.process(grad(7, 0, [5, 5, 5, 5], job=2), 4, 0.5) == [] and sw.read_aggregator(0).job_seq == (2 << 24) | 7


def test_deleting_a_job_clears_its_collision_marks() -> None:
    sw = make_switch(jobs=(1, 2))
    sw.process(grad(1, 0, [1, 1, 1, 1]), 1, 0.0)
    sw.process(grad(7, 0, [2, 2, 2, 2], job=2), 4, 0.0)
    sw.delete_job(2)
    assert sw.read_aggregator(0).collided == 0


def test_ecn_marking_by_queue_depth() -> None:
    sw = make_switch(fan_in=2, ecn_threshold=10)
    sw.process(grad(1, 0, [1, 1, 1, 1], fan0=2), 1, 0.0, queue_depth=10)      # not above threshold
    assert not sw.read_aggregator(0).ecn
    out = sw.process(grad(1, 1, [1, 1, 1, 1], fan0=2), 2, 0.0, queue_depth=11)
    assert sw.counters()["ecn_marked"] == 1
    assert decode(out[0][1], V).ecn
    fwd = sw.process(grad(2, 0, [1, 1, 1, 1], idx=1, fan0=2, overflow=True), 1, 0.0, queue_depth=50)
    assert decode(fwd[0][1], V).ecn
    sw.set_ecn_threshold(100)
    assert sw.ecn_threshold() == 100
    out = sw.process(ack(1), PS, 0.0, queue_depth=50)
    assert not any(decode(d, V).ecn for _, d in out)


def test_index_is_taken_modulo_and_bad_packets_dropped() -> None:
    sw = make_switch(n_agg=8)
    sw.process(grad(1, 0, [1, 1, 1, 1], idx=13), 1, 0.0)
    assert sw.read_aggregator(5).job_seq == (1 << 24) | 1
    good = grad(1, 1, [1, 1, 1, 1])
    assert sw.process(good[:-1], 1, 0.0) == []
    assert sw.process(b"\x00" * len(good), 1, 0.0) == []                 # job 0: garbled
    assert sw.process(grad(1, 0, [1, 1, 1, 1], job=9), 1, 0.0) == []    # unknown job
    assert sw.counters()["dropped"] == 3


def test_missing_port_or_group_drops() -> None:
    sw = make_switch(fan_in=1)
    sw.delete_port(PS)
    assert sw.process(grad(1, 0, [1, 1, 1, 1], fan0=1), 1, 0.0) == []
    sw.delete_mcast_group(1)
    assert sw.process(ack(1), PS, 0.0) == []
    assert sw.counters()["dropped"] == 2


def test_the_unknown_source_port_number_cannot_be_configured() -> None:
    """Port 2**32-1 is what a datagram from an unconfigured address enters on: a port configured with
    that number would let any forger's packets in as a registered member's."""
    from innet.switch_server import UNKNOWN_PORT
    sw = make_switch()
    with pytest.raises(InvalidArgument, match="unknown sources"):
        sw.set_port(UNKNOWN_PORT, ("127.0.0.1", 9))
    with pytest.raises(InvalidArgument):
        sw.insert_job(JobEntry(2, 3, UNKNOWN_PORT, 1, 0))
    sw.set_port(UNKNOWN_PORT - 1, ("127.0.0.1", 9))     # the largest real port number


def test_control_api_errors_and_reads() -> None:
    sw = make_switch()
    e = JobEntry(1, 3, PS, 1, 0)
    with pytest.raises(AlreadyExists):
        sw.insert_job(e)
    with pytest.raises(NotFound):
        sw.modify_job(JobEntry(5, 3, PS, 1, 0))
    with pytest.raises(NotFound):
        sw.delete_job(5)
    with pytest.raises(InvalidArgument):
        sw.insert_job(JobEntry(6, 33, PS, 1, 0))
    with pytest.raises(InvalidArgument):
        sw.insert_job(JobEntry(0, 3, PS, 1, 0))
    with pytest.raises(InvalidArgument):
        sw.insert_job(JobEntry(6, 3, PS, 1, 2))
    with pytest.raises(AlreadyExists):
        sw.insert_mcast_group(MulticastGroup(1, (1,)))
    with pytest.raises(NotFound):
        sw.modify_mcast_group(MulticastGroup(9, (1,)))
    with pytest.raises(NotFound):
        sw.delete_port(77)
    with pytest.raises(InvalidArgument):
        sw.set_port(-1, ("127.0.0.1", 1))
    with pytest.raises(InvalidArgument):
        sw.set_port(3, ("127.0.0.1", 0))
    with pytest.raises(InvalidArgument):
        sw.read_aggregator(8)
    with pytest.raises(InvalidArgument):
        sw.set_ecn_threshold(-1)
    sw.modify_job(JobEntry(1, 2, PS, 1, 0))
    assert sw.read_jobs() == [JobEntry(1, 2, PS, 1, 0)]
    assert sw.read_mcast_groups()[0] == MulticastGroup(1, (1, 2, 3))
    assert sw.read_ports()[PS] == ("127.0.0.1", 41000)
    sw.process(grad(1, 0, [1, 1, 1, 1], fan0=2), 1, 0.0)
    sw.delete_job(1)                                     # frees the job's aggregators
    assert sw.occupied() == 0 and sw.read_jobs() == []


def test_two_levels_aggregate_each_contribution_once() -> None:
    """Two racks of two workers: level-0 ToRs aggregate racks, the level-1 ToR aggregates racks."""
    tors = [SoftwareSwitch(4, V), SoftwareSwitch(4, V)]
    for t in tors:
        t.set_port(1, ("h", 1)), t.set_port(2, ("h", 2)), t.set_port(PS, ("l1", 9))
        t.insert_mcast_group(MulticastGroup(1, (1, 2)))
        t.insert_job(JobEntry(1, 2, PS, 1, level=0))
        t.insert_member(1, 1), t.insert_member(1, 2)
    l1 = SoftwareSwitch(4, V)
    l1.set_port(1, ("t0", 1)), l1.set_port(2, ("t1", 1)), l1.set_port(PS, ("ps", 1))
    l1.insert_mcast_group(MulticastGroup(1, (1, 2)))
    l1.insert_job(JobEntry(1, 2, PS, 1, level=1))
    l1.insert_member(1, 1), l1.insert_member(1, 2)
    rng = np.random.default_rng(1)
    vals = rng.integers(-1000, 1000, (2, 2, V))
    to_ps = []
    for r in range(2):
        for w in range(2):
            pkt = grad(9, w, vals[r, w], rack=r, fan0=2, idx=1)
            for _, up in tors[r].process(pkt, w + 1, 0.0):
                to_ps += l1.process(up, r + 1, 0.0)
    assert len(to_ps) == 1
    p = decode(to_ps[0][1], V)
    assert p.edge and p.bitmap0 == 0 and p.bitmap1 == 0b11
    assert np.array_equal(p.values, vals.sum(axis=(0, 1)))
    assert l1.counters()["aggregated"] == 2 and sum(t.counters()["aggregated"] for t in tors) == 4
    # a raw worker packet (no level-0 aggregation) and a partial rack pass level 1 unaggregated
    raw = grad(10, 0, vals[0, 0], rack=0, fan0=2, idx=2)
    assert [port for port, _ in l1.process(raw, 1, 0.0)] == [PS]
    partial = encode(decode(grad(10, 0, vals[0, 0], rack=0, fan0=2, idx=2), V).with_(edge=True))
    assert [port for port, _ in l1.process(partial, 1, 0.0)] == [PS]
    assert l1.read_aggregator(2).job_seq == 0


# ---------------------------------------------------------------------------------------------------
# A whole lossy network without sockets: workers -> level-0 ToRs -> (level-1 ToR) -> PS, and back.

class _Net:
    def __init__(self, racks: list[int], two_level: bool, n_agg: int, loss: float, seed: int) -> None:
        self.rng = random.Random(seed)
        self.loss = loss
        self.racks = racks
        self.two_level = two_level
        self.world = sum(racks)
        top = "l1" if two_level else "t0"
        self.ps = ParameterServer(value_count=V)
        self.ps.add_job(PSJobConfig(1, self.world, 1.0, switch_addr=(top, 0),
                                    rack_size=max(racks) if two_level else None))
        self.tors = []
        for r, k in enumerate(racks):
            t = SoftwareSwitch(n_agg, V)
            for i in range(k):
                t.set_port(i + 1, (f"w{r}", i + 1))
            t.set_port(PS, ("up", 1))
            t.insert_mcast_group(MulticastGroup(1, tuple(range(1, k + 1))))
            t.insert_job(JobEntry(1, k, PS, 1, level=0))
            for i in range(k):
                t.insert_member(1, i + 1)
            self.tors.append(t)
        if two_level:
            self.l1 = SoftwareSwitch(n_agg, V)
            for r in range(len(racks)):
                self.l1.set_port(r + 1, (f"t{r}", 1))
            self.l1.set_port(PS, ("ps", 1))
            self.l1.insert_mcast_group(MulticastGroup(1, tuple(range(1, len(racks) + 1))))
            self.l1.insert_job(JobEntry(1, len(racks), PS, 1, level=1))
            for r in range(len(racks)):
                self.l1.insert_member(1, r + 1)
        self.queue: list[tuple[str, int, bytes]] = []
        self.acks: dict[tuple[int, int], dict[int, np.ndarray]] = {}

    def send(self, node: str, port: int, data: bytes) -> None:
        if self.rng.random() >= self.loss:
            self.queue.append((node, port, data))

    def run(self, now: float) -> None:
        while self.queue:
            node, port, data = self.queue.pop(self.rng.randrange(len(self.queue)))
            if node.startswith("t"):
                r = int(node[1:])
                for out_port, out in self.tors[r].process(data, port, now):
                    if out_port == PS:
                        self.send("l1" if self.two_level else "ps", r + 1, out)
                    else:
                        self.send(f"w{r}", out_port - 1, out)
            elif node == "l1":
                for out_port, out in self.l1.process(data, port, now):
                    self.send("ps" if out_port == PS else f"t{out_port - 1}", PS, out)
            elif node == "ps":
                src = ("l1", 0) if self.two_level else ("t0", 0)
                for _addr, out in self.ps.handle(data, src, now):
                    self.send("l1" if self.two_level else "t0", PS, out)
            else:
                r = int(node[1:])
                p = decode(data, V)
                self.acks.setdefault((r, port), {})[p.seq] = p.float_values().copy()


@settings(max_examples=60, deadline=None)
@given(racks=st.lists(st.integers(1, 4), min_size=1, max_size=3), two_level=st.booleans(),
       n_agg=st.integers(1, 4), nseq=st.integers(1, 5), loss=st.sampled_from([0.0, 0.05, 0.2]),
       seed=st.integers(0, 2**16))
def test_lossy_network_result_exact_and_counted_once(racks, two_level, n_agg, nseq, loss, seed) -> None:
    if not two_level:
        racks = racks[:1]
    racks = [max(racks)] * (len(racks) - 1) + [racks[-1]]     # the PS's layout: full racks, last one may be short
    net = _Net(racks, two_level, n_agg, loss, seed)
    rng = np.random.default_rng(seed)
    vals = {(r, i): rng.integers(-1000, 1000, (nseq, V)) for r, k in enumerate(racks) for i in range(k)}
    expect = np.sum(list(vals.values()), axis=0)

    def pkt(r: int, i: int, s: int, resend: bool) -> bytes:
        return encode(Packet(1, s, vals[r, i][s].astype(np.int32), bitmap0=1 << i, bitmap1=1 << r,
                             fan_in0=racks[r], fan_in1=len(racks), agg_index=(s * 7) % n_agg, resend=resend))

    try:
        for s in range(nseq):
            for (r, i) in vals:
                net.send(f"t{r}", i + 1, pkt(r, i, s, False))
        for rnd in range(400):
            net.run(now=rnd * 0.01)
            missing = [(r, i, s) for (r, i) in vals for s in range(nseq)
                       if s not in net.acks.get((r, i), {})]
            if not missing:
                break
            for r, i, s in missing:                      # timeout: resend
                net.send(f"t{r}", i + 1, pkt(r, i, s, True))
        else:
            pytest.fail("the lossy network did not deliver every parameter packet")
        for key in vals:
            for s in range(nseq):
                assert np.array_equal(net.acks[key][s], expect[s].astype(np.float32)), (key, s)
    finally:
        net.ps.transport.close()


def test_packets_from_unregistered_sources_are_rejected_and_counted() -> None:
    """The source check: ACKs only from the job's PS port, gradients only from its member ports."""
    from innet.switch_server import UNKNOWN_PORT
    sw = make_switch(jobs=(1, 2))
    sw.process(grad(3, 0, [5, 5, 5, 5], idx=1), 1, 0.0)              # a real contribution is held
    before = sw.read_aggregator(1)
    # a forged result from a worker port, another job's PS port and an unknown address
    for port in (1, PS + 1, UNKNOWN_PORT):
        assert sw.process(ack(3, idx=1), port, 0.0) == []
    # forged contributions from another job's member port and from an unknown address
    for port in (4, UNKNOWN_PORT):
        assert sw.process(grad(3, 1, [10**6] * 4, idx=1), port, 0.0) == []
    after = sw.read_aggregator(1)
    assert (after.job_seq, after.bitmap, after.counter) == (before.job_seq, before.bitmap, before.counter)
    assert np.array_equal(after.values, before.values)
    c = sw.counters()
    assert c["rejected"] == 5 and c["acks"] == 0 and c["aggregated"] == 1
    # the registered sources still work
    assert [p for p, _ in sw.process(ack(3, idx=1), PS, 0.0)] == [1, 2, 3]
    sw.delete_member(1, 2)
    assert sw.process(grad(4, 1, [1, 1, 1, 1]), 2, 0.0) == [] and sw.counters()["rejected"] == 6


def test_ps_accepts_a_job_only_from_its_switch_and_its_workers() -> None:
    ps = ParameterServer(value_count=V)
    try:
        sw, w0, w1 = ("127.0.0.1", 9000), ("127.0.0.1", 9100), ("127.0.0.1", 9101)
        ps.add_job(PSJobConfig(1, 2, 1.0, switch_addr=sw, workers=(w0, w1)))
        forged = grad(0, 0, [100, 100, 100, 100], fan0=2)
        assert ps.handle(forged, ("127.0.0.1", 9999), 0.0) == []        # unregistered address
        assert ps.handle(forged, w1, 0.0) == []                         # rank 1 speaking for rank 0
        as_switch = encode(decode(grad(0, 0, [1, 1, 1, 1], fan0=2), V).with_(edge=True, bitmap0=3))
        assert ps.handle(as_switch, w0, 0.0) == []                      # a worker posing as the switch
        assert ps.rejected == 3 and ps.stats(1).rejected == 3
        assert ps.handle(grad(0, 0, [1, 2, 3, 4], fan0=2), w0, 0.0) == []
        out = ps.handle(grad(0, 1, [1, 1, 1, 1], fan0=2), sw, 0.0)
        assert sorted(a for a, _ in out) == [sw, w0]                  # to the switch and to direct rank 0
        assert np.array_equal(decode(out[0][1], V).float_values(), [2, 3, 4, 5])
    finally:
        ps.transport.close()
