"""Shared-memory landing slots: large messages between ranks on one host, copied once by the sender.

Over MPI a large message between two processes on one host is copied by the *receiver* (MPICH reads
the sender's pages with ``process_vm_readv``), page by page, inside the receiver's progress call, and
the sender may not return before that copy ends: per message the two sides run one after the other,
and the receiver's own per-message work (reading the header, handing the record on, posting the next
receive) sits between two copies. With landing slots the receiver instead owns a few files in
``/dev/shm`` per sending peer that both map; the sender copies a payload straight into a slot the
receiver granted it (a user-space ``memcpy``, about twice the speed of the kernel's cross-process copy
here), sends a small header naming the slot, and is done; the receiver hands out a view of the slot
and grants it back when the consumer releases the message. Two slots per peer let the sender fill one
while the receiver still works on the other.

This module holds the pieces that need no MPI: segment files (:func:`create_segment`,
:func:`attach_segment`), the receiver's table of slots (:class:`SlotOwner`) and the sender's
(:class:`SlotUser`), each a small state machine driven by the channel with the messages below. The
MPI channel (:mod:`channels.mpi`) carries them: receiver -> sender on its control tag (offer, grant,
retire), sender -> receiver on its data tag (ack, refuse, retired), where MPI keeps them in order with
the data headers. That order is what makes reuse safe:

* ``offer(slot)``: the receiver created a slot file for this sender. The sender maps it (checking a
  random nonce, so a rank that does not really share ``/dev/shm`` with us, e.g. in another container,
  finds out) and answers ``ack`` or ``refuse``. From the offer on, the slot is the sender's to fill.
  On ``ack`` the receiver unlinks the file: it lives on only as long as the two mappings.
* A data header naming the slot: the sender filled it and gives it up; the receiver delivers it.
* ``grant(slot)``: the consumer released that message and kept no view of it: the sender may fill
  the slot again. A slot still viewed after release is never reused (it is retired instead), exactly
  like the channel's other receive buffers.
* ``retire(slot)`` / ``retired(slot)``: the receiver takes a slot back (outgrown by bigger messages,
  or still viewed); the sender unmaps it and confirms, after any header that still names it.

Slot files are segments of :mod:`twisternet.shm` (kind ``slot``): reserved with ``posix_fallocate``
before anyone maps them (a full tmpfs is a plain error, and the peer just keeps using MPI), created
``0600`` with ``O_EXCL | O_NOFOLLOW`` under a ``twisternet-shm-<pid>-slot-`` name, and unlinked once
mapped (or at close); only a process killed between creating a file and the peer's answer leaves one
behind, and the next Context started on the machine removes it (:func:`twisternet.shm.sweep_stale`).

Memory: the receiver's slots take at most ``budget`` bytes in total, a slot at most ``max_cap``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from twisternet import shm
from twisternet.errors import ProtocolError

log = logging.getLogger(__name__)

#: Where slot files live (a tmpfs on Linux).
SHM_DIR = shm.SHM_DIR
#: File name prefix of slot files (followed by the creating pid, ``slot`` and a random token).
PREFIX = shm.PREFIX
#: The kind of shared-memory segment a slot file is (see twisternet.shm).
KIND = "slot"
#: Bytes of the random nonce at the start of every slot file.
NONCE = 16
#: Where a slot's payload starts: page-aligned, with room before it for a small first part of the
#: message (the codec's head before an array) that travels in the header and is put right before it.
PAYLOAD_START = 8192
#: Most bytes of such a head.
HEAD_ROOM = PAYLOAD_START - NONCE
_PAGE = 4096

Segment = shm.Segment
unlink = shm.unlink


def supported() -> bool:
    """Whether this machine can offer slots at all: Linux with a tmpfs at :data:`SHM_DIR`."""
    return shm.supported()


def slot_file_size(cap: int) -> int:
    """Bytes of a slot file holding a payload of up to ``cap`` bytes."""
    return PAYLOAD_START + -(-cap // _PAGE) * _PAGE


def create_segment(cap: int) -> Segment:
    """A new slot file for ``cap`` payload bytes, reserved in full and mapped; OSError if the tmpfs
    cannot hold it (nothing is left behind then)."""
    return shm.create(KIND, slot_file_size(cap), nonce_at=0, nonce_bytes=NONCE, populate=True)


def check_path(path: str) -> None:
    """ValueError unless ``path`` names a slot file directly in :data:`SHM_DIR`."""
    shm.check_path(path, KIND)


def attach_segment(path: str, size: int, nonce: bytes) -> Segment:
    """Map a slot file another process offered; ValueError/OSError if it is not that file."""
    check_path(path)
    if size < PAYLOAD_START or size % _PAGE:
        raise ValueError(f"slot file size {size} is not a valid slot size")
    return shm.attach(path, size, nonce, kind=KIND, nonce_at=0, populate=True)


def sweep_stale() -> list[str]:
    """Remove shared-memory segments (slot files and others) whose creating process is gone; returns
    their paths. The same sweep runs whenever a Context starts (twisternet.leftovers)."""
    return shm.sweep_stale()


@dataclass(frozen=True)
class Offer:
    """What the receiver tells the sender about a new slot."""

    slot: int
    cap: int
    size: int
    nonce: bytes
    path: str


# --- the receiver's side ------------------------------------------------------------------------------

class OwnedSlot:
    """A slot this process created for ``peer`` to fill."""

    __slots__ = ("id", "peer", "cap", "seg", "at_sender", "answered", "full", "retiring", "stale", "gone",
                 "linked")

    def __init__(self, slot_id: int, peer: int, cap: int, seg: Segment) -> None:
        self.id = slot_id
        self.peer = peer
        self.cap = cap
        self.seg = seg
        self.at_sender = True    # the sender may fill it (from the offer on, until its header)
        self.answered = False    # the sender said whether it mapped the slot
        self.full = False        # holds a delivered message not yet released
        self.retiring = False    # retire sent, retired not yet received
        self.stale = False       # outgrown: taken back instead of granted when it comes back
        self.gone = False        # the sender let it go (retired) while it still held a message
        self.linked = True       # its file still has a name


class SlotOwner:
    """The receiver's slots, per sending peer. Methods return what to tell the peer:
    lists of ``("offer", Offer)``, ``("grant", id)`` and ``("retire", id)``.

    A peer gets ``per_peer`` slots (as the budget allows): with two, a sender can fill one while its
    consumer still holds the message in the other (a consumer that takes the next message before it
    releases the last would otherwise stall every other send)."""

    def __init__(self, budget: int, max_cap: int, per_peer: int = 2) -> None:
        self.budget = budget
        self.max_cap = max_cap
        self.per_peer = per_peer
        self.used = 0                                   # bytes of slot files not yet dropped
        #: Slots a sender may be filling right now (a header may come any moment).
        self.lent = 0
        self._slots: dict[int, OwnedSlot] = {}
        self._next_id = 1
        self._disabled: set[int] = set()
        self._best: dict[int, int] = {}                 # peer -> cap of its newest slots

    def covers(self, peer: int, n: int) -> bool:
        """Whether ``peer`` has slots for payloads of ``n`` bytes (offered, maybe not yet answered)."""
        return peer not in self._disabled and self._best.get(peer, 0) >= n

    def holding(self, peer: int) -> bool:
        """Whether a message of ``peer``'s is in one of its slots here, not yet released."""
        return any(s.full for s in self._slots.values() if s.peer == peer)

    def disabled(self, peer: int) -> bool:
        """Whether ``peer`` refused a slot (it gets no more offers)."""
        return peer in self._disabled

    def grow(self, peer: int, n: int, cap: int) -> list[tuple[str, Any]]:
        """A payload of ``n`` bytes came from ``peer`` without a slot big enough: create slots of
        ``cap`` bytes (up to ``per_peer`` of them, as the budget allows) and take the smaller ones
        back. Nothing if ``peer`` is disabled, ``cap`` is over ``max_cap``, no slot fits the budget, or
        an earlier offer to ``peer`` is still unanswered (it may yet be refused)."""
        if peer in self._disabled or self.covers(peer, n) or cap > self.max_cap or cap < n:
            return []
        if any(s.peer == peer and not s.answered for s in self._slots.values()):
            return []
        out = self._create(peer, cap, self.per_peer)
        if not out:
            return []
        self._best[peer] = cap
        new = {o.slot for _, o in out}
        for slot in self._slots.values():
            if slot.peer == peer and slot.id not in new and not slot.stale:
                slot.stale = True
                if slot.at_sender and not slot.retiring:
                    slot.retiring = True
                    out.append(("retire", slot.id))
        return out

    def _create(self, peer: int, cap: int, count: int) -> list[tuple[str, Any]]:
        """Up to ``count`` new slots of ``cap`` bytes for ``peer``, as the budget and the tmpfs allow."""
        out: list[tuple[str, Any]] = []
        for _ in range(count):
            size = slot_file_size(cap)
            if self.used + size > self.budget:
                break
            try:
                seg = create_segment(cap)
            except OSError as e:
                log.info("no shared-memory slot of %d bytes for rank %d: %s", cap, peer, e)
                break
            slot = OwnedSlot(self._next_id, peer, cap, seg)
            self._next_id += 1
            self._slots[slot.id] = slot
            self.used += seg.size
            self.lent += 1
            out.append(("offer", Offer(slot.id, cap, seg.size, seg.nonce, seg.path)))
        return out

    def _get(self, peer: int, slot_id: int, what: str) -> OwnedSlot:
        slot = self._slots.get(slot_id)
        if slot is None or slot.peer != peer:
            raise ProtocolError(f"rank {peer} {what} slot {slot_id}, which is not one of its slots")
        return slot

    def fill(self, peer: int, slot_id: int, head: int, payload: int) -> tuple[np.ndarray, OwnedSlot]:
        """A header from ``peer``: slot ``slot_id`` holds ``payload`` bytes, preceded by ``head``
        bytes that travelled in the header. Returns the message's bytes (the caller writes the head
        into their first ``head`` bytes) and the slot, now the consumer's until released."""
        slot = self._get(peer, slot_id, "filled")
        if not slot.at_sender or slot.full or not slot.answered:
            raise ProtocolError(f"rank {peer} filled slot {slot_id}, which it does not hold")
        if payload > slot.cap or not 0 <= head <= HEAD_ROOM or slot.seg.array is None:
            raise ProtocolError(f"rank {peer} put {head} + {payload} bytes into slot {slot_id} of {slot.cap}")
        slot.at_sender = False
        self.lent -= 1
        slot.full = True
        return slot.seg.array[PAYLOAD_START - head:PAYLOAD_START + payload], slot

    def released(self, slot: OwnedSlot) -> list[tuple[str, Any]]:
        """The consumer released the message in ``slot``: grant it back, or take it back if it is
        still viewed or outgrown (or drop it, if the sender already let it go)."""
        if slot.id not in self._slots or not slot.full:
            return []
        slot.full = False
        if slot.gone:
            self._drop(slot)
            return []
        if slot.retiring:
            return []                            # waiting for the sender's retired
        if slot.seg.viewed() or slot.stale:
            news: list[tuple[str, Any]] = []
            if not slot.stale:          # still viewed, not outgrown: replace it, as the budget allows
                news = self._create(slot.peer, slot.cap, 1)
            slot.stale = True
            slot.retiring = True
            return news + [("retire", slot.id)]
        slot.at_sender = True
        self.lent += 1
        return [("grant", slot.id)]

    def answered(self, peer: int, kind: str, slot_id: int) -> None:
        """The sender's answer about a slot: "ack" (mapped), "refuse" (cannot map: no more offers
        to it) or "retired" (it let the slot go)."""
        slot = self._slots.get(slot_id)
        if slot is None or slot.peer != peer:
            if kind == "retired":
                return                           # answered after a refusal dropped it: nothing left
            raise ProtocolError(f"rank {peer} answered {kind} about slot {slot_id}, not one of its slots")
        slot.answered = True
        if kind == "ack":
            if slot.linked:
                unlink(slot.seg.path)
                slot.linked = False
        elif kind == "refuse":
            log.info("rank %d cannot map shared-memory slots; large messages from it keep going through MPI", peer)
            self._disabled.add(peer)
            self._drop(slot)
        elif kind == "retired":
            if not slot.retiring:
                raise ProtocolError(f"rank {peer} retired slot {slot_id}, which was not taken back")
            if slot.at_sender:
                slot.at_sender = False
                self.lent -= 1
            slot.retiring = False
            if slot.full:                        # filled before the sender saw the retire
                slot.gone = True
            else:
                self._drop(slot)
        else:
            raise ProtocolError(f"unknown slot answer {kind!r}")

    def _drop(self, slot: OwnedSlot) -> None:
        del self._slots[slot.id]
        if slot.at_sender:
            slot.at_sender = False
            self.lent -= 1
        self.used -= slot.seg.size
        if slot.linked:
            unlink(slot.seg.path)
            slot.linked = False
        slot.seg.close()
        if not any(s.peer == slot.peer for s in self._slots.values()):
            self._best.pop(slot.peer, None)

    def drop_peer(self, peer: int) -> None:
        """``peer`` left or was lost: forget its slots (views handed out stay valid)."""
        for slot in [s for s in self._slots.values() if s.peer == peer]:
            self._drop(slot)
        self._best.pop(peer, None)

    def close(self) -> None:
        for peer in {s.peer for s in self._slots.values()}:
            self.drop_peer(peer)

    def slots_of(self, peer: int) -> list[OwnedSlot]:
        """``peer``'s slots (for tests and stats)."""
        return [s for s in self._slots.values() if s.peer == peer]


# --- the sender's side --------------------------------------------------------------------------------

class MappedSlot:
    """A receiver's slot this process maps: ``payload`` is where its payload goes."""

    __slots__ = ("id", "peer", "cap", "seg", "payload", "free")

    def __init__(self, slot_id: int, peer: int, cap: int, seg: Segment) -> None:
        self.id = slot_id
        self.peer = peer
        self.cap = cap
        self.seg = seg
        assert seg.array is not None
        self.payload: np.ndarray | None = seg.array[PAYLOAD_START:PAYLOAD_START + cap]
        self.free = True

    def close(self) -> None:
        """Unmap it (the payload view first: it holds the mapping)."""
        self.payload = None
        self.seg.close()


class SlotUser:
    """The slots receivers offered this process, per receiving peer."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._slots: dict[tuple[int, int], MappedSlot] = {}
        self._free: dict[int, list[MappedSlot]] = {}
        self._held: dict[int, int] = {}          # peer -> slots filled and not granted back yet
        self._last: dict[int, MappedSlot] = {}   # peer -> the slot filled most recently

    def offered(self, peer: int, offer: Offer) -> bool:
        """Map an offered slot; False (answer "refuse") if this process cannot or may not."""
        if not self.enabled:
            return False
        if (peer, offer.slot) in self._slots:
            raise ProtocolError(f"rank {peer} offered slot {offer.slot} twice")
        if offer.size != slot_file_size(offer.cap):
            raise ProtocolError(f"rank {peer} offered slot {offer.slot} of {offer.cap} bytes in a "
                                f"file of {offer.size}")
        try:
            seg = attach_segment(offer.path, offer.size, offer.nonce)
        except (OSError, ValueError) as e:
            log.info("cannot map rank %d's shared-memory slot %s: %s", peer, offer.path, e)
            return False
        slot = MappedSlot(offer.slot, peer, offer.cap, seg)
        self._slots[(peer, offer.slot)] = slot
        self._free.setdefault(peer, []).append(slot)
        return True

    def take(self, peer: int, n: int, only: MappedSlot | None = None) -> MappedSlot | None:
        """The smallest free slot of ``peer`` that holds ``n`` bytes (the one filled last among equals),
        or just ``only`` if given, now no longer free; or None."""
        free = self._free.get(peer)
        if not free:
            return None
        best = None
        if only is not None:
            best = only if only.free and only.cap >= n and only.peer == peer else None
        else:
            last = self._last.get(peer)
            for slot in free:
                if slot.cap >= n and (best is None or slot.cap < best.cap or (slot.cap == best.cap and slot is last)):
                    best = slot
        if best is None:
            return None
        free.remove(best)
        best.free = False
        self._held[peer] = self._held.get(peer, 0) + 1
        self._last[peer] = best
        return best

    def last(self, peer: int) -> MappedSlot | None:
        """The slot of ``peer`` filled most recently (free again or not), if it still exists."""
        return self._last.get(peer)

    def waiting(self, peer: int, n: int = 0) -> bool:
        """Whether a slot of ``peer`` that holds ``n`` bytes is filled and may come back (a grant is
        worth waiting for)."""
        if not self._held.get(peer, 0):
            return False
        return any(not s.free and s.cap >= n for (p, _), s in self._slots.items() if p == peer)

    def granted(self, peer: int, slot_id: int) -> None:
        slot = self._slots.get((peer, slot_id))
        if slot is None or slot.free:
            raise ProtocolError(f"rank {peer} granted slot {slot_id}, which we do not hold filled")
        slot.free = True
        self._held[peer] -= 1
        self._free[peer].append(slot)

    def retire(self, peer: int, slot_id: int) -> None:
        """The receiver takes the slot back: unmap it (answer "retired" in any case)."""
        slot = self._slots.pop((peer, slot_id), None)
        if slot is None:
            return                               # refused before, or never heard of: nothing to undo
        if self._last.get(peer) is slot:
            del self._last[peer]
        if slot.free:
            self._free[peer].remove(slot)
        else:
            self._held[peer] -= 1
        slot.close()

    def drop_peer(self, peer: int) -> None:
        for key in [k for k in self._slots if k[0] == peer]:
            self._slots.pop(key).close()
        self._free.pop(peer, None)
        self._held.pop(peer, None)
        self._last.pop(peer, None)

    def close(self) -> None:
        for peer in {k[0] for k in self._slots}:
            self.drop_peer(peer)

    def slots_of(self, peer: int) -> list[MappedSlot]:
        return [s for k, s in self._slots.items() if k[0] == peer]


__all__ = ["SHM_DIR", "PREFIX", "PAYLOAD_START", "HEAD_ROOM", "Offer", "Segment", "SlotOwner", "SlotUser",
           "OwnedSlot", "MappedSlot", "create_segment", "attach_segment", "check_path", "slot_file_size",
           "supported", "sweep_stale", "unlink"]
