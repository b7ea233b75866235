"""The TCP channel on its own: two channels joined by a socket pair in one process, driven by hand.

What is checked here is what a whole job cannot show: how many CREDIT frames the receiver sends for a
stream of messages, that owed credit is still returned when no batch fills up, and what a thread that
writes its own message (``push``) does with the connection meanwhile.
"""

from __future__ import annotations

import socket
import threading
import time

from channels import tcp
from channels.tcp import TCPChannel, _Peer
from channels.tcp.wire import HEARTBEAT, header
from twisternet.config import Config


class Recorder:
    def __init__(self, keep: bool = False) -> None:
        self.messages: list[tuple[int, int, bytes]] = []
        self.releases: list = []
        self.credits: list[tuple[int, int]] = []
        self.sent: list[object] = []
        self.lost: list[tuple[int, str]] = []
        self.keep = keep     # hold releases back instead of releasing on arrival

    def on_message(self, peer, edge, data, release):
        self.messages.append((peer, edge, bytes(data)))
        if self.keep:
            self.releases.append(release)
        else:
            release()

    def on_credit(self, peer, edge):
        self.credits.append((peer, edge))

    def on_sent(self, token):
        self.sent.append(token)

    def on_peer_lost(self, peer, reason):
        self.lost.append((peer, reason))


def _pair(buffer_size: int = 64 << 10, buffer_count: int = 4, keep: bool = False):
    a, b = socket.socketpair()
    cfg = Config(buffer_size=buffer_size, buffer_count=buffer_count, heartbeat_interval=30.0,
                 peer_timeout=60.0)
    ch0 = TCPChannel(0, 2, cfg, {1: _Peer(1, a, "unix")}, [], b"t" * 16)
    ch1 = TCPChannel(1, 2, cfg, {0: _Peer(0, b, "unix")}, [], b"t" * 16)
    h0, h1 = Recorder(), Recorder(keep)
    ch0.start(h0)
    ch1.start(h1)
    return ch0, ch1, h0, h1


def _until(cond, *chans, limit: float = 10.0) -> None:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        for ch in chans:
            ch.progress(0.001)


def _big_buffers(ch0: TCPChannel, ch1: TCPChannel) -> None:
    """Socket buffers on both ends as the channel's own set-up sizes them (``socket_buffer``)."""
    for s in (ch0._peers[1].sock, ch1._peers[0].sock):
        tcp._tune(s, ch0.config, False)


def _count_credit_frames(monkeypatch, ch: TCPChannel) -> list[int]:
    """Record the size of every CREDIT frame ``ch`` queues."""
    seen: list[int] = []
    real = ch._enqueue

    def enqueue(p, header, views, token):
        kind, _edge, n = tcp._HDR.unpack(bytes(header))
        if kind == tcp.CREDIT:
            seen.append(n)
        return real(p, header, views, token)

    monkeypatch.setattr(ch, "_enqueue", enqueue)
    return seen


def _close(*chans: TCPChannel) -> None:
    for ch in chans:
        ch.abort("test over")


def test_credit_comes_back_in_batches_not_per_message(monkeypatch):
    ch0, ch1, h0, h1 = _pair()          # credit 256 KiB per edge: returned per 64 KiB owed
    frames = _count_credit_frames(monkeypatch, ch1)
    msg = b"m" * 4096
    sent = 0
    try:
        while sent < 256:               # 1 MiB in 4 KiB messages: four times the credit
            if ch0.send(1, 5, [msg]):
                sent += 1
            ch0.progress(0)
            ch1.progress(0)
        _until(lambda: len(h1.messages) == 256 and not ch0._inflight.get((1, 5)), ch0, ch1)
        assert [m[2] for m in h1.messages] == [msg] * 256
        assert sum(frames) == 256 * 4096                 # every byte came back ...
        assert len(frames) <= 256 // 4                   # ... in far fewer frames than messages
        assert h0.credits                                # the sender heard of it
    finally:
        _close(ch0, ch1)


def test_owed_credit_is_returned_after_the_delay_though_no_batch_fills(monkeypatch):
    ch0, ch1, h0, h1 = _pair()
    frames = _count_credit_frames(monkeypatch, ch1)
    try:
        assert ch0.send(1, 3, [b"x" * 100])
        _until(lambda: len(h1.messages) == 1, ch0, ch1)
        released = time.monotonic()
        _until(lambda: not ch0._inflight.get((1, 3)), ch0, ch1)
        assert frames == [100]
        assert time.monotonic() - released < 1.0
        # A progress call with a long timeout does not sleep past the delay while credit is owed.
        assert ch0.send(1, 3, [b"y" * 100])
        _until(lambda: len(h1.messages) == 2, ch0, ch1)
        t = time.monotonic()
        ch1.progress(5.0)                                   # returns once the credit is due
        _until(lambda: not ch0._inflight.get((1, 3)), ch0, ch1)
        assert time.monotonic() - t < 2.0
        assert frames == [100, 100]
    finally:
        _close(ch0, ch1)


def test_a_message_over_three_quarters_of_the_credit_waits_at_most_the_delay(monkeypatch):
    ch0, ch1, h0, h1 = _pair(buffer_size=64 << 10, buffer_count=4, keep=True)   # credit 256 KiB
    frames = _count_credit_frames(monkeypatch, ch1)
    try:
        assert ch0.send(1, 1, [b"a" * 1000])
        _until(lambda: len(h1.messages) == 1, ch0, ch1)
        assert not ch0.send(1, 1, [b"b" * ((272 << 10) - 100)])     # 1000 bytes still out: no room
        h1.releases.pop()()
        ch1.progress(0)
        assert frames == []                                 # owed, under a quarter: not yet returned
        _until(lambda: ch0.send(1, 1, [b"b" * ((272 << 10) - 100)]), ch0, ch1, limit=2.0)
        assert frames == [1000]
        _until(lambda: len(h1.messages) == 2, ch0, ch1)
        assert h1.messages[1][2] == b"b" * ((272 << 10) - 100)
    finally:
        _close(ch0, ch1)


def test_unreleased_messages_hold_their_credit():
    ch0, ch1, h0, h1 = _pair(keep=True)
    try:
        n = 0
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:
            if ch0.send(1, 2, [b"z" * 8192]):
                n += 1
            ch0.progress(0.001)
            ch1.progress(0.001)
        assert n == (256 << 10) * 17 // 16 // 8192         # the credit and its sixteenth, then no more
        assert len(h1.messages) == n
        for r in h1.releases:
            r()
        _until(lambda: ch0.send(1, 2, [b"z"]), ch0, ch1, limit=2.0)
    finally:
        _close(ch0, ch1)


def test_push_writes_from_the_callers_thread_and_reads_what_the_peer_sends():
    ch0, ch1, h0, h1 = _pair(buffer_size=1 << 20, buffer_count=16)
    big = bytes(range(256)) * (48 << 10)                   # 12 MiB: far more than a socket holds
    stop = threading.Event()
    try:
        assert ch0.send(1, 7, [big], token="big")
        assert ch1.send(0, 9, [b"hello"])                   # the peer talks back meanwhile

        def receiver():
            while not stop.is_set():
                ch1.progress(0.01)

        t = threading.Thread(target=receiver, daemon=True)
        t.start()
        p = ch0._peers[1]
        done = ch0.push(1)
        if not done:
            # While pushing, the engine's poller does not watch the socket (it would wake for
            # every CREDIT frame), and the pusher waits for room itself.
            assert p.pushing
        rounds = 0
        while not done:
            ch0.wait_writable(1, 0.5)
            done = ch0.push(1)
            rounds += 1
            assert rounds < 100000
        assert not p.pushing and not ch0.has_pending(1)
        assert h0.sent == ["big"]
        _until(lambda: len(h1.messages) == 1, ch0)
        assert h1.messages[0][2] == big
        _until(lambda: len(h0.messages) == 1, ch0)          # the engine hears the peer again
        assert h0.messages[0][:2] == (1, 9) and h0.messages[0][2] == b"hello"
    finally:
        stop.set()
        t.join(5)
        _close(ch0, ch1)


def test_end_push_hands_what_is_left_to_the_engine():
    ch0, ch1, h0, h1 = _pair(buffer_size=1 << 20, buffer_count=16)
    big = b"q" * (8 << 20)
    try:
        assert ch0.send(1, 4, [big], token=1)
        assert ch0.push(1) is False                          # the socket is full long before 8 MiB
        assert ch0._peers[1].pushing
        ch0.end_push(1)
        assert not ch0._peers[1].pushing and ch0._peers[1].want_write
        _until(lambda: h0.sent == [1] and len(h1.messages) == 1, ch0, ch1)
        assert h1.messages[0][2] == big
    finally:
        _close(ch0, ch1)


def test_push_to_a_peer_that_hung_up_reports_it_and_finishes():
    ch0, ch1, h0, h1 = _pair(buffer_size=1 << 20, buffer_count=16)
    try:
        assert ch0.send(1, 4, [b"w" * (8 << 20)], token=1)
        assert ch0.push(1) is False
        ch1._peers[0].sock.close()                           # the peer dies mid-message
        deadline = time.monotonic() + 10
        while not ch0.push(1):
            ch0.wait_writable(1, 0.1)
            assert time.monotonic() < deadline
        _until(lambda: h0.lost, ch0)
        assert h0.lost[0][0] == 1
        assert h0.sent == [1]                                # the buffers are given back, not held
    finally:
        _close(ch0, ch1)


def test_two_messages_of_half_the_credit_and_a_head_travel_together():
    # 256 KiB of credit: two messages of 128 KiB and 64 bytes (an array of half the credit and its
    # codec head) are both in flight before either is released; a third is refused.
    ch0, ch1, h0, h1 = _pair(keep=True)
    try:
        msg = b"h" * ((128 << 10) + 64)
        assert ch0.send(1, 6, [msg]) and ch0.send(1, 6, [msg])
        assert not ch0.send(1, 6, [msg])
        _until(lambda: len(h1.messages) == 2, ch0, ch1)
    finally:
        _close(ch0, ch1)


def test_large_messages_back_to_back_arrive_whole_and_in_order():
    # After a large payload the next header is read alone, so the next payload goes straight into its
    # own buffer; small messages in between must still be parsed from staging.
    ch0, ch1, h0, h1 = _pair(buffer_size=1 << 20, buffer_count=16)
    sizes = [3 << 20, 10, 5 << 20, 1, 0, 300 << 10, 7, 2 << 20, 13]
    payloads = [bytes([i % 251]) * s for i, s in enumerate(sizes)]
    try:
        pending = list(payloads)
        while pending:
            if ch0.send(1, 8, [pending[0]]):
                pending.pop(0)
            ch0.progress(0)
            ch1.progress(0)
        _until(lambda: len(h1.messages) == len(payloads), ch0, ch1)
        assert [m[2] for m in h1.messages] == payloads
    finally:
        _close(ch0, ch1)


def _half_a_frame(ch0: TCPChannel, size: int) -> socket.socket:
    """Write the header and half the payload of a ``size``-byte DATA frame on rank 0's socket by hand
    (from a thread: the socket holds less than that until the receiver reads)."""
    sock = ch0._peers[1].sock
    sock.setblocking(True)
    threading.Thread(target=sock.sendall, args=(tcp._HDR.pack(tcp.DATA, 4, size) + b"x" * (size // 2),),
                     daemon=True).start()
    return sock


def test_a_stalled_large_payload_does_not_hold_the_engine():
    # While a large payload arrives, a progress call waits for more of it on that socket alone, but
    # only briefly (_BULK_WAIT): a sender that stalls mid-payload must not stall the receiver's engine.
    ch0, ch1, h0, h1 = _pair(buffer_size=1 << 20, buffer_count=16)
    try:
        sock = _half_a_frame(ch0, 4 << 20)
        _until(lambda: ch1._peers[0].cur is not None and ch1._peers[0].cur_pos == 2 << 20, ch1)
        time.sleep(0.05)     # the writing thread is done
        t = time.monotonic()
        for _ in range(20):
            ch1.progress(0)
        assert time.monotonic() - t < 20 * tcp._BULK_WAIT + 1.0
        assert not h1.messages
        threading.Thread(target=sock.sendall, args=(b"x" * (2 << 20),), daemon=True).start()
        _until(lambda: len(h1.messages) == 1, ch1)
        assert h1.messages[0][:2] == (0, 4) and h1.messages[0][2] == b"x" * (4 << 20)
    finally:
        _close(ch0, ch1)


def test_a_peer_hanging_up_mid_payload_is_reported_lost():
    ch0, ch1, h0, h1 = _pair(buffer_size=1 << 20, buffer_count=16)
    try:
        sock = _half_a_frame(ch0, 4 << 20)
        _until(lambda: ch1._peers[0].cur is not None and ch1._peers[0].cur_pos == 2 << 20, ch1)
        time.sleep(0.05)
        sock.close()
        _until(lambda: h1.lost, ch1)
        assert h1.lost[0][0] == 0 and not h1.messages
    finally:
        _close(ch0, ch1)


def test_each_large_payload_is_handed_over_before_the_next_is_read():
    # A receiver that went on reading the payloads streaming in behind a finished one would hold the
    # finished one back (undelivered, its credit not returned) until the sender ran out of credit:
    # the stream then stalls for a round trip every credit's worth. One progress call hands over at
    # most one large payload.
    ch0, ch1, h0, h1 = _pair(buffer_size=1 << 20, buffer_count=64)
    size, count = 2 << 20, 6
    frames = b"".join(tcp._HDR.pack(tcp.DATA, 4, size) + bytes([i]) * size for i in range(count))
    sock = ch0._peers[1].sock
    _big_buffers(ch0, ch1)
    sock.setblocking(True)
    writer = threading.Thread(target=sock.sendall, args=(frames,), daemon=True)
    writer.start()
    time.sleep(0.1)      # the socket is full: the next payload is there as soon as one is read
    try:
        steps = []
        deadline = time.monotonic() + 10
        while len(h1.messages) < count and time.monotonic() < deadline:
            before = len(h1.messages)
            ch1.progress(0.01)
            steps.append(len(h1.messages) - before)
        assert [m[2] for m in h1.messages] == [bytes([i]) * size for i in range(count)]
        assert max(steps) == 1, steps
    finally:
        writer.join(5)
        _close(ch0, ch1)


def test_a_write_failing_after_the_peers_goodbye_is_not_a_loss():
    # A peer that said goodbye may hang up before it reads what we still send (a credit return, a
    # heartbeat): the write then fails (EPIPE) while its BYE still waits, unread, in our socket.
    # That is a clean leave, not a lost peer.
    ch0, ch1, h0, h1 = _pair()
    try:
        p1 = ch1._peers[0]
        p1.sock.sendall(tcp._HDR.pack(tcp.BYE, 0, 0))
        p1.sock.close()
        ch0._enqueue(ch0._peers[1], tcp._HDR.pack(tcp.CREDIT, 3, 100), [], None)
        ch0._enqueue(ch0._peers[1], tcp._HDR.pack(tcp.HEARTBEAT, 0, 0), [], None)
        assert ch0._flush_writes()           # the write fails: the peer hung up
        assert ch0._peers[1].left
        assert not h0.lost
    finally:
        _close(ch0, ch1)


def test_a_goodbye_behind_a_large_payload_is_read_after_a_failed_write():
    # The same with a large message before the BYE: reading stops after each large payload (see
    # above), so the failed write must read on until the BYE, and the message is delivered.
    ch0, ch1, h0, h1 = _pair(buffer_size=1 << 20, buffer_count=16)
    try:
        p1 = ch1._peers[0]
        _big_buffers(ch0, ch1)
        payload = b"p" * (1 << 20)
        p1.sock.sendall(tcp._HDR.pack(tcp.DATA, 2, len(payload)) + payload + tcp._HDR.pack(tcp.BYE, 0, 0))
        p1.sock.close()
        ch0._enqueue(ch0._peers[1], tcp._HDR.pack(tcp.CREDIT, 3, 100), [], None)
        assert ch0._flush_writes()
        assert ch0._peers[1].left
        assert not h0.lost
        assert h0.messages == [(1, 2, payload)]
    finally:
        _close(ch0, ch1)


def test_a_round_writes_only_the_peers_with_queued_frames(monkeypatch):
    """Rank 0 of three: a frame queued for rank 2 is written by the next round, and the round looks at
    no peer without queued frames (old code walked every peer of the job twice per round); a frame
    queued by another thread while a round runs is written by a later round."""
    a1, b1 = socket.socketpair()
    a2, b2 = socket.socketpair()
    cfg = Config(heartbeat_interval=30.0, peer_timeout=60.0)
    ch = TCPChannel(0, 3, cfg, {1: _Peer(1, a1, "unix"), 2: _Peer(2, a2, "unix")}, [], b"t" * 16)
    ch.start(Recorder())
    written: list[int] = []
    real_write = ch._write

    def write(p):
        written.append(p.rank)
        return real_write(p)

    monkeypatch.setattr(ch, "_write", write)
    try:
        assert not ch._flush_writes() and written == []
        ch._enqueue(ch._peers[2], header(HEARTBEAT), [], None)
        assert ch.has_pending() and ch.has_pending(2) and not ch.has_pending(1)
        assert ch._flush_writes() and written == [2]
        assert not ch.has_pending() and not ch._writers
        assert b2.recv(64) == header(HEARTBEAT) and not ch._flush_writes() and written == [2]

        sent_late = threading.Event()

        def write_and_queue(p):    # another thread queues for rank 1 in the middle of a round
            r = write(p)
            if not sent_late.is_set():
                sent_late.set()
                t = threading.Thread(target=ch._enqueue, args=(ch._peers[1], header(HEARTBEAT), [], None))
                t.start()
                t.join()
            return r

        monkeypatch.setattr(ch, "_write", write_and_queue)
        ch._enqueue(ch._peers[2], header(HEARTBEAT), [], None)
        ch._flush_writes()
        ch._flush_writes()
        assert written[1:] == [2, 1] and not ch.has_pending()
        assert b1.recv(64) == header(HEARTBEAT)
    finally:
        ch.abort("test over")
        for s in (b1, b2):
            s.close()
