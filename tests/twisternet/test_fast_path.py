"""The small-message fast path: the sending thread writes to an idle link itself, owed credit rides with
data, releases by a running thread wake nobody, and the busy-poll window follows ``busy_poll_us``."""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import os

import pytest

from channels import tcp
from channels.tcp import CreditLedger, TCPChannel, _Peer
from twisternet.config import Config, busy_poll_seconds
from twisternet.errors import ConfigError


class _Recorder:
    def __init__(self) -> None:
        self.messages: list[tuple[int, int, bytes]] = []
        self.releases: list = []
        self.sent: list[object] = []
        self.lost: list[tuple[int, str]] = []

    def on_message(self, peer, edge, data, release):
        self.messages.append((peer, edge, bytes(data)))
        self.releases.append(release)

    def on_credit(self, peer, edge):
        pass

    def on_sent(self, token):
        self.sent.append(token)

    def on_peer_lost(self, peer, reason):
        self.lost.append((peer, reason))


def _pair():
    a, b = socket.socketpair()
    cfg = Config(buffer_size=64 << 10, buffer_count=4, heartbeat_interval=30.0, peer_timeout=60.0)
    ch0 = TCPChannel(0, 2, cfg, {1: _Peer(1, a, "unix")}, [], b"t" * 16)
    ch1 = TCPChannel(1, 2, cfg, {0: _Peer(0, b, "unix")}, [], b"t" * 16)
    h0, h1 = _Recorder(), _Recorder()
    ch0.start(h0)
    ch1.start(h1)
    return ch0, ch1, h0, h1, a, b


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def test_small_send_on_idle_link_is_written_by_the_sender() -> None:
    """Old code queued the frame until the next progress round: nothing reached the socket in send()."""
    ch0, ch1, h0, h1, a, b = _pair()
    try:
        token = object()
        assert ch0.send(1, 7, [b"x" * 1000], token)
        assert _readable(b), "send() on an idle link should write the frame at once"
        assert h0.sent == [token] and not ch0.has_pending()
        ch1.progress(0.5)
        assert h1.messages == [(0, 7, b"x" * 1000)]
    finally:
        ch0.abort("test over")
        ch1.abort("test over")


def test_owed_credit_rides_with_the_next_message() -> None:
    """Old code returned credit in a CREDIT frame of its own, only after CREDIT_DELAY; now a message to
    the peer that is owed credit carries it in front, at once."""
    ch0, ch1, h0, h1, a, b = _pair()
    try:
        assert ch0.send(1, 3, [b"y" * 500])
        ch1.progress(0.5)
        assert ch0._inflight[(1, 3)] == 500
        h1.releases.pop()()                      # the core is done with it: 500 bytes owed to rank 0
        assert ch1.send(0, 9, [b"reply"])        # at once, well before CREDIT_DELAY
        ch0.progress(0.5)
        assert h0.messages == [(1, 9, b"reply")]
        assert ch0._inflight[(1, 3)] == 0, "the credit should have come back with the reply"
        assert not ch1._ledger.owes
    finally:
        ch0.abort("test over")
        ch1.abort("test over")


@pytest.mark.parametrize("edges", [1, 2])
def test_a_small_message_carries_the_owed_credit_in_its_own_frame(edges: int) -> None:
    """send_small to a peer owed one credit return sends one DATA_CREDIT frame (credit and message);
    owed on two edges, CREDIT frames and then the DATA frame. Either way the receiver gets the credit
    back, then the message, with its own credit charged and released at its size."""
    ch0, ch1, h0, h1, a, b = _pair()
    try:
        for e in range(edges):
            assert ch0.send(1, 3 + e, [b"y" * (500 + e)])
        _until_messages(ch1, h1, edges)
        assert [ch0._inflight[(1, 3 + e)] for e in range(edges)] == [500 + e for e in range(edges)]
        for release in h1.releases:
            release()
        h1.releases.clear()
        sent = []
        ch1._peers[0].sock = _Spy(ch1._peers[0].sock, sent)
        assert ch1.send_small(0, 9, [b"re", b"ply"], 5)
        kinds = [tcp._HDR.unpack_from(buf, 0)[0] for buf in sent]
        assert kinds == [tcp.DATA_CREDIT if edges == 1 else tcp.CREDIT]
        _until_messages(ch0, h0, 1)
        assert h0.messages == [(1, 9, b"reply")]
        assert all(ch0._inflight.get((1, 3 + e), 0) == 0 for e in range(edges)), "credit should be back"
        assert ch1._inflight[(0, 9)] == 5 and not ch1._ledger.owes
        h0.releases.pop()()
        assert ch0.send_small(1, 4, [b"ok"], 2)         # the 5 bytes go back with it
        _until_messages(ch1, h1, edges + 1)
        assert ch1._inflight.get((0, 9), 0) == 0 and h1.messages[-1] == (0, 4, b"ok")
    finally:
        ch0.abort("test over")
        ch1.abort("test over")


def test_a_data_credit_frame_too_short_for_its_credit_is_a_protocol_error() -> None:
    ch0, ch1, h0, h1, a, b = _pair()
    try:
        a.sendall(tcp._HDR.pack(tcp.DATA_CREDIT, 9, 4) + b"abcd")
        deadline = time.monotonic() + 10
        while not h1.lost and time.monotonic() < deadline:
            ch1.progress(0.01)
        assert h1.lost and "bad frame header" in h1.lost[0][1] and not h1.messages
    finally:
        ch0.abort("test over")
        ch1.abort("test over")


class _Spy:
    """A socket whose send() records what it writes."""

    def __init__(self, sock: socket.socket, sent: list) -> None:
        self._sock = sock
        self._sent = sent

    def send(self, data) -> int:
        self._sent.append(bytes(data))
        return self._sock.send(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def _until_messages(ch: TCPChannel, h: _Recorder, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(h.messages) < n and time.monotonic() < deadline:
        ch.progress(0.01)
    assert len(h.messages) >= n


def test_release_wakes_only_a_sleeping_poller() -> None:
    """Old code rang the channel's waker on every release, even from the thread running the round
    (a write and a spurious wake-up of the progress thread per message)."""
    wakes: list[int] = []
    ledger = CreditLedger(1 << 20, lambda: wakes.append(1))
    ledger.releaser(1, 0, 100)()
    assert wakes == [] and ledger.owes
    ledger.sleeping(1.0)
    try:
        ledger.releaser(1, 0, 100)()
    finally:
        ledger.awake()
    assert wakes == [1]
    assert ledger.take_owed(1) == [(0, 200)] and not ledger.owes


def test_owed_credit_is_due_in_quarter_batches_or_when_old() -> None:
    """due() returns a (peer, edge) once a quarter of its credit is owed (whatever took smaller
    amounts meanwhile) or once the oldest owed byte waited CREDIT_DELAY, and nothing before."""
    ledger = CreditLedger(4000, lambda: None)          # batches of 1000 bytes
    for _ in range(9):
        ledger.releaser(1, 0, 100)()
    ledger.releaser(2, 5, 900)()
    assert ledger.due() == []                          # 900 and 900: below the batch, and fresh
    assert ledger.take_owed(2) == [(5, 900)]           # piggybacked on a message to rank 2
    ledger.releaser(1, 0, 100)()
    assert ledger.due() == [(1, 0, 1000)] and not ledger.owes
    ledger.releaser(3, 1, 10)()
    assert ledger.take_owed(1) == [] and ledger.owes   # owed to another rank: kept for it
    ledger.releaser(1, 0, 999)()
    assert ledger.due() == []
    ledger._owed_since -= tcp.credit.CREDIT_DELAY      # (as if a millisecond passed)
    assert sorted(ledger.due()) == [(1, 0, 999), (3, 1, 10)] and not ledger.owes
    ledger.releaser(3, 1, 10)()
    assert ledger.due() == []                          # a fresh batch again: the peak was reset


def test_owed_credit_shortens_a_sleep() -> None:
    ledger = CreditLedger(1 << 20, lambda: None)
    ledger.releaser(1, 0, 100)()
    try:
        assert ledger.sleeping(5.0) <= tcp.credit.CREDIT_DELAY
    finally:
        ledger.awake()


def test_busy_poll_rule() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cfg = Config(spin_time=0.0003)
    assert busy_poll_seconds(cfg, cores, others=0) == pytest.approx(0.0003)   # fits the cores: poll
    assert busy_poll_seconds(cfg, cores + 1, others=0) == 0.0                  # oversubscribed: sleep
    assert busy_poll_seconds(cfg, 1, others=cores + 5) == 0.0                  # busy machine: sleep
    assert busy_poll_seconds(Config(busy_poll_us=50), cores + 1) == pytest.approx(50e-6)
    assert busy_poll_seconds(Config(busy_poll_us=0), 1) == 0.0
    # the MPI channel's own window (1 ms) follows the same rule: off for more ranks than cores
    assert busy_poll_seconds(cfg, cores, others=0, auto=1e-3) == pytest.approx(1e-3)
    assert busy_poll_seconds(cfg, cores + 1, others=0, auto=1e-3) == 0.0
    assert busy_poll_seconds(cfg, 1, others=cores + 5, auto=1e-3) == 0.0
    assert busy_poll_seconds(Config(busy_poll_us=20), cores + 1, auto=1e-3) == pytest.approx(20e-6)
    if cores > 1:
        assert busy_poll_seconds(cfg, cores - 1, others=1) == pytest.approx(0.0003)
    assert busy_poll_seconds(cfg, cores, others=1) == 0.0                      # one other program: sleep
    with pytest.raises(ConfigError):
        Config(busy_poll_us=-2)


@contextlib.contextmanager
def _spinning_program() -> Iterator[subprocess.Popen]:
    """A process beside this one that keeps a core busy (running once this yields it)."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("no /proc/PID/task on this system")
    hog = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdout.write('go\\n'); sys.stdout.flush()\n"
                            "while True: pass"], stdout=subprocess.PIPE, text=True)
    try:
        assert hog.stdout is not None and hog.stdout.readline() == "go\n"
        yield hog
    finally:
        hog.kill()
        hog.wait()


def test_runnable_elsewhere_sees_a_program_that_keeps_a_core_busy() -> None:
    """The reading behind busy_poll_us=-1 counts a process that keeps a core busy."""
    from twisternet import procfs
    with _spinning_program():
        procfs._RUNNABLE_CACHE.clear()
        assert procfs.runnable_elsewhere(samples=5, gap=0.002) >= 1
    seen = procfs.runnable_elsewhere()
    assert procfs.runnable_elsewhere(samples=1, gap=0) == seen        # cached for a second
    procfs._RUNNABLE_CACHE.clear()


def test_cpu_seconds_of_a_child_grow_while_it_runs_and_end_with_it() -> None:
    """What the benchmarks read of their helper processes: a child under this process in the tree,
    whose CPU time grows while it spins, and None once it has exited."""
    from twisternet import procfs
    with _spinning_program() as hog:
        assert hog.pid in procfs.children_by_parent().get(os.getpid(), [])
        first = procfs.cpu_seconds(hog.pid)
        assert first is not None
        deadline = time.monotonic() + 60
        while (procfs.cpu_seconds(hog.pid) or 0.0) <= first:
            assert time.monotonic() < deadline, "a spinning child used no CPU in 60 s"
            time.sleep(0.01)
        pid = hog.pid
    assert procfs.cpu_seconds(pid) is None


def test_a_reading_counts_other_programs_never_this_jobs_ranks() -> None:
    """One reading names the runnable threads outside this job: a spinning program started beside it
    is counted, the same program is not once its pid is part of the job, and the job is this process,
    its ancestors and the siblings that run its command line (the ranks one launcher started)."""
    from twisternet import procfs
    with _spinning_program() as hog:
        # a spinning thread is runnable whenever it is read (running or waiting for a CPU)
        assert hog.pid in {pid for pid, _ in procfs.foreign_runnable({os.getpid()})}
        assert hog.pid not in {pid for pid, _ in procfs.foreign_runnable({os.getpid(), hog.pid})}
        assert os.getpid() not in {pid for pid, _ in procfs.foreign_runnable({os.getpid()})}
    # The job as a rank sees it: two ranks of one command line under one parent, and a third child
    # of that parent running something else (a program the same shell started beside the job).
    script = """
import json, os, subprocess, sys
from twisternet import procfs
if sys.argv[1] == "rank":
    job = procfs._job_processes()
    print(json.dumps(job), flush=True)
    sys.stdin.read()        # (the first rank stays until the launcher is done)
    sys.exit()
other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
first = subprocess.Popen([sys.executable, __file__, "rank"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
first.stdout.readline()     # up and running
second = subprocess.run([sys.executable, __file__, "rank"], input=b"", stdout=subprocess.PIPE, check=True)
print(json.dumps({"job": json.loads(second.stdout), "launcher": os.getpid(), "other": other.pid,
                  "sibling": first.pid}), flush=True)
for p in (first, other):
    p.communicate(b"")
"""
    import json
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tree.py")
        with open(path, "w") as f:
            f.write(script)
        out = subprocess.run([sys.executable, path, "launch"], stdout=subprocess.PIPE, text=True, check=True,
                             timeout=60, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    job = seen["job"]
    assert seen["launcher"] in job and os.getpid() in job       # its ancestors (itself is job[0])
    assert seen["sibling"] in job                               # a rank of the same command line
    assert seen["other"] not in job                             # not a program started beside it
    assert len(job) == len(set(job))


def test_small_record_to_an_idle_stream_goes_at_once_unbatched() -> None:
    """Nagle's rule in the core: with nothing of the stream unacknowledged (Channel.idle) a small record
    is its own message at once; old code packed it and held it for ``flush_delay`` (here 1 s). While it
    is unacknowledged, the next record is batched as before."""
    import threading

    from channels.local import LocalChannel, LocalHub
    from twisternet.config import load_config
    from twisternet.context import Context
    from twisternet.context.streams import _BATCH, _DIRECT

    class Recording(LocalChannel):
        idle_now = True

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.kinds: list[bytes] = []

        def idle(self, peer, edge):
            return self.idle_now

        def send(self, peer, edge, parts, token=None):
            if edge == 5:
                self.kinds.append(bytes(memoryview(parts[0])[:1]))
            return super().send(peer, edge, parts, token)

    cfg = load_config(env={}, channel="local", flush_delay=1.0, timeout=30.0)
    hub = LocalHub(2)
    chans = [Recording(hub, r, cfg) for r in range(2)]
    got: list[object] = []
    arrived = threading.Event()
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            with Context(chans[rank], cfg) as ctx:
                if rank == 1:
                    ctx.register(5, lambda src, obj: (got.append(obj), arrived.set()) and True)
                    ctx.wait_until(lambda: len(got) == 3)
                else:
                    ctx.send(1, 5, b"first")
                    deadline = 20.0
                    assert arrived.wait(deadline) and chans[0].kinds == [_DIRECT]
                    chans[0].idle_now = False
                    ctx.send(1, 5, b"second")
                    ctx.send(1, 5, b"third")
                    ctx.flush()
                    ctx.wait_until(lambda: len(chans[0].kinds) == 2)
                    assert chans[0].kinds == [_DIRECT, _BATCH]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            hub.fail(rank, repr(e))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert got == [b"first", b"second", b"third"]


def test_send_small_writes_one_frame_at_once_with_owed_credit() -> None:
    """The channel's fast path: one frame, the credit owed to the peer in front of it, written inside
    send_small (no token, no queue); refused (nothing done) while the edge has bytes in flight."""
    ch0, ch1, h0, h1, a, b = _pair()
    try:
        assert ch1.send_small(0, 3, [b"p" * 300], 300)
        ch0.progress(0.5)
        assert h0.messages == [(1, 3, b"p" * 300)]
        h0.releases.pop()()                              # 300 bytes owed to rank 1
        assert not ch1.send_small(0, 3, [b"again"], 5), "bytes in flight on (0, 3): not idle"
        assert ch0.send_small(1, 8, [b"he", b"llo"], 5)
        assert _readable(b) and not ch0.has_pending() and h0.sent == []
        assert not ch0._ledger.owes
        ch1.progress(0.5)
        assert h1.messages == [(0, 8, b"hello")]
        assert ch1._inflight[(0, 3)] == 0, "the owed credit should have come in front of the message"
        assert ch1.send_small(0, 3, [b"again"], 5)
    finally:
        ch0.abort("test over")
        ch1.abort("test over")


def test_send_small_leaves_what_the_socket_refuses_to_the_engine() -> None:
    """A message larger than the socket takes at once: send_small writes what fits and queues the rest,
    which the engine's progress rounds write; the peer receives it whole and in order."""
    ch0, ch1, h0, h1, a, b = _pair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        big = bytes(range(256)) * 1024                  # 256 KiB: more than the socket buffers hold
        assert ch0.send_small(1, 4, [big], len(big))
        assert ch0.has_pending(1), "the rest should wait in the queue"
        assert not ch0.send_small(1, 5, [b"x"], 1), "a link with something queued is not idle"
        assert ch0.send(1, 5, [b"after"])
        for _ in range(2000):
            if len(h1.messages) == 2:
                break
            ch0.progress(0.01)
            ch1.progress(0.01)
        assert h1.messages == [(0, 4, big), (0, 5, b"after")]
        assert not ch0.has_pending()
    finally:
        ch0.abort("test over")
        ch1.abort("test over")


def _context_pair(**cfg_kw):
    from twisternet.config import load_config
    from twisternet.context import Context

    a, b = socket.socketpair()
    cfg = load_config(env={}, channel="tcp", timeout=60.0, heartbeat_interval=30.0, peer_timeout=60.0,
                      **cfg_kw)
    chans = [TCPChannel(0, 2, cfg, {1: _Peer(1, a, "unix")}, [], b"t" * 16),
             TCPChannel(1, 2, cfg, {0: _Peer(0, b, "unix")}, [], b"t" * 16)]
    return [Context(ch, cfg) for ch in chans], (a, b)


def test_context_send_writes_a_small_record_itself_without_the_engine() -> None:
    """With no progress thread and no progress call, a small record to an idle stream is on the socket
    when send() returns; old code queued it until the next progress round."""
    (c0, c1), (a, b) = _context_pair(progress="manual")
    got: list[object] = []
    try:
        c1.register(2, lambda src, obj: got.append((src, obj)) is None)
        c0.send(1, 2, {"k": 1})
        assert _readable(b), "the record should have been written by send()"
        c1.wait_until(lambda: len(got) == 1, timeout=30.0)
        assert got == [(0, {"k": 1})]
    finally:
        for c in (c0, c1):
            c.channel.abort("test over")


def test_threads_sending_small_records_while_a_waiter_drives_the_engine() -> None:
    """Several threads of rank 0 send small records on one edge (fast path or queued, as the engine is
    free or not) while rank 1's main thread waits for replies and sends them: every record arrives once,
    each thread's in order, and every reply wait sees its reply."""
    import threading

    (c0, c1), _ = _context_pair()
    n_threads, per_thread, pings = 3, 300, 200
    seen: dict[int, list[int]] = {t: [] for t in range(n_threads)}
    pongs: list[int] = []
    pinged: list[int] = []
    errors: list[BaseException] = []
    try:
        c1.register(1, lambda src, obj: seen[obj[0]].append(obj[1]) is None)
        c1.register(2, lambda src, obj: pinged.append(obj) is None)
        c0.register(3, lambda src, obj: pongs.append(obj) is None)

        def streamer(t: int) -> None:
            try:
                for i in range(per_thread):
                    c0.send(1, 1, (t, i))
                c0.flush()
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def responder() -> None:
            try:
                for i in range(pings):
                    c1.wait_until(lambda i=i: len(pinged) > i, timeout=60.0)
                    c1.send(0, 3, pinged[i])
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=streamer, args=(t,)) for t in range(n_threads)]
        threads.append(threading.Thread(target=responder))
        for t in threads:
            t.start()
        for i in range(pings):
            c0.send(1, 2, i)
            c0.wait_until(lambda i=i: len(pongs) > i, timeout=60.0)
        for t in threads:
            t.join(120)
        assert not errors, errors
        c1.wait_until(lambda: sum(map(len, seen.values())) == n_threads * per_thread, timeout=60.0)
        assert pongs == list(range(pings))
        assert all(seen[t] == list(range(per_thread)) for t in range(n_threads))
    finally:
        for c in (c0, c1):
            c.close(timeout=10.0)


def _progress_both(c0, c1, predicate, timeout: float = 60.0) -> None:
    """Run both manual-mode contexts' engines until ``predicate()`` (their handlers count what arrives)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        c0.progress(0.001)
        c1.progress(0.001)


def test_a_record_read_in_a_delivering_round_reaches_its_handler_during_the_read() -> None:
    """A one-record message of a stream with nothing pending goes to its handler while the round reads
    it (Inbound._handle_now), with record_views() answering for it; old code queued it for _deliver,
    after the read (the handler then ran with ``_inline`` unset)."""
    (c0, c1), _ = _context_pair(progress="manual")
    seen: list[tuple[object, bool, bool]] = []
    try:
        c1.register(2, lambda src, obj: seen.append((obj, getattr(c1, "_inline", False), c1.record_views()))
                    is None)
        c0.send(1, 2, ("small", 1))
        _progress_both(c0, c1, lambda: len(seen) == 1)
        assert seen == [(("small", 1), True, False)], \
            "the handler should run inside the round's read, with no buffer views for a small record"
        assert not c1._in_dirty and not c1._in[(0, 2)].pending
    finally:
        for c in (c0, c1):
            c.channel.abort("test over")


def test_a_record_refused_on_arrival_is_offered_again_before_later_ones() -> None:
    """A handler that refuses the record handed to it during the read gets it again (after the retry
    interval) before the records sent after it, and the sender's credit comes back only then."""
    (c0, c1), _ = _context_pair(progress="manual")
    offered: list[int] = []
    taken: list[int] = []
    refuse = [True]

    def handler(src: int, obj: int) -> bool:
        offered.append(obj)
        if refuse[0]:
            refuse[0] = False
            return False
        taken.append(obj)
        return True

    try:
        c1.register(2, handler)
        c0.send(1, 2, 1)
        _progress_both(c0, c1, lambda: offered == [1])
        assert taken == [] and (0, 2) in c1._refused
        for i in (2, 3):
            c0.send(1, 2, i)
        _progress_both(c0, c1, lambda: len(taken) == 3)
        assert taken == [1, 2, 3] and offered[:2] == [1, 1]
    finally:
        for c in (c0, c1):
            c.channel.abort("test over")


def test_a_handler_that_raises_on_arrival_fails_the_waiter() -> None:
    (c0, c1), _ = _context_pair(progress="manual")

    def handler(src: int, obj: object) -> bool:
        raise ValueError(f"bad record {obj!r}")

    try:
        c1.register(2, handler)
        c0.send(1, 2, "x")
        with pytest.raises(ValueError, match="bad record 'x'"):
            c1.wait_until(lambda: False, timeout=30.0)
    finally:
        for c in (c0, c1):
            c.channel.abort("test over")
