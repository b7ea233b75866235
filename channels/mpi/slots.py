"""The MPI channel's side of the shared-memory slot protocol (:mod:`channels.shm_slots`): between
ranks on one host, large messages are copied by the sender into slots the receiver granted, and
only a header naming the slot goes through MPI."""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, cast

import numpy as np

from twisternet.channel import Buffer
from twisternet.errors import ProtocolError

from .. import shm_slots
from .records import _BulkRecv, _Incoming, _Release, _Send, _SendGroup
from .state import MPIChannelState
from .wire import (
    _FLAG_SPLIT,
    _HDR,
    _INLINE_MAX,
    _KIND_SLOT,
    _KIND_SLOT_DONE,
    _KIND_SLOT_GRANT,
    _KIND_SLOT_OFFER,
    _KIND_SLOT_RETIRE,
    _PAGE,
    _SLOT_EXT,
    _SLOT_SPLIT,
    TAG_BULK,
    TAG_CTRL,
    TAG_DATA,
    _encode_slot_answer,
    _encode_slot_ids,
    _encode_slot_offer,
    _pre_cap,
    _slot_parts,
)

log = logging.getLogger(__name__)


#: Seconds a sender with no free slot waits for the grant of one it filled before using MPI instead.
#: A grant usually takes one message's handling at the receiver (0.1-0.3 ms here); the bound matters
#: when the receiver cannot release it soon, e.g. while its own thread waits for a send of its own.
_SLOT_WAIT = 5e-4
#: Messages whose payload is bigger than this go into slots in two halves copied at once, one by each
#: process (see _FLAG_SPLIT): once a copy runs at memory speed, two cores copying move more than one.
_SPLIT_MIN = 8 << 20
#: Largest message that goes through shared-memory slots (two slots of it must fit memory_limit too).
#: A copy of 16 MB or more runs at memory speed: one process's memcpy into a slot (tmpfs, 4 KiB pages)
#: is then no faster than MPI's (the kernel's copy into huge-page memory; in two p2p suite runs 16 MB
#: went 0.81x / 0.77x of raw mpi4py through whole-slot copies against 0.88x / 0.93x through MPI),
#: which is why those messages are split (_SPLIT_MIN) and copied by both processes at once.
_SLOT_MAX = (64 << 20) + _INLINE_MAX
#: While waiting for the slot of the previous message does not pay off, try it again every this many sends.
_SLOT_PROBE = 64

#: _slot_pick's answer "wait for a slot to come back".
_WAIT = object()


class SlotsMixin(MPIChannelState):
    """The shared-memory slot protocol on both sides (sender: pick, fill, defer; receiver: grow,
    deliver, grant back).

    A mixin of :class:`~channels.mpi.channel.MPIChannel`, not an object of its own: it posts sends
    through the channel's send queue, delivers into the channel's per-(peer, edge) order and counts
    deferred messages as the channel's pending sends; the slot state itself lives in
    :class:`channels.shm_slots.SlotOwner` / ``SlotUser`` objects, and the per-peer ``_slot_*`` lists
    are this part's own (set up in ``MPIChannel.__init__``)."""

    # --- shared-memory landing slots (channels.shm_slots) -------------------------------------------
    #
    # Between ranks on one host, a large message goes into a slot its receiver created and granted us:
    # one memcpy by the sender, then a header naming the slot, and the sender is done (no rendezvous,
    # no waiting for the receiver's copy). Receivers offer slots (two per sending peer, bounded in total
    # by memory_limit) once a peer's rendezvous payloads show up; offers, grants and retirements go on
    # TAG_CTRL, the sender's answers on TAG_DATA, in order with its headers. A message no granted slot
    # holds goes the usual MPI way, so nothing ever waits for a slot.

    def _slot_send(self, peer: int, edge: int, views: list[memoryview], segments: list[Buffer], size: int,
                   token: object) -> bool:
        """Send a large message to ``peer`` through one of its slots: at once if a slot holds it, or as
        soon as the one it waits for comes back (deferred); False if it goes through MPI instead."""
        if peer in self._slot_deferred:
            # A second large message while one waits for its slot: a burst (isend), which MPI, with
            # any number of transfers in flight, moves better than two slots do. The waiting ones go
            # through MPI now, and this one after them.
            self._slot_run_deferred(peer, give_up=True)
            return False
        head, body, need = _slot_parts(segments, self._pool_buf_size)
        pick = self._slot_pick(peer, need, first=True)
        if pick is None:
            return False
        if pick is _WAIT:
            self._slot_defer(peer, edge, views, segments, size, token)
        else:
            self._slot_fill(peer, edge, pick, head, body, size, token)
        return True

    def _slot_pick(self, peer: int, need: int, first: bool) -> Any:
        """The slot of ``peer`` a payload of ``need`` bytes goes into now; ``_WAIT`` if it should wait
        for one to come back; None if it should go through MPI."""
        out = self._slots_out
        # Refilling the slot of our previous message keeps the copy's destination in the CPU caches
        # (alternating between two slots costs 30-90% more per 4 MB copy here than the ~0.1 ms wait
        # for the grant, and 16 MB copies too run at cache speed when the machine is quiet): wait for
        # that one while waiting has paid off, probing now and then when not.
        last = out.last(peer)
        want_last = last is not None and not last.free and need <= last.cap
        if not first:                                   # a deferred message: as decided when it was
            want_last = want_last and self._slot_want_last[peer]
        elif want_last and not self._slot_prefer[peer]:
            self._slot_probes[peer] += 1
            want_last = self._slot_probes[peer] % _SLOT_PROBE == 0
        slot = out.take(peer, need, last if want_last else None)
        if slot is None and (self._slot_slow[peer] or not (want_last or out.waiting(peer, need))
                             or self._slots_in.holding(peer)):
            # (nothing to wait for; or we hold a message of that peer's ourselves: it may be waiting
            # for us to release it, while our thread waits for this send, so neither would move)
            return None
        if slot is None and first and not self._slot_wait_until[peer] and not self._in_poll:
            self._test_once()               # its grant may have arrived already
            slot = out.take(peer, need, last if want_last else None)
        until = self._slot_wait_until[peer]
        if slot is not None:
            if until and slot is last:
                self._slot_prefer[peer] = True      # waiting for it paid off
            self._slot_wait_until[peer] = 0.0
            return slot
        now = time.monotonic()
        self._slot_want_last[peer] = want_last
        if not until:
            self._slot_wait_until[peer] = now + _SLOT_WAIT
            self.stats["slot_waits"] += 1
            return _WAIT
        if now < until:
            return _WAIT
        # Waited in vain: the consumer holds on to its messages.
        self.stats["slot_wait_timeouts"] += 1
        self._slot_wait_until[peer] = 0.0
        if want_last:
            self._slot_prefer[peer] = False         # take whichever slot is free from now on
            slot = out.take(peer, need)
            if slot is not None:
                return slot
        self._slot_slow[peer] = True                # through MPI, without waiting, till a grant
        return None

    def _slot_fill(self, peer: int, edge: int, slot: shm_slots.MappedSlot, head: Buffer, body: list[Buffer],
                   size: int, token: object) -> None:
        """Copy a message's payload into ``slot`` and send the header that names it. A large payload is
        split: the header goes first, the part from the cut on (within the last segment) follows on
        TAG_BULK for the receiver to copy into the slot while we copy the part before it, and a done
        marker follows our part."""
        dst = cast(np.ndarray, slot.payload)   # mapped: closing it is what clears it
        hn = memoryview(head).nbytes
        need = size - hn
        cut = 0
        if need > _SPLIT_MIN:
            last = memoryview(body[-1])
            tail = need - last.nbytes                       # where the last segment starts
            cut = max((need // 2) & ~(_PAGE - 1), tail)     # what goes through MPI: one contiguous part
        if 0 < cut < need:
            hdr = b"".join((_HDR.pack(_KIND_SLOT, _FLAG_SPLIT, 0, edge, size), _SLOT_EXT.pack(slot.id, hn),
                            _SLOT_SPLIT.pack(cut), head))
            self._submit(hdr, TAG_DATA, _Send(peer, hdr))
            rest = last[cut - tail:]
            op = _Send(peer, rest, None, _SendGroup(token, 1), True, rest.nbytes)
            self._submit([rest, self._MPI.BYTE], TAG_BULK, op)
            body = [*body[:-1], last[:cut - tail]]
        off = 0
        for seg in body:
            n = memoryview(seg).nbytes
            if n:
                np.copyto(dst[off:off + n], np.frombuffer(seg, np.uint8))
                off += n
        if cut:
            done = _HDR.pack(_KIND_SLOT_DONE, 0, 0, slot.id, 0)
            self._submit(done, TAG_DATA, _Send(peer, done))
            self.stats["slot_sent"] += 1
            self.stats["slot_split"] += 1
            return
        hdr = b"".join((_HDR.pack(_KIND_SLOT, 0, 0, edge, size), _SLOT_EXT.pack(slot.id, hn), head))
        self._submit(hdr, TAG_DATA, _Send(peer, hdr))
        if token is not None:   # copied: reusable now (reported by progress)
            self._events.append((self._handler.on_sent, (token,)))  # type: ignore[union-attr]
        self.stats["slot_sent"] += 1

    def _slot_defer(self, peer: int, edge: int, views: list[memoryview], segments: list[Buffer], size: int,
                    token: object) -> None:
        """Hold a large message for ``peer`` until the slot it waits for comes back (or the wait ends:
        then it goes through MPI). It counts as pending; later messages on its edge wait behind it."""
        self._slot_deferred[peer] = (edge, views, segments, size, token)
        self._pending_sends[peer] += 1
        self._pending_bytes[peer] += size
        self._pending_total += 1
        self.stats["slot_deferred"] += 1

    def _slot_run_deferred(self, peer: int, give_up: bool = False) -> None:
        """Send ``peer``'s held message if a slot takes it now (through MPI if ``give_up`` or the wait
        is over); called when a grant comes, when the wait ends, and before a goodbye."""
        held = self._slot_deferred.get(peer)
        if held is None or peer in self._lost:
            return
        edge, views, segments, size, token = held
        head, body, need = _slot_parts(segments, self._pool_buf_size)
        pick = None if give_up else self._slot_pick(peer, need, first=False)
        if pick is _WAIT:
            return
        self._slot_undefer(peer)
        try:
            if pick is None:
                self._send_rendezvous(peer, edge, views, segments, size, token)
            else:
                self._slot_fill(peer, edge, pick, head, body, size, token)
        except self._MPI.Exception as e:
            self._lose(peer, f"MPI error sending to it: {e.Get_error_string()}")

    def _slot_undefer(self, peer: int) -> None:
        """``peer``'s held message leaves (sent, or dropped): its bookkeeping, and credit for a smaller
        message refused behind it."""
        edge, _, _, size, _ = self._slot_deferred.pop(peer)
        self._pending_sends[peer] -= 1
        self._pending_bytes[peer] -= size
        if peer not in self._lost:
            self._pending_total -= 1
        if peer in self._slot_blocked:
            self._slot_blocked.discard(peer)
            self._events.append((self._handler.on_credit, (peer, edge)))  # type: ignore[union-attr]

    def _slot_drop_deferred(self, peer: int) -> None:
        """``peer`` left or was lost: forget the message held for it (its on_sent never comes)."""
        if peer in self._slot_deferred:
            self._slot_undefer(peer)

    def _slot_grow(self, peer: int, size: int) -> bool:
        """A message of ``size`` bytes came from ``peer`` through MPI: make sure it has slots that hold
        such messages. True if it has them (then no pre-posted receives are offered to it)."""
        own = self._slots_in
        if (size > _SLOT_MAX or peer not in self._slot_peers or own.disabled(peer) or self._bye_sent
                or peer in self._bye_from or peer in self._lost):
            return False
        if not own.covers(peer, size):
            # a sixteenth of room to spare, so sizes that vary a little do not make slots grow again
            self._slot_tell(peer, own.grow(peer, size, _pre_cap(size + (size >> 4))))
        return own.covers(peer, size)

    def _slot_tell(self, peer: int, actions: list[tuple[str, Any]]) -> None:
        """Send ``peer`` the offers, grants and retirements a SlotOwner call returned."""
        if not actions or peer in self._lost or peer in self._bye_from:
            return
        msgs = []
        grants = [x for kind, x in actions if kind == "grant"]
        retires = [x for kind, x in actions if kind == "retire"]
        for kind, x in actions:
            if kind == "offer":
                msgs.append(_encode_slot_offer(x))
                self.stats["slot_offers"] += 1
        # a retirement goes after the offers of the slots that replace the retired ones
        msgs += _encode_slot_ids(_KIND_SLOT_GRANT, grants) if grants else []
        msgs += _encode_slot_ids(_KIND_SLOT_RETIRE, retires) if retires else []
        for msg in msgs:
            try:
                self._submit(msg, TAG_CTRL, _Send(peer, msg), urgent=True)
            except self._MPI.Exception as e:
                self._lose(peer, f"MPI error sending a slot message: {e.Get_error_string()}")
                return

    def _slot_answer(self, peer: int, slot: int, answer: str) -> None:
        """Tell ``peer`` (on TAG_DATA, in order with our headers) what we did with its slot."""
        if peer in self._lost or peer in self._bye_from or self._bye_sent:
            return              # it no longer reads our data messages (or we said goodbye)
        msg = _encode_slot_answer(slot, answer)
        try:
            self._submit(msg, TAG_DATA, _Send(peer, msg))
        except self._MPI.Exception as e:
            self._lose(peer, f"MPI error answering a slot message: {e.Get_error_string()}")

    def _slot_control(self, peer: int, kind: int, body: Any) -> None:
        """A slot offer, grants or retirements from ``peer``, which we fill slots of."""
        out = self._slots_out
        if kind == _KIND_SLOT_OFFER:
            if self._bye_sent:
                return          # leaving: the peer unlinks its file when it closes
            ok = peer in self._slot_peers and out.offered(peer, body)
            self._slot_answer(peer, body.slot, "ack" if ok else "refuse")
        elif kind == _KIND_SLOT_GRANT:
            for slot in body:
                out.granted(peer, slot)
            self._slot_slow[peer] = False
        else:
            for slot in body:
                out.retire(peer, slot)
                self._slot_answer(peer, slot, "retired")
        if peer in self._slot_deferred:
            self._slot_run_deferred(peer)

    def _slot_filled(self, peer: int, buf: bytearray, flags: int, edge: int, size: int) -> None:
        """A header from ``peer``: the message is in one of our slots (or, split, is being copied in:
        then it waits for its second half and the sender's done marker). Deliver it in order on its edge."""
        mv = memoryview(buf)
        start = _HDR.size + _SLOT_EXT.size
        slot_id, head = _SLOT_EXT.unpack_from(mv, _HDR.size)
        cut = 0
        if flags & _FLAG_SPLIT:
            (cut,) = _SLOT_SPLIT.unpack_from(mv, start)
            start += _SLOT_SPLIT.size
            if not 0 < cut < size - head:
                raise ProtocolError(f"split slot header from rank {peer} cuts {size - head} bytes at {cut}")
        if head > size or start + head > mv.nbytes:
            raise ProtocolError(f"slot header from rank {peer} with a bad head ({head} of {size} bytes)")
        target, slot = self._slots_in.fill(peer, slot_id, head, size - head)
        if head:
            target[:head] = mv[start:start + head]
        self._post_data_recv(peer, buf)
        data = memoryview(target)  # type: ignore[arg-type]  # numpy declares __buffer__ for >= 3.12 only
        rel = _Release(self, peer, edge, size or 1, None, False, slot)
        self.stats["slot_received"] += 1
        key = (peer, edge)
        q = self._order.get(key)
        if cut:
            inc = _Incoming(peer, edge, data, rel, False, 2)    # the second half, and the done marker
            if q is None:
                q = self._order[key] = deque()
            q.append(inc)
            self._split_in[(peer, slot_id)] = inc
            self._post(self._comm.Irecv([target[head + cut:], self._MPI.BYTE], peer, TAG_BULK), _BulkRecv(peer, inc))
            self._bulk_pending[peer] += 1
            return
        self.stats["msgs_received"] += 1
        self.stats["bytes_received"] += size
        if q:
            q.append(_Incoming(peer, edge, data, rel, True))
        else:
            self._events.append((self._handler.on_message, (peer, edge, data, rel)))  # type: ignore[union-attr]

    def _slot_half_done(self, peer: int, slot_id: int) -> None:
        """The sender's half of a split slot message is in."""
        inc = self._split_in.pop((peer, slot_id), None)
        if inc is None:
            raise ProtocolError(f"rank {peer} finished slot {slot_id}, which holds no split message")
        inc.left -= 1
        if not inc.left:
            self._ready(inc)

