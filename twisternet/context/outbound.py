"""The sending side of a Context: records to messages, per (peer, edge) stream, under back pressure.

Small records are packed into pool buffers (flushed when full, or ``flush_delay`` after the first record
of a partly filled one); records of at least ``zero_copy_threshold`` bytes go as their own message,
zero-copy when the sender waits for their completion (see ``push``). A stream takes no more than the
channel's credit in queued bytes before a send blocks (or, from a handler, queues anyway). Records to
this same rank skip the channel and are delivered from a private copy. :meth:`Outbound._pump` hands
queued messages to the channel while it has credit.
"""

from __future__ import annotations

import time
from typing import Any

from ..channel import CONTROL_EDGE_BASE, MAX_EDGE, Buffer
from ..codec import join, record_size
from ..errors import BackPressureTimeout, ClosedError, TwisternetError
from .engine import _SEND_LOCK_WAIT
from .push import SendHandle
from .state import ContextState
from .streams import (_BATCH, _DIRECT, _NO_TAG, _InStream, _LocalRef, _Mark, _OutMsg, _OutStream, _Sent,
                      _stamp_bytes)


class Outbound(ContextState):
    """Context part: encoding, packing and queueing sends (a mixin of :class:`~twisternet.context.api.Context`).

    State (made in ``Context.__init__``): ``_out`` (streams), ``_out_ready`` (streams with queued
    messages), ``_out_partial`` (stream -> when its partly filled buffer is due), ``_local_bytes``."""

    def _check_edge(self, edge: int) -> None:
        if not isinstance(edge, int) or isinstance(edge, bool) or not 0 <= edge < CONTROL_EDGE_BASE:
            raise TwisternetError(f"edge must be an int in [0, {CONTROL_EDGE_BASE}), got {edge!r}")

    # Complexity accepted: the one send path: checks, packing, credit.
    def _send(self, dst: int, edge: int, obj: Any, *, block: bool, timeout: float | None,  # noqa: C901
              closing: bool = False, wait_sent: bool = True, force: bool = False) -> bool | SendHandle:
        if not isinstance(dst, int) or not 0 <= dst < self.world:
            raise TwisternetError(f"destination rank must be in [0, {self.world}), got {dst!r}")
        if type(edge) is int and 0 <= edge < CONTROL_EDGE_BASE:
            pass        # (a user's edge, the common case: checked in one line)
        elif edge < CONTROL_EDGE_BASE:
            self._check_edge(edge)
        elif not edge < MAX_EDGE:
            raise TwisternetError(f"edge must be < {MAX_EDGE}, got {edge}")
        if self._closed and not closing and not self._on_engine_thread():
            raise ClosedError("context is closed")
        parts = self.codec.encode(obj)
        n = record_size(parts)
        forced = force or self._on_engine_thread()
        direct = n >= self._zc and n > self._slice_limit
        if (not direct and block and not forced and not closing and self._small_ok and dst != self.rank
                and self._send_small(dst, edge, parts, n)):
            if wait_sent:
                return True
            limit = self.config.timeout if timeout is None else timeout
            return SendHandle(self, None, dst, edge, time.monotonic() + limit, limit)
        limit = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        if dst == self.rank:
            sent = self._send_local(edge, parts, n, block=block, forced=forced, deadline=deadline, limit=limit)
            return sent if wait_sent else SendHandle(self, None, dst, edge, deadline, limit)
        if direct and block and wait_sent and not forced and self._can_push:
            return self._send_own(dst, edge, parts, n, deadline, limit)
        key = (dst, edge)
        done: _Sent | None = None
        while True:
            with self._lock:
                gen = self._gen
                s = self._stream(dst, edge)
                if direct:
                    room = s.queued_bytes < self._credit
                else:
                    need = s.packer.space_needed(n)
                    room = s.queued_bytes < self._credit and (need == 0 or self.pool.available >= need)
                if room or forced:
                    wake = False
                    if (not direct and room and block and not s.queue and not s.packer.pending_bytes
                            and self._coflow_pump is None and self.channel.idle(dst, edge)):
                        # Nothing of this stream is on its way (Nagle's rule): send the record now as its
                        # own message, with no batching delay and no packing; while it is unacknowledged,
                        # later records batch behind it as usual.
                        self._queue(s, _OutMsg([_DIRECT, b"".join(parts)], n + 1, None, None))
                        wake = True
                    elif direct or not room:
                        # own channel message; zero-copy unless we must not block for its completion
                        if s.packer.pending_bytes:
                            self._emit_partial(s)
                        payload: list[Buffer]
                        if forced or not block:
                            # no waiting for completion here (engine thread / try_send): send a copy
                            payload = [_DIRECT, b"".join(parts)]
                        else:
                            done = _Sent()
                            payload = [_DIRECT, *parts]
                        self._queue(s, _OutMsg(payload, n + 1, None, done))
                        wake = True
                    else:
                        had_partial = s.packer.pending_bytes > 0
                        for buf in s.packer.add(parts):
                            self._queue(s, _OutMsg([_BATCH, buf], len(buf) + 1, buf, None))
                            wake = True
                        if s.packer.pending_bytes:
                            if not had_partial:
                                self._out_partial[key] = time.monotonic() + self._flush_delay
                                # wake the engine only if it sleeps past this buffer's flush time
                                wake = wake or self._sleep_until > self._out_partial[key]
                        else:
                            self._out_partial.pop(key, None)
                    break
                if not block:
                    return False
            self._blocked(gen, deadline, limit, edge, "send blocked by back pressure")
        if wake:
            self._kick(_SEND_LOCK_WAIT if done is not None and wait_sent else 0.0)
        if not wait_sent:
            return SendHandle(self, done, dst, edge, deadline, limit)
        if done is not None:
            self._wait_sent(done, dst, edge, deadline, limit)
        return True

    def _send_small(self, dst: int, edge: int, parts: list[Buffer], n: int) -> bool:
        """The fast path of Nagle's rule (see ``_send``): a record to a stream with nothing on its way is
        written by this thread at once, in one frame, by ``channel.send_small`` (over MPI one eager
        ``Isend``): no queued message, no token, no progress round, no hand-off to the progress thread.
        False (nothing done) if the engine is busy (see ``_take_engine``) or the stream or link is not
        idle: the caller then takes the ordinary path."""
        s = self._out.get((dst, edge))
        if (s is not None and (s.queue or s.packer.pending_bytes)) or not self.channel.idle(dst, edge):
            return False    # (unlocked hints, checked again below: a busy stream batches, see _send)
        if not self._take_engine():
            return False
        try:
            with self._lock:
                s = self._stream(dst, edge)
                if s.queue or s.packer.pending_bytes:
                    return False
                head = _DIRECT if s.stamp is None else s.stamp + _DIRECT
                if not self.channel.send_small(dst, edge, [head, *parts], n + len(head)):
                    return False
                s.stamp = None
                return True
        finally:
            self._chan_lock.release()

    def _stream(self, dst: int, edge: int) -> _OutStream:
        """The stream of messages to ``dst`` on ``edge`` (made on first use); PeerLostError if ``dst`` is
        lost. Called with ``self._lock`` held."""
        if dst in self._lost:
            raise self._lost_error(dst)
        s = self._out.get((dst, edge))
        if s is None:
            s = self._out[(dst, edge)] = _OutStream(dst, edge, self.pool)
        tag = self._tags.get(edge, _NO_TAG)
        if s.tag != tag:
            if s.packer.pending_bytes:
                self._emit_partial(s)       # the records of the old tag go first, in their own message
            s.tag = tag
            s.stamp = _stamp_bytes(tag)     # carried by the next message on the stream
        return s

    @staticmethod
    def _stamp(s: _OutStream, msg: _OutMsg) -> None:
        """Put the stream's new tag in front of ``msg`` (its first message since the tag changed)."""
        if s.stamp is not None:
            msg.parts = [s.stamp + msg.parts[0], *msg.parts[1:]]
            msg.nbytes += len(s.stamp)
            s.stamp = None

    def _send_local(self, edge: int, parts: list[Buffer], n: int, *, block: bool, forced: bool,
                    deadline: float, limit: float) -> bool:
        while True:
            with self._lock:
                gen = self._gen
                held = self._local_bytes.get(edge, 0)
                if forced or held == 0 or held + n <= self._credit:
                    self._local_bytes[edge] = held + n
                    obj = self.codec.decode(join(parts))  # copy semantics, as for a remote peer
                    key = (self.rank, edge)
                    ins = self._in.get(key)
                    if ins is None:
                        ins = self._in[key] = _InStream(self.rank, edge)
                    tag = self._tags.get(edge, _NO_TAG)
                    if ins.local_tag != tag:
                        ins.local_tag = tag
                        ins.pending.append((_Mark(tag), None))
                    ins.pending.append((obj, _LocalRef(self, edge, n)))
                    self._in_dirty.add(key)
                    break
                if not block:
                    return False
            self._blocked(gen, deadline, limit, edge, "send to own rank blocked by back pressure")
        if not forced:
            self.channel.wakeup()
        return True

    def _blocked(self, gen: int, deadline: float, limit: float, edge: int, what: str) -> None:
        """One wait of a blocked send: raise on a failure or past the deadline, else wait for a change."""
        self._raise_failures()
        if time.monotonic() >= deadline:
            raise BackPressureTimeout(what, edge=edge, timeout=limit)
        self._wait_change(gen, min(deadline - time.monotonic(), 0.5))

    def _queue(self, s: _OutStream, msg: _OutMsg) -> None:
        if s.stamp is not None:
            self._stamp(s, msg)
        s.queue.append(msg)
        s.queued_bytes += msg.nbytes
        self._out_ready.add((s.peer, s.edge))

    def _emit_partial(self, s: _OutStream) -> None:
        got = s.packer.flush()
        self._out_partial.pop((s.peer, s.edge), None)
        if got is not None:
            buf, view = got
            self._queue(s, _OutMsg([_BATCH, view], len(view) + 1, buf, None))

    def _pump(self) -> bool:
        """Hand queued messages to the channel while it has credit; flush idle partial buffers."""
        did = False
        with self._lock:
            if self._out_partial:
                now = time.monotonic()
                for key, due in list(self._out_partial.items()):
                    s = self._out[key]
                    if due <= now and not s.queue:
                        self._emit_partial(s)
            if self._coflow_pump is not None:
                return self._coflow_pump.pump() or did
            for key in list(self._out_ready):
                s = self._out[key]
                while s.queue:
                    msg = s.queue[0]
                    if not self.channel.send(s.peer, s.edge, msg.parts, msg):
                        break
                    s.queue.popleft()
                    s.queued_bytes -= msg.nbytes
                    did = True
                if not s.queue:
                    self._out_ready.discard(key)
        return did
