"""One mesh link's state: its socket, what is queued to write to it, and what is half received from it."""

from __future__ import annotations

import select
import socket
import time
from collections import deque
from typing import Any

#: Bytes of the staging buffer each link reads small frames into.
STAGING = 256 << 10


class Peer:
    """One connection's state. The write queue is a list of flattened buffers; ``tokens`` say when
    each send is written out (``(queued bytes up to its end, token)``)."""

    __slots__ = (
        "cur",
        "cur_hdr",
        "cur_pos",
        "fd",
        "header_next",
        "kind",
        "last_recv",
        "last_send",
        "left",
        "lost",
        "polls",
        "pushing",
        "rank",
        "rbuf",
        "rlen",
        "sock",
        "tokens",
        "want_write",
        "wq",
        "wq_bytes",
    )

    def __init__(self, rank: int, sock: socket.socket, kind: str) -> None:
        self.rank = rank
        self.sock = sock
        self.fd = sock.fileno()
        self.kind = kind
        self.wq: deque[memoryview] = deque()       # flattened buffers to write
        self.wq_bytes = 0
        self.tokens: deque[tuple[int, object]] = deque()  # (bytes remaining before token done, token)
        self.rbuf = bytearray(STAGING)
        self.rlen = 0
        self.cur: memoryview | None = None           # payload being received directly
        self.cur_pos = 0
        self.cur_hdr: tuple[int, int, int] | None = None
        # After a large payload, read the next frame header alone: if another large payload follows,
        # it is then received straight into its own buffer instead of partly into staging and copied.
        self.header_next = False
        now = time.monotonic()
        self.last_recv = now
        self.last_send = now
        self.left = False
        self.lost = False
        self.want_write = False
        self.pushing = False     # a sending thread reads and writes it itself (TCPChannel.push)
        self.polls: dict[int, Any] = {}   # events -> a poll object over this socket alone (poll_socket)

    @property
    def closed(self) -> bool:
        """Whether our socket to this peer is closed (after its goodbye and hang-up, or a failure)."""
        return self.sock.fileno() < 0

    def enqueue(self, header: bytes, views: list[memoryview], token: object) -> None:
        """Queue one frame (``header`` then ``views``); ``token`` is done once all of it is written."""
        self.wq.append(memoryview(header))
        self.wq_bytes += len(header)
        for v in views:
            self.wq.append(v)
            self.wq_bytes += v.nbytes
        if token is not None:
            self.tokens.append((self.wq_bytes, token))

    def consume(self, n: int) -> None:
        """Drop the first ``n`` queued bytes (the socket took them)."""
        self.last_send = time.monotonic()
        wq = self.wq
        while n:
            head = wq[0]
            if head.nbytes <= n:
                n -= head.nbytes
                wq.popleft()
            else:
                wq[0] = head[n:]
                n = 0

    def written(self, sent: int) -> list[object]:
        """``sent`` more bytes were written: the tokens of the sends now complete."""
        self.wq_bytes -= sent
        if not self.tokens:
            return []
        if not self.wq:     # everything written: every token is done
            tokens, self.tokens = self.tokens, deque()
            return [token for _, token in tokens]
        done: list[object] = []
        shifted: deque[tuple[int, object]] = deque()
        for remaining, token in self.tokens:
            remaining -= sent
            if remaining <= 0:
                done.append(token)
            else:
                shifted.append((remaining, token))
        self.tokens = shifted
        return done

    def drop_queue(self) -> list[object]:
        """Forget what is queued (it can no longer be sent); the tokens it held, to release."""
        self.wq.clear()
        self.wq_bytes = 0
        tokens = [token for _, token in self.tokens]
        self.tokens.clear()
        return tokens

    def poll_socket(self, events: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``events`` on this socket alone; True if they came."""
        po = self.polls.get(events)
        if po is None:
            po = self.polls[events] = select.poll()
            po.register(self.fd, events)
        try:
            return bool(po.poll(timeout * 1000.0))
        except (OSError, ValueError):
            return False
