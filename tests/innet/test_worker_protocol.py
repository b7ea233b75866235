"""The worker's protocol against a scripted fake switch: fast retransmit, timeouts, ACK filtering, indices."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from innet.worker import AtpWorker, aggregator_index, rehash_index
from innet.wire import Packet, decode, encode

pytestmark = pytest.mark.timeout(60)
V = 4
N_AGG = 64


class FakeSwitch:
    """A UDP socket standing in for the switch; the test decides which ACKs to send."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(5.0)
        self.worker_addr: tuple[str, int] | None = None
        self.index_of: dict[int, int] = {}

    @property
    def address(self) -> tuple[str, int]:
        return self.sock.getsockname()

    def recv(self) -> Packet:
        data, addr = self.sock.recvfrom(65536)
        self.worker_addr = addr
        p = decode(data, V)
        self.index_of[p.seq] = p.agg_index
        return p

    def recv_n(self, n: int) -> list[Packet]:
        return [self.recv() for _ in range(n)]

    def ack(self, seq: int, values, *, job: int = 1, idx: int | None = None, bitmap0: int = 0b11,
            **flags) -> None:
        """A parameter packet as the PS of a 2-worker job sends it (index: the one the worker used)."""
        idx = self.index_of.get(seq, 0) if idx is None else idx
        self.sock.sendto(encode(Packet(job, seq, np.asarray(values, np.float32), bitmap0=bitmap0, bitmap1=1,
                                       agg_index=idx, is_ack=True, **flags)), self.worker_addr)

    def close(self) -> None:
        self.sock.close()


def _start(worker: AtpWorker, x: np.ndarray):
    box: dict = {}

    def run() -> None:
        try:
            box["out"] = worker.allreduce_sum(x)
        except BaseException as e:  # noqa: BLE001
            box["err"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _worker(fake: FakeSwitch, **kw) -> AtpWorker:
    opts = dict(value_count=V, num_aggregators=N_AGG, scale=1.0, max_window=16, initial_window=16,
                reorder_threshold=3, rto_initial=5.0, rto_min=5.0, fallback_timeout=30.0)
    opts.update(kw)
    return AtpWorker(1, 0, 2, fake.address, ("127.0.0.1", 9), **opts)


def _six_fragments(w: AtpWorker, fake: FakeSwitch):
    """Start an allreduce of 6 fragments (values 0..6V-1) on ``w``; its thread, result box, and the six
    packets as the fake switch got them."""
    t, box = _start(w, np.arange(6 * V, dtype=np.float32))
    return t, box, fake.recv_n(6)


def test_fast_retransmit_and_ack_filtering() -> None:
    fake = FakeSwitch()
    w = _worker(fake)
    try:
        t, box, sent = _six_fragments(w, fake)
        assert [p.seq for p in sent] == list(range(6))
        assert not any(p.resend for p in sent)
        assert np.array_equal(sent[2].values, np.arange(8, 12))             # scale 1: exact ints
        results = {s: np.full(V, 100 + s, np.float32) for s in range(6)}
        for s in (1, 2, 3):                                                 # seq 0 overtaken 3 times
            fake.ack(s, results[s], idx=sent[s].agg_index)
        re = fake.recv()
        assert re.seq == 0 and re.resend and np.array_equal(re.values, sent[0].values)
        fake.ack(2, results[2])                                             # duplicate
        fake.ack(3, np.zeros(V), job=2)                                     # another job: stale
        fake.ack(4000, np.zeros(V))                                         # never sent: stale
        for s in (0, 4, 5):
            fake.ack(s, results[s], ecn=(s == 4))
        t.join(10)
        out, stats = box["out"]
        assert np.array_equal(out, np.concatenate([results[s] for s in range(6)]))
        assert stats.fast_retransmits == 1 and stats.timeouts == 0
        assert stats.duplicate_acks == 1 and stats.stale_acks == 2
        assert stats.ecn_signals == 1 and stats.min_window <= 8
    finally:
        w.close()
        fake.close()


@pytest.mark.parametrize("collided,ecn", [(True, False), (False, False), (True, True)],
                         ids=["collided", "lost", "collided-after-ecn"])
def test_a_late_collided_fragment_takes_its_window_decrease_back(collided: bool, ecn: bool) -> None:
    """Overtaken by three later results, fragment 0 is retransmitted and the window halved; its result
    then comes back with the collision flag (it took the longer way through the PS: late, not lost) and
    the decrease is undone. Without the flag the loss stands; so it does when an ECN mark arrives before
    the collided result (the path is congested after all)."""
    fake = FakeSwitch()
    w = _worker(fake)
    try:
        t, box, sent = _six_fragments(w, fake)
        results = {s: np.full(V, 100 + s, np.float32) for s in range(6)}
        for s in (1, 2, 3):
            fake.ack(s, results[s], idx=sent[s].agg_index)
        assert fake.recv().seq == 0                                         # the fast retransmit
        if ecn:
            fake.ack(4, results[4], ecn=True)
        fake.ack(0, results[0], collision=collided)
        for s in (4, 5) if not ecn else (5,):
            fake.ack(s, results[s])
        t.join(10)
        out, stats = box["out"]
        assert np.array_equal(out, np.concatenate([results[s] for s in range(6)]))
        assert stats.fast_retransmits == 1 and stats.min_window == (4 if ecn else 8)
        assert stats.ecn_signals == int(ecn)
        if collided and not ecn:
            assert stats.collision_undos == 1 and stats.final_window == 16
        else:
            assert stats.collision_undos == 0 and stats.final_window < 9
    finally:
        w.close()
        fake.close()


def _until_acked(w: AtpWorker, n: int) -> None:
    """Until the worker's call in progress has taken ``n`` results (it counts them per received batch)."""
    deadline = time.monotonic() + 30
    while w.acked_fragments < n:
        assert time.monotonic() < deadline, f"{w.acked_fragments} of {n} results taken"
        time.sleep(0.001)


def test_a_spurious_fast_retransmit_raises_the_reorder_threshold() -> None:
    """Fragment 0 overtaken by three results is fast-retransmitted, one more result overtakes it, then
    its result comes back collided: the retransmission was spurious, so the threshold becomes what was
    seen (4 + 1). The next call tolerates four overtaking results without a retransmission (the fixed
    threshold of old code resent at three)."""
    fake = FakeSwitch()
    w = _worker(fake)
    try:
        t, box, sent = _six_fragments(w, fake)
        results = {s: np.full(V, 100 + s, np.float32) for s in range(6)}
        for s in (1, 2, 3):
            fake.ack(s, results[s])
        assert fake.recv().seq == 0                                         # the fast retransmit
        fake.ack(4, results[4])
        _until_acked(w, 4)
        fake.ack(0, results[0], collision=True)
        fake.ack(5, results[5])
        t.join(10)
        stats = box["out"][1]
        assert stats.fast_retransmits == 1 and stats.reorder_raises == 1
        assert stats.reorder_threshold == 5 and w.reorder == 5

        t, box, sent = _six_fragments(w, fake)
        seqs = [p.seq for p in sent]
        for s in seqs[1:5]:
            fake.ack(s, results[s - seqs[0]])
        _until_acked(w, 4)                                                  # the four are handled
        fake.ack(seqs[0], results[0])
        fake.ack(seqs[5], results[5])
        t.join(10)
        stats = box["out"][1]
        assert stats.fast_retransmits == 0 and stats.reorder_threshold == 5
        fake.sock.settimeout(0)
        with pytest.raises(BlockingIOError):
            fake.sock.recvfrom(65536)                                       # nothing was resent
    finally:
        w.close()
        fake.close()


def test_a_retransmission_timeout_puts_the_reorder_threshold_back() -> None:
    fake = FakeSwitch()
    w = _worker(fake, rto_initial=0.05, rto_min=0.05)
    w.reorder = 10                  # raised by spurious retransmissions before
    try:
        t, box, sent = _six_fragments(w, fake)
        results = {s: np.full(V, 100 + s, np.float32) for s in range(6)}
        for s in range(1, 6):
            fake.ack(s, results[s])
        while (p := fake.recv()).seq != 0:                                  # resent when its RTO ran out
            pass
        assert p.resend
        fake.ack(0, results[0])
        t.join(10)
        stats = box["out"][1]
        assert stats.timeouts >= 1 and stats.fast_retransmits == 0
        assert stats.reorder_threshold == 3 and w.reorder == 3
    finally:
        w.close()
        fake.close()


def test_timeout_retransmits_with_resend_flag() -> None:
    fake = FakeSwitch()
    w = _worker(fake, rto_initial=0.1, rto_min=0.05)
    try:
        t, box = _start(w, np.ones(V, np.float32))
        first = fake.recv()
        t0 = time.monotonic()
        again = fake.recv()
        assert time.monotonic() - t0 >= 0.05
        assert again.seq == first.seq and again.resend and not first.resend
        fake.ack(0, np.full(V, 2.0))
        t.join(10)
        out, stats = box["out"]
        assert np.array_equal(out, np.full(V, 2.0, np.float32)) and stats.timeouts >= 1
    finally:
        w.close()
        fake.close()


def test_aggregator_slots_follow_the_parameter_packets() -> None:
    """seq s reuses the index of seq s - D, re-hashed when the PS reported a collision on it."""
    fake = FakeSwitch()
    D = 4
    w = _worker(fake, max_window=D, initial_window=D)
    try:
        t, box = _start(w, np.zeros(2 * D * V, np.float32))
        first = fake.recv_n(D)
        assert [p.agg_index for p in first] == [aggregator_index(1, s, N_AGG) for s in range(D)]
        for s in range(D):
            fake.ack(s, np.zeros(V), collision=(s == 1))
        second = fake.recv_n(D)
        assert [p.seq for p in second] == list(range(D, 2 * D))
        expect = [first[0].agg_index, rehash_index(first[1].agg_index, D + 1, N_AGG),
                  first[2].agg_index, first[3].agg_index]
        assert [p.agg_index for p in second] == expect
        for s in range(D, 2 * D):
            fake.ack(s, np.zeros(V))
        t.join(10)
        assert box["out"][1].collided_fragments == 1
    finally:
        w.close()
        fake.close()


def test_worker_takes_only_results_that_can_be_its_own() -> None:
    """A parameter packet with another aggregator index or a partial bitmap, or from an address that is
    neither the switch nor the PS, is rejected; the real one is taken."""
    fake = FakeSwitch()
    w = _worker(fake)
    stranger = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    stranger.bind(("127.0.0.1", 0))
    try:
        t, box = _start(w, np.ones(V, np.float32))
        sent = fake.recv()
        fake.ack(0, np.full(V, 666.0), idx=(sent.agg_index + 1) % N_AGG)   # another aggregator
        fake.ack(0, np.full(V, 666.0), bitmap0=0b01)                        # one worker's "sum"
        stranger.sendto(encode(Packet(1, 0, np.full(V, 666.0, np.float32), bitmap0=3, bitmap1=1,
                                      agg_index=sent.agg_index, is_ack=True)), fake.worker_addr)
        # (one sending socket: loopback keeps the order, so the worker sees the forgeries first)
        fake.ack(0, np.full(V, 2.0))
        t.join(10)
        out, stats = box["out"]
        assert np.array_equal(out, np.full(V, 2.0, np.float32))
        assert stats.rejected_acks == 2          # the stranger is filtered by the connected socket
    finally:
        w.close()
        fake.close()
        stranger.close()


def test_worker_rejects_bad_configuration() -> None:
    with pytest.raises(ValueError, match="rank"):
        AtpWorker(1, 2, 2, None, ("127.0.0.1", 9))
    with pytest.raises(ValueError, match="job_id"):
        AtpWorker(0, 0, 2, None, ("127.0.0.1", 9))
    with pytest.raises(ValueError, match="per rack"):
        AtpWorker(1, 0, 40, None, ("127.0.0.1", 9))
    with pytest.raises(ValueError, match="num_aggregators"):
        AtpWorker(1, 0, 2, None, ("127.0.0.1", 9), num_aggregators=0)


def test_call_timeout_is_seconds_not_the_window_bound() -> None:
    """A one-fragment call answered after 1.5 s succeeds within its 60 s timeout (the send loop's
    window bound, a fragment count, once overwrote the call's time limit: 1 fragment = 1 second)."""
    fake = FakeSwitch()
    w = _worker(fake, timeout=60.0)
    try:
        t, box = _start(w, np.ones(V, np.float32))
        fake.recv()
        time.sleep(1.5)        # the delay under test: a slow PS / loaded host
        fake.ack(0, np.full(V, 2.0))
        t.join(30)
        assert "err" not in box, box.get("err")
        out, _ = box["out"]
        assert np.array_equal(out, np.full(V, 2.0, np.float32))
    finally:
        w.close()
        fake.close()


def test_results_queued_during_a_stall_are_read_before_the_timeout_pass() -> None:
    """The worker stalls (a loaded host) while the results of 600 fragments arrive; it reads them all
    before looking for late fragments, so none is resent (it used to read 256 and resend the rest)."""
    fake = FakeSwitch()
    fake.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)    # the whole burst fits
    w = _worker(fake, max_window=1024, initial_window=1024, rto_initial=0.5, rto_min=0.5,
                reorder_threshold=0)
    calls = []

    def stall() -> None:
        calls.append(1)
        if len(calls) == 2:        # after the first window went out: longer than the RTO
            time.sleep(3.0)

    try:
        box: dict = {}

        def run() -> None:
            try:
                box["out"] = w.allreduce_sum(np.ones(600 * V, np.float32), abort=stall)
            except BaseException as e:  # noqa: BLE001
                box["err"] = e
        t = threading.Thread(target=run, daemon=True)
        t.start()
        seqs: set[int] = set()
        while len(seqs) < 600:
            seqs.add(fake.recv().seq)
        for seq in sorted(seqs):
            fake.ack(seq, np.full(V, 2.0))
        t.join(30)
        assert "err" not in box, box.get("err")
        out, stats = box["out"]
        assert np.array_equal(out, np.full(600 * V, 2.0, np.float32))
        assert calls[1:2] == [1]            # the stall happened
        assert stats.timeouts == 0 and stats.retransmits == 0
    finally:
        w.close()
        fake.close()
