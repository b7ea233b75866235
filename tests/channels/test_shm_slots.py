"""Shared-memory landing slots without MPI: segment files, and the receiver's and sender's state
machines driven by hand in one process (the MPI channel carries the same calls between ranks)."""

from __future__ import annotations

import errno
import glob
import os

import numpy as np
import pytest

from channels import shm_slots as S
from twisternet.errors import ProtocolError
from twisternet.owner import namespace_tag

pytestmark = pytest.mark.skipif(not S.supported(), reason="needs Linux with a tmpfs at /dev/shm")

MB = 1 << 20
PEER = 3


def my_files() -> list[str]:
    return glob.glob(os.path.join(S.SHM_DIR, f"{S.PREFIX}{os.getpid()}-*"))


@pytest.fixture(autouse=True)
def no_files_left():
    before = set(my_files())
    yield
    left = set(my_files()) - before
    for path in left:               # (removed either way, so a failing test leaves nothing in /dev/shm)
        S.unlink(path)
    assert not left, f"a test left slot files behind: {sorted(left)}"


def pair(budget: int = 64 * MB, max_cap: int = 32 * MB, per_peer: int = 1) -> tuple[S.SlotOwner, S.SlotUser]:
    return S.SlotOwner(budget=budget, max_cap=max_cap, per_peer=per_peer), S.SlotUser()


def offer_all(owner: S.SlotOwner, user: S.SlotUser, actions: list) -> list[int]:
    """Deliver the owner's offers to the user and the user's answers back; return the slot ids."""
    ids = []
    for kind, x in actions:
        if kind == "offer":
            answer = "ack" if user.offered(PEER, x) else "refuse"
            owner.answered(PEER, answer, x.slot)
            ids.append(x.slot)
    return ids


def fill(user: S.SlotUser, owner: S.SlotOwner, data: bytes, head: bytes = b"") -> tuple[np.ndarray, S.OwnedSlot]:
    """The sender copies ``data`` into a free slot; the receiver gets the message (head + data)."""
    slot = user.take(PEER, len(data))
    assert slot is not None
    slot.payload[:len(data)] = np.frombuffer(data, np.uint8)
    target, owned = owner.fill(PEER, slot.id, len(head), len(data))
    target[:len(head)] = np.frombuffer(head, np.uint8)
    return target, owned


# --- segment files -----------------------------------------------------------------------------------

def test_segment_round_trip_and_unlink() -> None:
    seg = S.create_segment(MB)
    assert seg.size == S.slot_file_size(MB) and seg.size % 4096 == 0
    assert os.stat(seg.path).st_mode & 0o777 == 0o600
    other = S.attach_segment(seg.path, seg.size, seg.nonce)
    other.array[S.PAYLOAD_START:S.PAYLOAD_START + 5] = np.frombuffer(b"hello", np.uint8)
    assert bytes(seg.array[S.PAYLOAD_START:S.PAYLOAD_START + 5]) == b"hello"   # one memory, two mappings
    S.unlink(seg.path)
    S.unlink(seg.path)          # idempotent
    other.close()
    seg.close()
    seg.close()


def test_attach_checks_path_size_and_nonce() -> None:
    seg = S.create_segment(64 << 10)
    try:
        with pytest.raises(ValueError, match="nonce"):
            S.attach_segment(seg.path, seg.size, b"x" * S.NONCE)
        with pytest.raises(ValueError, match="bytes"):
            S.attach_segment(seg.path, seg.size + 4096, seg.nonce)
        for bad in ("/etc/passwd", S.SHM_DIR + "/other-file", S.SHM_DIR + "/" + S.PREFIX + "../x",
                    S.SHM_DIR + "/" + S.PREFIX + "a/b", "relative-" + S.PREFIX):
            with pytest.raises(ValueError, match="not a twisternet shared-memory segment of kind 'slot'"):
                S.attach_segment(bad, seg.size, seg.nonce)
        with pytest.raises(FileNotFoundError):
            S.attach_segment(S.SHM_DIR + "/" + S.PREFIX + "1-00000000-slot-" + "0" * 16, seg.size, seg.nonce)
    finally:
        seg.close()
        S.unlink(seg.path)


def test_files_of_processes_that_are_gone_are_swept() -> None:
    import subprocess
    import sys
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    stale = os.path.join(S.SHM_DIR, f"{S.PREFIX}{gone}-{namespace_tag()}-slot-0123456789abcdef")
    mine = S.create_segment(4096)
    open(stale, "wb").close()
    try:
        # (other processes on the machine sweep too, and other dead processes' files may go with ours:
        # what counts is that the dead process's file is gone and the live one's is not)
        removed = S.sweep_stale()
        assert not os.path.exists(stale) and os.path.exists(mine.path), "only the dead process's file goes"
        assert mine.path not in removed
    finally:
        S.unlink(stale)
        mine.close()
        S.unlink(mine.path)


def test_a_full_tmpfs_is_an_error_not_a_sigbus(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError):
        S.create_segment(MB)
    owner = S.SlotOwner(budget=64 * MB, max_cap=32 * MB)
    assert owner.grow(PEER, 2 * MB, 2 * MB) == []      # no offer, the peer keeps using MPI
    assert owner.used == 0 and not owner.covers(PEER, 1)


# --- the protocol --------------------------------------------------------------------------------------

def test_fill_deliver_grant_and_refill() -> None:
    owner, user = pair()
    ids = offer_all(owner, user, owner.grow(PEER, 3 * MB, 4 * MB))
    assert len(ids) == 1 and owner.covers(PEER, 4 * MB) and not owner.covers(PEER, 4 * MB + 1)
    assert owner.lent == 1
    path = owner.slots_of(PEER)[0].seg.path
    assert not os.path.exists(path), "the file is unlinked once the sender mapped it"
    for i in range(3):
        data = bytes([i]) * (3 * MB)
        target, slot = fill(user, owner, data, head=b"HEAD")
        assert owner.lent == 0 and user.take(PEER, 1) is None and user.waiting(PEER)
        assert user.waiting(PEER, 3 * MB) and not user.waiting(PEER, 4 * MB + 1), "only if it would fit"
        assert bytes(target[:4]) == b"HEAD" and bytes(target[4:]) == data
        del target
        news = owner.released(slot)
        assert news == [("grant", slot.id)]
        user.granted(PEER, slot.id)
        assert not user.waiting(PEER) and owner.lent == 1
    owner.close()
    user.close()
    assert owner.used == 0 and owner.lent == 0


def test_a_view_kept_after_release_retires_the_slot_for_a_new_one_and_stays_intact() -> None:
    owner, user = pair()
    offer_all(owner, user, owner.grow(PEER, 2 * MB, 2 * MB))
    target, slot = fill(user, owner, b"\x07" * (2 * MB))
    kept = np.frombuffer(memoryview(target), np.uint8)      # what a consumer might hold on to
    del target
    news = owner.released(slot)
    assert [k for k, _ in news] == ["offer", "retire"] and news[1][1] == slot.id
    assert news[0][1].cap == slot.cap and news[0][1].slot != slot.id, "a replacement of the same size"
    offer_all(owner, user, news)
    user.retire(PEER, slot.id)
    owner.answered(PEER, "retired", slot.id)
    assert [s.id for s in owner.slots_of(PEER)] == [news[0][1].slot] == [s.id for s in user.slots_of(PEER)]
    assert owner.used == S.slot_file_size(2 * MB)
    assert int(kept.min()) == 7 == int(kept.max()), "a kept view must stay mapped and unchanged"
    fill(user, owner, b"\x08" * (2 * MB))                   # the replacement, not the kept memory
    assert int(kept.max()) == 7
    owner.close()
    user.close()
    assert int(kept.max()) == 7, "and survives close"


def test_a_kept_view_with_no_budget_left_loses_the_slot() -> None:
    owner, user = pair(budget=S.slot_file_size(2 * MB))
    offer_all(owner, user, owner.grow(PEER, 2 * MB, 2 * MB))
    target, slot = fill(user, owner, b"\x01" * 10)
    assert owner.released(slot) == [("retire", slot.id)]    # no room for a replacement
    user.retire(PEER, slot.id)
    owner.answered(PEER, "retired", slot.id)
    assert not owner.slots_of(PEER) and owner.used == 0
    assert not owner.covers(PEER, 1), "with its only slot gone the peer may be offered a new one"
    assert bytes(target[:10]) == b"\x01" * 10
    owner.close()
    user.close()


def test_growth_offers_bigger_slots_and_retires_the_small_ones_even_mid_fill() -> None:
    owner, user = pair(per_peer=2)
    small = offer_all(owner, user, owner.grow(PEER, MB, MB))
    assert len(small) == 2, "two slots per peer"
    # the sender fills a small slot while the receiver, seeing a bigger message come through MPI,
    # decides to grow: the retirement crosses the header on the wire
    s = user.take(PEER, MB)
    news = owner.grow(PEER, 10 * MB, 11 * MB)
    offers = [x for k, x in news if k == "offer"]
    assert [k for k, _ in news] == ["offer", "offer", "retire", "retire"]
    assert sorted(x for k, x in news if k == "retire") == sorted(small)
    assert all(o.cap == 11 * MB for o in offers)
    target, owned = owner.fill(PEER, s.id, 0, MB)          # the header arrives first: still delivered
    for o in offers:
        assert user.offered(PEER, o)
        owner.answered(PEER, "ack", o.slot)
    for sid in small:                                       # then the sender sees the retirements
        user.retire(PEER, sid)
        owner.answered(PEER, "retired", sid)
    assert len(owner.slots_of(PEER)) == 3, "the filled small slot lives on until its message is released"
    del target
    assert owner.released(owned) == []                      # dropped now, never granted again
    assert {x.id for x in owner.slots_of(PEER)} == {o.slot for o in offers}
    assert owner.used == 2 * S.slot_file_size(11 * MB)
    assert user.take(PEER, MB) is not None and user.take(PEER, 11 * MB) is not None
    assert user.take(PEER, 1) is None
    owner.close()
    user.close()


def test_the_sender_prefers_the_slot_it_filled_last() -> None:
    owner, user = pair(per_peer=2)
    offer_all(owner, user, owner.grow(PEER, MB, MB))
    a = user.take(PEER, 10)
    target, owned_a = owner.fill(PEER, a.id, 0, 10)
    del target
    assert user.last(PEER) is a
    b = user.take(PEER, 10)
    assert b is not a and user.last(PEER) is b and user.take(PEER, 1) is None
    assert owner.released(owned_a) == [("grant", a.id)]
    user.granted(PEER, a.id)
    assert user.take(PEER, 10, only=b) is None, "b is still out"
    assert user.take(PEER, 10, only=a) is a
    owner.close()
    user.close()


def test_no_new_offer_while_one_is_unanswered() -> None:
    owner, user = pair()
    first = owner.grow(PEER, MB, MB)
    assert len(first) == 1 and owner.grow(PEER, 3 * MB, 3 * MB) == [], "the first may yet be refused"
    offer = first[0][1]
    with pytest.raises(ProtocolError, match="does not hold"):
        owner.fill(PEER, offer.slot, 0, 10)      # a header before the sender's answer: impossible in order
    assert user.offered(PEER, offer)
    owner.answered(PEER, "ack", offer.slot)
    assert [k for k, _ in owner.grow(PEER, 3 * MB, 3 * MB)] == ["offer", "retire"]
    owner.close()
    user.close()


def test_release_before_the_senders_retired_waits_for_it() -> None:
    owner, user = pair()
    small = offer_all(owner, user, owner.grow(PEER, MB, MB))[0]
    s = user.take(PEER, MB)
    owner.grow(PEER, 3 * MB, 3 * MB)
    target, owned = owner.fill(PEER, s.id, 0, 10)
    del target
    assert owner.released(owned) == []          # retire already sent: wait for the answer
    assert any(x.id == small for x in owner.slots_of(PEER))
    owner.answered(PEER, "retired", small)
    assert all(x.id != small for x in owner.slots_of(PEER))
    owner.close()
    user.close()


def test_budget_max_cap_and_refusal() -> None:
    owner = S.SlotOwner(budget=3 * MB // 2, max_cap=2 * MB)     # room for one slot of 1 MB + 1
    assert owner.grow(PEER, 3 * MB, 3 * MB) == [], "over max_cap"
    news = owner.grow(PEER, MB, MB + 1)
    assert len(news) == 1 and owner.used == S.slot_file_size(MB + 1)
    assert owner.grow(PEER + 1, MB, 2 * MB) == [], "over the budget"
    refusing = S.SlotUser(enabled=False)
    assert not refusing.offered(PEER, news[0][1])
    owner.answered(PEER, "refuse", news[0][1].slot)
    assert owner.disabled(PEER) and not owner.covers(PEER, 1) and owner.used == 0
    assert owner.grow(PEER, MB, MB) == [], "a peer that refused gets no more offers"
    owner.answered(PEER, "retired", news[0][1].slot)        # a late answer about it is harmless
    owner.close()


def test_protocol_errors_name_the_peer() -> None:
    owner, user = pair()
    sid = offer_all(owner, user, owner.grow(PEER, MB, MB))[0]
    with pytest.raises(ProtocolError, match="not one of its slots"):
        owner.fill(PEER + 1, sid, 0, 10)
    with pytest.raises(ProtocolError, match="not one of its slots"):
        owner.fill(PEER, sid + 100, 0, 10)
    with pytest.raises(ProtocolError, match="bytes into slot"):
        owner.fill(PEER, sid, 0, MB + 1)
    with pytest.raises(ProtocolError, match="bytes into slot"):
        owner.fill(PEER, sid, S.HEAD_ROOM + 1, 10)
    target, slot = owner.fill(PEER, sid, 0, 10)
    with pytest.raises(ProtocolError, match="does not hold"):
        owner.fill(PEER, sid, 0, 10)
    with pytest.raises(ProtocolError, match="not taken back"):
        owner.answered(PEER, "retired", sid)
    with pytest.raises(ProtocolError, match="unknown slot answer"):
        owner.answered(PEER, "maybe", sid)
    with pytest.raises(ProtocolError, match="granted slot"):
        user.granted(PEER, sid)                  # the user never filled it
    o = S.Offer(sid, MB, S.slot_file_size(MB), b"n" * S.NONCE, "/dev/shm/" + S.PREFIX + "x")
    with pytest.raises(ProtocolError, match="twice"):
        user.offered(PEER, o)
    with pytest.raises(ProtocolError, match="file of"):
        user.offered(PEER, S.Offer(sid + 1, MB, 4096, b"n" * S.NONCE, o.path))
    del target
    owner.close()
    user.close()


def test_dropping_a_peer_keeps_views_and_removes_files() -> None:
    owner, user = pair()
    owner.grow(PEER, MB, MB)                     # offered, never answered: its file still has a name
    assert len(my_files()) == 1
    news = owner.grow(PEER + 1, MB, MB)
    user2 = S.SlotUser()
    for _, o in news:
        assert user2.offered(PEER + 1, o)
        owner.answered(PEER + 1, "ack", o.slot)
    s = user2.take(PEER + 1, 4)
    s.payload[:4] = np.frombuffer(b"keep", np.uint8)
    target, _ = owner.fill(PEER + 1, s.id, 0, 4)
    owner.drop_peer(PEER)
    owner.drop_peer(PEER + 1)
    user2.drop_peer(PEER + 1)
    assert not my_files() and owner.used == 0 and owner.lent == 0
    assert bytes(target) == b"keep"
    user.close()
