"""The receiving side of a Context: channel events in, records out to the handlers of their edges.

``on_message`` (the channel's handler callback, on the engine) unpacks and decodes a message into its
stream's pending records; ``_deliver`` then offers them, in order, to the handler registered on their
edge, outside the Context lock. A one-record message of a stream with nothing pending goes to its
handler at once instead, in a round that delivers (``_handle_now``). A handler that refuses a record
holds back everything after it from that source on that edge (retried every ``_RETRY_INTERVAL`` or
on ``Context.resume``). Records of another incarnation of an edge wait or are dropped; records of
another operation in the same one are a mismatch, reported to both ranks (see the package doc).
"""

from __future__ import annotations

import logging
import time
from typing import Any
from collections.abc import Callable

from ..errors import MismatchError, ProtocolError, TwisternetError
from .state import ContextState
from .streams import (_BATCH, _CAUSE_EDGE, _DIRECT, _MISMATCH_EDGE, _TAG_HEAD, _TAGGED, _InStream, _Mark,
                      _MsgRef, _OutMsg)

log = logging.getLogger(__name__)

_RETRY_INTERVAL = 0.005


class Inbound(ContextState):
    """Context part: channel events and delivery to handlers (a mixin of
    :class:`~twisternet.context.api.Context`).

    State (made in ``Context.__init__``): ``_in`` (streams), ``_in_dirty`` (streams with deliverable
    records), ``_refused``, ``_handlers``, ``_tags``, ``_tag_errors``, ``_mismatched``."""

    def on_message(self, peer: int, edge: int, data: memoryview, release: Callable[[], None]) -> None:
        key = (peer, edge)
        ins = self._in.get(key)     # (streams are only ever added, under the lock)
        if ins is None:
            with self._lock:
                ins = self._in.get(key)
                if ins is None:
                    ins = self._in[key] = _InStream(peer, edge)
        tag = data[:1]
        if tag == _DIRECT and edge != _CAUSE_EDGE and not ins.unpacker.partial:
            # the common case, in short: one record, under the stream's current tag
            obj, views = self.codec.decode_views(data[1:])
            if self._inline and not ins.pending:
                entry = self._handlers.get(edge)
                if entry is not None and ins.tag is entry[2]:
                    self._handle_now(entry[0], ins, obj, views, release)
                    return
            ref = _MsgRef(release)
            ref.views = views
            ref.count = 1
            with self._lock:
                ins.pending.append((obj, ref))
                self._in_dirty.add(key)
            return
        mark = None
        if tag == _TAGGED:
            epoch, flen = _TAG_HEAD.unpack_from(data, 1)
            end = 1 + _TAG_HEAD.size + flen
            mark = _Mark((epoch, bytes(data[1 + _TAG_HEAD.size:end]).decode("utf-8", "replace")))
            data = data[end:]
            tag = data[:1]
        if tag == _BATCH:
            records = ins.unpacker.feed(data[1:])
        elif tag == _DIRECT:
            if ins.unpacker.partial:
                raise ProtocolError(f"rank {peer} edge {edge}: direct record inside a split record")
            records = [data[1:]]
        else:
            raise ProtocolError(f"rank {peer} edge {edge}: unknown message tag {bytes(tag)!r}")
        ref = _MsgRef(release)
        decoded = []
        views = False
        for r in records:
            obj, v = self.codec.decode_views(r)
            decoded.append(obj)
            views = views or v
        ref.views = views
        if edge == _CAUSE_EDGE:
            # handled at once: the sender's own loss may be reported right after this message
            for obj in decoded:
                self._on_cause(peer, obj)
            release()
            return
        if mark is not None:
            with self._lock:
                ins.pending.append((mark, None))
                self._in_dirty.add(key)
        if not decoded:
            release()  # only a piece of a split record: its bytes were copied out
            return
        ref.count = len(decoded)
        with self._lock:
            for obj in decoded:
                ins.pending.append((obj, ref))
            self._in_dirty.add(key)

    def on_credit(self, peer: int, edge: int) -> None:
        pass  # the next _pump retries every stream with queued messages

    def _handle_now(self, handler: Callable[[int, Any], Any], ins: _InStream, obj: Any, views: bool,
                    release: Callable[[], None]) -> None:
        """The record of a message read in a progress round that delivers (``_inline``), with nothing
        of its stream before it, straight to its handler: what ``_deliver`` would do with it right
        after the read, without the pending queue, the dirty set and their locks. A refused record is
        queued as ``_deliver`` queues one; a failing handler fails the waiters as there. Not in the
        rounds that only move bytes (``_kick``, a pushing sender): their caller may be inside an
        operation whose record a handler must not overtake."""
        progress = self._in_progress
        progress.views = views
        try:
            ok = handler(ins.src, obj)
        except BaseException as e:  # noqa: BLE001 - a failing handler fails the waiters
            self._handler_failed(ins.edge, e)
            self._seen = True
            return
        finally:
            progress.views = True     # outside a handler, record_views() gives the safe answer
        self._seen = True
        if ok is not False:
            release()
            return
        ref = _MsgRef(release)        # refused: held back, offered again by _deliver
        ref.views = views
        ref.count = 1
        with self._lock:
            ins.pending.append((obj, ref))
            self._refused[(ins.src, ins.edge)] = time.monotonic()

    def _handler_failed(self, edge: int, e: BaseException) -> None:
        """The handler of ``edge`` raised ``e`` (logged here): the context's failure, unless it has one."""
        log.exception("rank %d: handler of edge %d raised", self.rank, edge)
        with self._lock:
            if self._failure is None:
                self._failure = e

    def on_sent(self, token: object) -> None:
        self._seen = True
        msg = token
        assert isinstance(msg, _OutMsg)
        if msg.pool_buf is not None:
            self.pool.release(msg.pool_buf)
            msg.pool_buf = None
        if msg.done is not None:
            msg.done.set()

    def _deliver(self) -> bool:
        """Offer pending records to their handlers (outside the Context lock)."""
        did = False
        with self._lock:
            if self._refused:
                now = time.monotonic()
                for key, t in list(self._refused.items()):
                    if now - t >= _RETRY_INTERVAL:
                        del self._refused[key]
                        self._in_dirty.add(key)
                work = [k for k in self._in_dirty if k not in self._refused]
            else:
                work = list(self._in_dirty)
            self._in_dirty.clear()
        for key in work:
            with self._lock:
                ins = self._in.get(key)
                entry = self._handlers.get(key[1])
            if ins is None:
                continue
            if entry is None:
                self._check_unhandled(key, ins)
                continue
            handler, _, htag, on_error = entry
            src = ins.src
            # (unlocked peek: only the engine takes records out, and whoever adds one marks the
            # stream dirty again)
            while ins.pending:
                with self._lock:
                    batch = list(ins.pending)
                    ins.pending.clear()
                i = 0
                early = False
                mismatch: tuple[int, str] | None = None
                progress = self._in_progress
                try:
                    for obj, ref in batch:
                        if ref is None:            # a _Mark: the records after it carry its tag
                            ins.tag = htag if obj.tag == htag else obj.tag   # same object: cheap check
                            i += 1
                            continue
                        if ins.tag is not htag and ins.tag != htag:
                            if ins.tag[0] > htag[0]:
                                early = True       # the edge's next incarnation: wait for its handler
                                break
                            if ins.tag[0] < htag[0] or mismatch is not None:
                                ref.done_one()     # stale: an earlier incarnation of the edge
                                i += 1
                                continue
                            if ins.tag[1] and htag[1]:
                                mismatch = ins.tag  # same incarnation, another operation: drop, fail
                                ref.done_one()
                                i += 1
                                continue
                        progress.views = ref.views
                        if handler(src, obj) is False:
                            break
                        ref.done_one()
                        i += 1
                except BaseException as e:  # noqa: BLE001 - a failing handler fails the waiters
                    self._handler_failed(key[1], e)
                    return True
                finally:
                    progress.views = True     # outside a handler, record_views() gives the safe answer
                did = did or i > 0
                if mismatch is not None and (key, htag) not in self._mismatched:
                    self._mismatched.add((key, htag))
                    self._edge_mismatch(src, key[1], mismatch, htag, on_error, notify_peer=True)
                if i < len(batch):
                    with self._lock:
                        ins.pending.extendleft(reversed(batch[i:]))   # keep order: refused one first
                        if not early:
                            self._refused[key] = time.monotonic()
                        elif self._handlers.get(key[1]) is not entry:
                            # the next incarnation registered meanwhile (finding nothing pending): now
                            self._in_dirty.add(key)
                    break
        return did

    def _check_unhandled(self, key: tuple[int, int], ins: _InStream) -> None:
        """Records wait on an edge without a handler here: if the edge is tagged for this incarnation and
        they come from another operation, nobody would ever take them; report the mismatch."""
        with self._lock:
            tag = self._tags.get(key[1])
            if tag is None or not tag[1]:
                return
            marks = [obj.tag for obj, ref in ins.pending if ref is None]
            on_error = self._tag_errors.get(key[1])
        for m in marks:
            if m[0] == tag[0] and m[1] and m[1] != tag[1] and (key, tag) not in self._mismatched:
                self._mismatched.add((key, tag))
                self._edge_mismatch(key[0], key[1], m, tag, on_error, notify_peer=True)
                return

    def _edge_mismatch(self, peer: int, edge: int, theirs: tuple[int, str], mine: tuple[int, str],
                       on_error: Callable[[BaseException], None] | None, *, notify_peer: bool) -> None:
        """Rank ``peer`` runs another operation than this rank on ``edge``: fail here, tell the peer."""
        err = MismatchError(f"ranks {sorted({peer, self.rank})} run different operations on one edge: rank "
                            f"{peer} runs {theirs[1]}, rank {self.rank} runs {mine[1]} (channel edge {edge}, "
                            f"incarnation {mine[0]}); every rank must create the same operations on an edge, "
                            "in the same order", [peer, self.rank])
        log.error("rank %d: %s", self.rank, err)
        if notify_peer:
            try:
                self._send(peer, _MISMATCH_EDGE, [edge, theirs[0], mine[1], theirs[1]], block=False, timeout=0.0)
            except TwisternetError:
                log.debug("rank %d: could not tell rank %d of the mismatch", self.rank, peer, exc_info=True)
        # the same two operations meet on each channel edge they share: report the pair once
        pair = (peer, mine[0], mine[1], theirs[1])
        if on_error is not None:
            with self._lock:
                self._mismatch_pairs.add(pair)
                if self._reported_pair == pair:
                    self._reported_heard = True  # the operation raises it to user code
            on_error(err)
        else:
            with self._lock:
                if pair in self._mismatch_pairs:
                    return
                self._mismatch_pairs.add(pair)
                if self._failure is None:
                    self._failure = self._reported_failure = err
                    self._reported_pair = pair
            self.notify()

    def _on_mismatch_notice(self, src: int, obj: Any) -> bool:
        """A peer found that our records on an edge went to another operation there."""
        try:
            edge, epoch, theirs, mine = obj
        except (TypeError, ValueError):
            raise ProtocolError(f"rank {src}: bad mismatch notice {obj!r:.200}") from None
        with self._lock:
            entry = self._handlers.get(edge)
            tag = self._tags.get(edge)
            on_error = entry[3] if entry is not None and entry[2][0] == epoch else None
            if on_error is None and tag is not None and tag[0] == epoch:
                on_error = self._tag_errors.get(edge)
        self._edge_mismatch(src, edge, (epoch, str(theirs)), (epoch, str(mine)), on_error, notify_peer=False)
        return True
