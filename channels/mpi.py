"""The MPI transport: a :class:`~twisternet.channel.Channel` over mpi4py non-blocking point-to-point calls.

Wire protocol. All traffic lives on a private ``Dup`` of the user's communicator (``MPI.COMM_WORLD`` by
default), so it never collides with the program's own MPI messages. Four fixed tags:

* ``TAG_DATA``: one MPI message per channel message, starting with a 16-byte header
  ``(kind, flags, page, edge, size)``. An *eager* message (payload <= ``buffer_size``) carries its payload
  right after the header and lands in one of the receive buffers (``buffer_size`` + header bytes)
  pre-posted per peer. A *rendezvous* message (larger) carries only the header plus the lengths of
  its segments (and the first segment itself when that is at most 4 KiB and others follow: the
  codec's head before a large array, which would otherwise cost an MPI message of its own each way);
  the rest of the payload follows on ``TAG_BULK``. ``BYE`` headers say a rank leaves cleanly.
* ``TAG_BULK``: rendezvous payloads, sent zero-copy from the caller's buffers: each part of the
  message is its own contiguous ``Isend`` (parts over 1 GiB are cut; runs of parts under 64 KiB are
  joined into one copy), and the receiver posts, when it reads the header, one ``Irecv`` per segment
  into consecutive slices of one buffer of the announced size, placed so that the largest segment
  has the same offset within a page as the sender's copy (``page`` in the header): the single-copy
  path (``process_vm_readv``) copies page by page, and mismatched offsets split every page in two,
  which cost 5-10% of the bandwidth of 16 MB messages here. Contiguous sends matter: MPICH moves
  them with one copy, while a non-contiguous (``hindexed``) datatype is pipelined through small
  chunks that only advance while both sides poll. (The ``hindexed`` send is kept as a fallback when a
  message has more segments than a header can announce, which only tiny ``buffer_size`` values cause.)
* ``TAG_PRE``: rendezvous payloads of one segment sent into a receive the receiver posted before
  their header arrived (see "pre-posted receives" at ``MPIChannel._pre_offer``): the copy starts as
  soon as the payload arrives instead of after the receiver has read the header, which is most of
  the per-message cost left for 1-16 MB messages over shared memory.
* ``TAG_CTRL``: batched credit returns (``(edge, bytes)`` pairs), abort notices
  (:meth:`MPIChannel.abort`), offers of pre-posted receives and the receiver's side of the
  shared-memory slot protocol (offers, grants, retirements), on small receives of their own so data
  never holds them up. Like data receives, they are handled in the order MPI matched them.

Shared-memory slots (ranks on one host, ``mpi_shared_memory``, on by default). Over MPI a large
message between two processes of one host is copied by the receiver, inside its progress call, while
the sender waits; the receiver's per-message work then sits between two copies. Instead, once a peer's
rendezvous payloads show up, the receiver creates landing slots in ``/dev/shm`` for that peer
(:mod:`channels.shm_slots`): the sender copies each large message into a granted slot itself and
sends a ``TAG_DATA`` header naming it (kind ``SLOT``), the receiver delivers a view of the slot and
grants it back when the message is released (or retires it, if a view outlives the release). A
message that no granted slot holds goes through MPI as above, so nothing waits for a slot for long.
Which ranks share a host comes from ``MPI_Comm_split_type``; a rank that cannot map the slot file
(another container, shared memory switched off) refuses it and gets no more offers.

Edges travel in the header, not in the tag: edge ids go up to 2**31 while MPI guarantees tags only up
to 32767 (MPICH grants 2**29 - 1). MPI's non-overtaking rule (same source, tag and communicator match
in posting order) keeps headers in order, and makes the n-th ``TAG_BULK`` message from a peer match the
n-th ``TAG_BULK`` receive we post, which we post in header order. Pre-posted receives complete in
posting order per peer as far as delivery is concerned (a later, smaller one can finish first, so
completions wait for their predecessors). A rendezvous payload may complete after a later eager
message on the same edge, so while one is outstanding, delivery on that (peer, edge) goes through a
queue: each (peer, edge) sees its messages in send order.

Receive buffers. Each peer gets ``buffer_count`` pre-posted eager receives, fewer when that would
exceed ``pool_buffers`` in total (at least one per peer; MPI buffers early messages beyond that).
Small eager messages (up to half a buffer) are copied out so their pool buffer is re-posted at
once; larger ones are delivered zero-copy and their pool slot gets a spare. Rendezvous payloads land
in uninitialised numpy memory. Released buffers (pool and rendezvous) are recycled only when nothing
but the channel refers to them any more (checked with ``sys.getrefcount``), because the consumer may
keep zero-copy views (decoded arrays) alive after ``release``. Recycling matters: touching fresh
pages costs a page fault each, which dominates the transfer time of large messages. All ranks must
use the same ``buffer_size`` and ``buffer_count`` (checked when the channel is built).

Flow control follows the interface docstring exactly: per (peer, edge) the sender may have
``buffer_size * buffer_count`` bytes (and a sixteenth, :func:`twisternet.channel.fits_credit`) in
flight, a lone larger message may travel when nothing else is in flight, and the receiver returns the
bytes of a message when the core calls its ``release``. (An empty message is charged one byte, so a
flood of empty messages is flow-controlled too.) Returns are batched per peer: sent once one edge has
a quarter of its credit pending, when a poll finds nothing else to do, or after at most one
millisecond.

Threads. The channel asks for ``MPI_THREAD_MULTIPLE`` if it has to initialise MPI itself, and works with
``THREAD_SERIALIZED`` (the core calls it from one thread at a time). Under ``THREAD_FUNNELED`` or
``THREAD_SINGLE`` (:attr:`MPIChannel.requires_main_thread_progress`) it insists on manual progress from
the thread that initialised MPI. :meth:`MPIChannel.wakeup` and the ``release`` callables only touch
a deque and an Event, never MPI, so any thread may call them.

Sending. ``send`` hands a message to MPI at once unless the peer already has 32 sends in MPI; then
it waits in a per-peer FIFO (still counted by :meth:`MPIChannel.has_pending`) and is posted as earlier
ones complete. MPI completes queued small sends about one per progress call, so without that bound a
burst of thousands of sends makes every ``Testsome`` O(n). Eager payloads are copied into one wire
buffer (so ``on_sent`` is reported at the next progress call), and so are messages copied into a
shared-memory slot; rendezvous payloads are not copied and ``on_sent`` waits until MPI has finished
with every segment.

Waiting. MPI has no file descriptor to wait on, so :meth:`MPIChannel.progress` polls ``Testsome``:
back to back for 1 ms after the last activity; then, while sends or rendezvous payloads are moving
(MPI over shared memory advances them only while somebody polls), back to back with a
``sched_yield`` between polls for up to 50 ms; otherwise with sleeps of 50 us (idle < 10 ms), 0.5 ms
(idle < 1 s) and 2 ms beyond, on an Event that :meth:`MPIChannel.wakeup` sets. A sender filling one of
our shared-memory slots counts as a payload moving (its header may come any moment). An idle process
uses a few percent of a core.

Failure. The dup'ed communicator uses ``MPI.ERRORS_RETURN``; an MPI error on a request that involves a
peer is reported once as ``handler.on_peer_lost(peer, reason)`` and later sends to it raise
:class:`~twisternet.errors.PeerLostError`; an abort notice from a peer is reported the same way. What
MPICH (the ``mpich`` wheel, hydra launcher) does when a rank dies or calls ``MPI_Abort``: hydra kills
every other rank of the job and ``mpiexec`` exits non-zero (the abort's exit code, e.g. 3 for
``Abort(3)``, or a "BAD TERMINATION" report naming the rank and signal), within a second or so, so
nothing hangs; the survivors never see an MPI error. With ``mpiexec -disable-auto-cleanup`` the
survivors keep running but the ch4 device of this build does not report the dead rank (its
fault-tolerance mode, ``MPIR_CVAR_ENABLE_FT``, aborts in ``MPI_Init``), so sends to it simply never
complete; do not use that flag with this channel.

Liveness. A rank that is alive but stuck (SIGSTOPped, hung in a system call, its host swapping) is
no MPI error, so hydra never notices it. Like the TCP channel, every rank sends each live peer a
heartbeat (a ``TAG_CTRL`` message, at most one in MPI per peer) every ``heartbeat_interval`` seconds,
and reports a peer from which no receive of any kind completed for ``peer_timeout`` seconds lost
(``on_peer_lost``, so waiting operations raise PeerLostError naming it). Heartbeats stop once our
goodbye is out; peers that said goodbye are not checked.

Ending the job. With ``mpi_abort_on_error`` (on by default) the channel installs a ``sys.excepthook``
that prints the traceback and then calls ``MPI_Abort(COMM_WORLD, 1)``: an exception no handler caught
(e.g. that PeerLostError) ends every rank at once, the frozen one included, instead of leaving the
others waiting until their operation timeout and ``mpiexec`` waiting for a process that never exits.
A program that handles such a PeerLostError and exits normally is ended the same way at exit (a rank
lost by silence may be stopped, and would keep ``mpiexec`` waiting forever).
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from twisternet.channel import MAX_EDGE, Buffer, Channel, ChannelHandler, fits_credit
from twisternet.errors import ClosedError, ConfigError, PeerLostError, ProtocolError, TwisternetError
from twisternet.launch_env import mpi_launch_info, under_mpi_launcher  # re-exported: read in one place

from . import shm_slots

if TYPE_CHECKING:  # pragma: no cover - typing only; importing mpi4py initialises MPI
    from mpi4py import MPI as _MPIModule

    from twisternet.config import Config

__all__ = [
    "MPIChannel",
    "create_channel",
    "under_mpi_launcher",
    "mpi_launch_info",
    "TAG_DATA",
    "TAG_BULK",
    "TAG_CTRL",
]

log = logging.getLogger(__name__)

#: MPI tag of message headers, eager payloads and goodbyes.
TAG_DATA = 1
#: MPI tag of rendezvous payloads (the segments of messages larger than ``buffer_size``).
TAG_BULK = 2
#: MPI tag of batched credit returns and abort notices.
TAG_CTRL = 3
#: MPI tag of rendezvous payloads that go into the receiver's pre-posted payload receive.
TAG_PRE = 4

# Header of every TAG_DATA message: kind, flags (reserved, 0), page (rendezvous: where in a page the
# payload would start for its largest segment to sit where the sender's does; else 0), edge, size.
_HDR = struct.Struct("<BBHIQ")
_PAGE = 4096
# A rendezvous header continues with the number of segments and their lengths (u64 each).
_U32 = struct.Struct("<I")
_KIND_EAGER = 1
#: Rendezvous flag: the first segment (at most _INLINE_MAX bytes) travels in the header itself.
_FLAG_INLINE = 1
_INLINE_MAX = 4096
_KIND_RNDV = 2
_KIND_BYE = 3
#: Rendezvous flag: the payload's one segment goes to the receiver's next pre-posted receive (TAG_PRE).
_FLAG_PRE = 2
#: With _FLAG_PRE: no message; an empty TAG_PRE send used up a pre-posted receive too small for the
#: next payload (so the next, bigger one, can be used).
_FLAG_SKIP = 4
# Control message: kind, count. Credit: count entries (edge, bytes) follow. Abort: count bytes of reason.
_CTRL_HDR = struct.Struct("<BxxxI")
_CREDIT_ENTRY = struct.Struct("<IQ")
_KIND_CREDIT = 4
_KIND_ABORT = 5
#: Control message: the receiver's offer of pre-posted payload receives (see MPIChannel._pre_offer).
_KIND_OFFER = 6
_OFFER = struct.Struct("<QQ")
#: Data message: a payload the sender put into one of our shared-memory slots (channels.shm_slots).
#: The header continues with _SLOT_EXT (slot id, bytes of head) and the head itself.
_KIND_SLOT = 7
_SLOT_EXT = struct.Struct("<II")
#: Slot header flag: the payload is split (_SLOT_SPLIT after _SLOT_EXT: where); the sender copies the
#: part before that offset into the slot itself while the part after it comes on TAG_BULK, received
#: straight into the slot, so both processes copy at once; _KIND_SLOT_DONE says the sender's part is in.
_FLAG_SPLIT = 8
_SLOT_SPLIT = struct.Struct("<Q")
_KIND_SLOT_DONE = 12
#: Data message: the sender's answer about one of our slots (flags: _ANSWERS; edge field: slot id).
#: On the data tag, so it stays in order with the headers that fill the slot.
_KIND_SLOT_ANSWER = 8
_ANSWERS = {1: "ack", 2: "refuse", 3: "retired"}
_ANSWER_CODES = {v: k for k, v in _ANSWERS.items()}
#: Control messages about shared-memory slots: an offer (_SLOT_OFFER, then the file's path), grants
#: and retirements (count slot ids, u32 each).
_KIND_SLOT_OFFER = 9
_KIND_SLOT_GRANT = 10
_KIND_SLOT_RETIRE = 11
#: Control message: a heartbeat (no body). Every rank sends one to each live peer every
#: ``heartbeat_interval`` seconds; a peer heard from neither by data nor by heartbeat for
#: ``peer_timeout`` seconds is reported lost (the same keys and meaning as the TCP channel).
_KIND_HEARTBEAT = 13
_HEARTBEAT_MSG = _CTRL_HDR.pack(_KIND_HEARTBEAT, 0)
#: Most seconds between two liveness checks (the heartbeat interval, when shorter).
_LIVENESS_TICK = 0.5
_SLOT_OFFER = struct.Struct(f"<IQQ{shm_slots.NONCE}s")
_CTRL_BUF_SIZE = 4096
_SLOT_IDS_MAX = (_CTRL_BUF_SIZE - _CTRL_HDR.size) // 4
_CREDIT_MAX_ENTRIES = (_CTRL_BUF_SIZE - _CTRL_HDR.size) // _CREDIT_ENTRY.size
_CTRL_RECVS_PER_PEER = 2
#: Pending credit older than this (seconds) is returned even if the batch is small.
_CREDIT_MAX_DELAY = 1e-3
#: Sends per peer handed to MPI at once; later ones wait in the channel's queue for that peer.
_MAX_POSTED_SENDS = 32
#: Seconds of polling back to back after the last activity (a reply often follows quickly).
_SPIN = 1e-3
#: Seconds of polling back to back while sends or rendezvous payloads are outstanding, before the
#: usual backoff applies (a peer that does not receive must not make us burn a core).
_BUSY_SPIN = 0.05
#: Parts smaller than this are joined (copied) into one segment of a rendezvous message.
_COALESCE = 64 << 10
#: Most rendezvous buffers kept for reuse.
_BULK_CACHE_MAX = 8
#: Largest block of an hindexed datatype (keeps every block length a 32-bit int).
_MAX_BLOCK = 1 << 30
#: Most pre-posted skips a sender sends to reach a receive big enough for its payload.
_MAX_SKIPS = 2
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
#: Seconds a poll keeps testing for the header of a payload that arrived in a pre-posted receive.
_PRE_HEADER_WAIT = 5e-5

#: Channels not yet closed. Holding them keeps their posted receive buffers alive: a channel dropped
#: without close() must not let MPI write into freed memory. Torn down at interpreter exit.
_OPEN_CHANNELS: set["MPIChannel"] = set()
_ATEXIT_REGISTERED = False


def _close_leftover_channels() -> None:
    """atexit: tear down channels the program never closed, before mpi4py finalizes MPI."""
    for ch in list(_OPEN_CHANNELS):
        try:
            if ch._MPI.Is_finalized():
                _OPEN_CHANNELS.clear()
                return
            log.warning("rank %d: MPI channel was never closed; tearing it down at exit", ch.rank)
            ch._teardown()
        except Exception:  # noqa: BLE001 - exiting anyway; do not mask the program's own outcome
            log.exception("error tearing down an MPI channel at exit")
    _OPEN_CHANNELS.clear()


#: Ranks (of COMM_WORLD) this process lost by silence (heartbeat timeout), with the reason, while
#: ``mpi_abort_on_error`` was on. Such a rank may be alive but stopped: it never exits by itself, so
#: neither would ``mpiexec``; :func:`_abort_if_peers_froze` ends the job at exit instead.
_SILENT_LOST: dict[int, str] = {}


def _abort_if_peers_froze() -> None:
    """atexit: the program ends normally (or with SystemExit) after losing a silent peer: ``MPI_Abort``
    so that hydra kills the stopped rank and ``mpiexec`` ends, rather than waiting for it forever."""
    if not _SILENT_LOST:
        return
    from mpi4py import MPI
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    ranks = ", ".join(f"{r} ({why})" for r, why in sorted(_SILENT_LOST.items()))
    try:
        sys.stdout.flush()
        sys.stderr.write(f"twisternet: rank {MPI.COMM_WORLD.Get_rank()}: exiting after losing silent "
                         f"ranks {ranks}; ending the MPI job (MPI_Abort), or they would never exit\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - exiting anyway
        pass
    _unlink_mpich_segments()
    MPI.COMM_WORLD.Abort(1)


#: Buffers of sends still unfinished when a channel was torn down. MPI may read them until the
#: matching receive happens (if ever), so they are kept for the life of the process.
_ORPHANED_SENDS: list[Any] = []

# Environment variables set by MPI launchers (and not by a user's shell profile).
def _import_mpi() -> "_MPIModule":
    """Import mpi4py's MPI module, initialising MPI (asking for THREAD_MULTIPLE) if nobody has."""
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a declared extra
        raise ConfigError("channel", f"the MPI channel needs mpi4py (pip install 'twisternet[mpi]'): {e}") from e
    if MPI.Is_finalized():
        raise ClosedError("MPI has already been finalized in this process")
    if not MPI.Is_initialized():
        provided = MPI.Init_thread(MPI.THREAD_MULTIPLE)
        log.debug("initialised MPI ourselves; thread level %s", _level_name(MPI, provided))
        # mpi4py finalizes only what it initialised itself (rc.finalize defaults to rc.initialize),
        # so whoever initialises finalizes. Registered before the hook that closes leftover
        # channels, it runs after it (atexit is last-in first-out).
        import atexit

        def _finalize() -> None:
            if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.Is_thread_main():
                MPI.Finalize()
        atexit.register(_finalize)
    return MPI


_ABORT_HOOK_INSTALLED = False


def _unlink_mpich_segments() -> list[str]:
    """Unlink the MPICH shared-memory files (``/dev/shm/mpich_shm_*``) this process maps; returns them.

    MPICH removes them in ``MPI_Finalize``; a job that ends by ``MPI_Abort`` (every rank killed) leaves
    them in /dev/shm for good, a few MB per job. Unlinking is safe right before the abort: the other
    ranks of the host keep their mappings until hydra kills them, and nobody attaches any more."""
    removed = []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if "/dev/shm/mpich_shm_" in line}
    except (OSError, IndexError):
        return removed
    for path in sorted(paths):
        if path.endswith(" (deleted)"):
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def _install_abort_hook(MPI: Any) -> None:
    """Make an uncaught exception end the whole MPI job (``MPI_Abort``) once its traceback is printed.

    Without it the failed rank's interpreter exits (or hangs in ``MPI_Finalize``) while the others
    wait for it until their operation timeout, and ``mpiexec`` waits for all of them. With it, hydra
    kills every rank at once and ``mpiexec`` exits non-zero (1). Installed once per process."""
    global _ABORT_HOOK_INSTALLED
    if _ABORT_HOOK_INSTALLED:
        return
    _ABORT_HOOK_INSTALLED = True
    previous = sys.excepthook

    def abort_on_uncaught(exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            previous(exc_type, exc, tb)
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
            if MPI.Is_initialized() and not MPI.Is_finalized():
                try:
                    rank = MPI.COMM_WORLD.Get_rank()
                    sys.stderr.write(f"twisternet: rank {rank}: uncaught {exc_type.__name__}; "
                                     "ending the MPI job (MPI_Abort)\n")
                    sys.stderr.flush()
                except Exception:  # noqa: BLE001
                    pass
                _unlink_mpich_segments()
                MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_on_uncaught


def _level_name(MPI: Any, level: int) -> str:
    names = {MPI.THREAD_SINGLE: "THREAD_SINGLE", MPI.THREAD_FUNNELED: "THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "THREAD_SERIALIZED", MPI.THREAD_MULTIPLE: "THREAD_MULTIPLE"}
    return names.get(level, str(level))


def _byte_view(part: Buffer) -> memoryview:
    """A flat unsigned-byte view of one message part (raises TypeError for non-contiguous memory)."""
    mv = part if isinstance(part, memoryview) else memoryview(part)
    if mv.format != "B" or mv.ndim != 1:
        try:
            mv = mv.cast("B")
        except TypeError:
            raise TypeError(f"message parts must be C-contiguous buffers; got {type(part).__name__} "
                            f"with shape {mv.shape} and strides {mv.strides}") from None
    return mv


def _encode_credit(items: Sequence[tuple[int, int]]) -> list[bytes]:
    """Credit-return messages carrying ``(edge, bytes)`` pairs, as many as the control buffers need."""
    out = []
    for start in range(0, len(items), _CREDIT_MAX_ENTRIES):
        chunk = items[start:start + _CREDIT_MAX_ENTRIES]
        out.append(b"".join([_CTRL_HDR.pack(_KIND_CREDIT, len(chunk)),
                             *(_CREDIT_ENTRY.pack(edge, nbytes) for edge, nbytes in chunk)]))
    return out


def _encode_abort(reason: str) -> bytes:
    """An abort notice carrying (a prefix of) ``reason`` that fits one control buffer."""
    text = reason.encode("utf-8", "replace")[:_CTRL_BUF_SIZE - _CTRL_HDR.size]
    text = text.decode("utf-8", "ignore").encode("utf-8")  # do not cut a character in half
    return _CTRL_HDR.pack(_KIND_ABORT, len(text)) + text


def _encode_offer(first: int, cap: int) -> bytes:
    """An offer of pre-posted receives: those numbered ``first`` on hold ``cap`` bytes or more."""
    return _CTRL_HDR.pack(_KIND_OFFER, 0) + _OFFER.pack(first, cap)


def _encode_slot_offer(offer: shm_slots.Offer) -> bytes:
    """An offer of one shared-memory slot (see channels.shm_slots)."""
    path = offer.path.encode()
    if _CTRL_HDR.size + _SLOT_OFFER.size + len(path) > _CTRL_BUF_SIZE:
        raise ValueError(f"slot path too long: {offer.path!r}")
    return (_CTRL_HDR.pack(_KIND_SLOT_OFFER, len(path))
            + _SLOT_OFFER.pack(offer.slot, offer.cap, offer.size, offer.nonce) + path)


def _encode_slot_ids(kind: int, ids: Sequence[int]) -> list[bytes]:
    """Grants or retirements (``kind``) of the slots ``ids``, as many messages as control buffers need."""
    return [_CTRL_HDR.pack(kind, len(chunk)) + struct.pack(f"<{len(chunk)}I", *chunk)
            for chunk in (ids[i:i + _SLOT_IDS_MAX] for i in range(0, len(ids), _SLOT_IDS_MAX))]


def _encode_slot_answer(slot: int, answer: str) -> bytes:
    """The sender's answer ("ack", "refuse", "retired") about the receiver's slot ``slot``."""
    return _HDR.pack(_KIND_SLOT_ANSWER, _ANSWER_CODES[answer], 0, slot, 0)


def _decode_ctrl(buf: Buffer) -> tuple[int, Any]:
    """Parse a control message: ``(_KIND_CREDIT, [(edge, bytes), ...])``, ``(_KIND_ABORT, reason)``,
    ``(_KIND_OFFER, (first, cap))``, ``(_KIND_SLOT_OFFER, Offer)`` or ``(_KIND_SLOT_GRANT or
    _KIND_SLOT_RETIRE, [slot ids])``."""
    mv = memoryview(buf)
    if mv.nbytes < _CTRL_HDR.size:
        raise ProtocolError(f"control message of {mv.nbytes} bytes is shorter than its header")
    kind, n = _CTRL_HDR.unpack_from(mv, 0)
    if kind == _KIND_SLOT_OFFER:
        end = _CTRL_HDR.size + _SLOT_OFFER.size + n
        if end > mv.nbytes:
            raise ProtocolError("truncated slot offer")
        slot, cap, size, nonce = _SLOT_OFFER.unpack_from(mv, _CTRL_HDR.size)
        try:
            path = bytes(mv[_CTRL_HDR.size + _SLOT_OFFER.size:end]).decode()
        except UnicodeDecodeError:
            raise ProtocolError("slot offer with a path that is not UTF-8") from None
        return kind, shm_slots.Offer(slot, cap, size, nonce, path)
    if kind in (_KIND_SLOT_GRANT, _KIND_SLOT_RETIRE):
        if n > _SLOT_IDS_MAX or _CTRL_HDR.size + 4 * n > mv.nbytes:
            raise ProtocolError(f"malformed slot message ({n} ids)")
        return kind, list(struct.unpack_from(f"<{n}I", mv, _CTRL_HDR.size))
    if kind == _KIND_ABORT:
        if _CTRL_HDR.size + n > mv.nbytes:
            raise ProtocolError("abort notice longer than its message")
        return kind, bytes(mv[_CTRL_HDR.size:_CTRL_HDR.size + n]).decode("utf-8", "replace")
    if kind == _KIND_HEARTBEAT:
        return kind, ()
    if kind == _KIND_OFFER:
        if _CTRL_HDR.size + _OFFER.size > mv.nbytes:
            raise ProtocolError("truncated pre-post offer")
        return kind, _OFFER.unpack_from(mv, _CTRL_HDR.size)
    if kind != _KIND_CREDIT or n > _CREDIT_MAX_ENTRIES or _CTRL_HDR.size + n * _CREDIT_ENTRY.size > mv.nbytes:
        raise ProtocolError(f"malformed control message (kind {kind}, {n} entries)")
    return kind, [_CREDIT_ENTRY.unpack_from(mv, _CTRL_HDR.size + i * _CREDIT_ENTRY.size) for i in range(n)]


def _segments(views: list[memoryview]) -> list[Buffer]:
    """The contiguous MPI messages that carry a rendezvous payload, in order: each large part as is
    (cut at 1 GiB), runs of small parts joined into one copy. Contiguous sends let MPI use its
    single-copy path; non-contiguous datatypes are pipelined through small chunks instead."""
    out: list[Buffer] = []
    run: list[memoryview] = []
    for v in views:
        n = v.nbytes
        if n == 0:
            continue
        if n < _COALESCE:
            run.append(v)
            continue
        if run:
            out.append(b"".join(run) if len(run) > 1 else run[0])
            run = []
        for off in range(0, n, _MAX_BLOCK):
            out.append(v[off:off + _MAX_BLOCK] if n > _MAX_BLOCK else v)
    if run:
        out.append(b"".join(run) if len(run) > 1 else run[0])
    return out


def _rndv_header(edge: int, size: int, lengths: Sequence[int], page: int = 0, inline: Buffer = b"",
                 flags: int = 0) -> bytes:
    """Header announcing a rendezvous message of ``size`` bytes that follows as ``lengths`` segments;
    ``page``: the receiver's preferred offset of the payload within a page (0 to 4095); ``inline``:
    the first segment's bytes, carried by the header itself (then only the others follow)."""
    return b"".join((_HDR.pack(_KIND_RNDV, flags | (_FLAG_INLINE if inline else 0), page, edge, size),
                     _U32.pack(len(lengths)), struct.pack(f"<{len(lengths)}Q", *lengths), inline))


def _rndv_inline(buf: Buffer, lengths: Sequence[int], peer: int) -> int:
    """Where in a rendezvous header (flagged _FLAG_INLINE) its inline first segment starts, checked:
    others must follow it, and it must be small and inside the header."""
    start = _HDR.size + _U32.size + 8 * len(lengths)
    if len(lengths) < 2 or lengths[0] > _INLINE_MAX or start + lengths[0] > memoryview(buf).nbytes:
        raise ProtocolError(f"rendezvous header from rank {peer} with a bad inline segment")
    return start


def _pre_cap(n: int) -> int:
    """Capacity of the pre-posted receives offered for payloads of ``n`` bytes: at most 1/8 more,
    in steps of at least 64 KiB (0 for 0)."""
    grain = 1 << max(16, n.bit_length() - 4)
    return -(-n // grain) * grain


def _slot_parts(segments: list[Buffer], pool_buf_size: int) -> tuple[Buffer, list[Buffer], int]:
    """``(head, body, bytes of body)`` of a message going into a shared-memory slot: a small first
    segment (the codec's head) travels in the header, so the payload after it lands page-aligned."""
    if len(segments) > 1:
        n = memoryview(segments[0]).nbytes
        if n <= _INLINE_MAX and _HDR.size + _SLOT_EXT.size + n <= pool_buf_size:
            return segments[0], segments[1:], sum(memoryview(s).nbytes for s in segments[1:])
    return b"", segments, sum(memoryview(s).nbytes for s in segments)


#: _slot_pick's answer "wait for a slot to come back".
_WAIT = object()


def _rndv_lengths(buf: Buffer, size: int) -> tuple[int, ...]:
    """The segment lengths announced by a rendezvous header (validated against ``size``)."""
    mv = memoryview(buf)
    (n,) = _U32.unpack_from(mv, _HDR.size)
    start = _HDR.size + _U32.size
    if n == 0 or start + 8 * n > mv.nbytes:
        raise ProtocolError(f"rendezvous header announces {n} segments")
    lengths = struct.unpack_from(f"<{n}Q", mv, start)
    if sum(lengths) != size or not all(lengths):
        raise ProtocolError(f"rendezvous segments {lengths[:8]}... do not add up to {size} bytes")
    return lengths


# --- bookkeeping objects (one per outstanding MPI request) ------------------------------------------

class _DataRecv:
    """A pre-posted TAG_DATA receive into a pool buffer; completes strictly in posting order per peer."""
    __slots__ = ("peer", "buf", "done")

    def __init__(self, peer: int, buf: bytearray) -> None:
        self.peer = peer
        self.buf = buf
        self.done = False


class _CtrlRecv:
    """A pre-posted TAG_CTRL receive; like data receives, handled strictly in posting order per peer
    (MPI matches a peer's messages to them in that order; Testsome reports them by request slot)."""
    __slots__ = ("peer", "buf", "done")

    def __init__(self, peer: int, buf: bytearray) -> None:
        self.peer = peer
        self.buf = buf
        self.done = False


class _Incoming:
    """A rendezvous message whose payload is arriving; ``ready`` once it may be delivered."""
    __slots__ = ("peer", "edge", "data", "release", "ready", "left")

    def __init__(self, peer: int, edge: int, data: Any, release: "_Release", ready: bool, left: int = 0) -> None:
        self.peer = peer
        self.edge = edge
        self.data = data
        self.release = release
        self.ready = ready
        self.left = left  # segments still arriving


class _SendGroup:
    """The segments of one rendezvous send: ``on_sent(token)`` once all of them completed."""
    __slots__ = ("token", "left")

    def __init__(self, token: object, left: int) -> None:
        self.token = token
        self.left = left


class _BulkRecv:
    __slots__ = ("peer", "incoming")

    def __init__(self, peer: int, incoming: _Incoming) -> None:
        self.peer = peer
        self.incoming = incoming


class _PreRecv:
    """A payload receive posted before its header arrived (see MPIChannel._pre_offer): ``cap`` bytes
    at ``store[start:]``, with room before ``start`` for an inline first segment."""
    __slots__ = ("peer", "store", "start", "cap", "done", "incoming", "skip")

    def __init__(self, peer: int, store: Any, start: int, cap: int) -> None:
        self.peer = peer
        self.store = store
        self.start = start
        self.cap = cap
        self.done = False
        self.incoming: _Incoming | None = None  # set by the header that claims it
        self.skip = False                       # used up by a skip, or cancelled: only recycle it


class _Send:
    """An outstanding Isend: keeps the sent buffers (and datatype) alive until MPI is done with them."""
    __slots__ = ("peer", "keep", "datatype", "token", "bulk")

    def __init__(self, peer: int, keep: Any, datatype: Any = None, token: object = None,
                 bulk: bool = False) -> None:
        self.peer = peer
        self.keep = keep
        self.datatype = datatype
        self.token = token
        self.bulk = bulk


class _Heartbeat(_Send):
    """A heartbeat in MPI: at most one per peer at a time (a frozen peer must not collect them)."""

    __slots__ = ()


class _Release:
    """The ``release`` callable handed out with a message: returns its credit (and buffer) once.

    ``buf`` is the receive buffer the message was delivered in when the channel may recycle it: a
    pool buffer (``pool``) or a rendezvous buffer; ``slot``: the shared-memory slot it was delivered in."""
    __slots__ = ("channel", "peer", "edge", "cost", "buf", "pool", "slot", "done")

    def __init__(self, channel: "MPIChannel", peer: int, edge: int, cost: int, buf: Any, pool: bool,
                 slot: shm_slots.OwnedSlot | None = None) -> None:
        self.channel = channel
        self.peer = peer
        self.edge = edge
        self.cost = cost
        self.buf = buf
        self.pool = pool
        self.slot = slot
        self.done = False

    def __call__(self) -> None:
        if self.done:
            raise TwisternetError(f"message from rank {self.peer} on edge {self.edge} was released twice")
        self.done = True
        ch = self.channel
        ch._released.append(self)
        ch._wake.set()


class MPIChannel(Channel):
    """Channel over mpi4py ``Isend``/``Irecv`` with pre-posted receives, rendezvous for large messages
    and per (peer, edge) byte credits. Build it with :func:`create_channel`."""

    name = "mpi"

    def __init__(self, config: "Config", comm: Any, MPI: Any) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size(), config)
        self._MPI = MPI
        #: Thread level MPI granted (an ``MPI.THREAD_*`` constant).
        self.thread_level: int = MPI.Query_thread()
        #: True when MPI gave less than THREAD_SERIALIZED: every call must come from the thread that
        #: initialised MPI, which means manual progress from that thread.
        self.requires_main_thread_progress: bool = self.thread_level < MPI.THREAD_SERIALIZED
        self._comm = comm.Dup()
        self._comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._comm.Set_name(f"twisternet-mpi<{comm.Get_name()}>")
        # Receive buffers and credits are sized from the config on both ends: all ranks must agree.
        mine = (config.buffer_size, config.buffer_count)
        every = self._comm.allgather(mine)
        if any(v != mine for v in every):
            self._comm.Free()
            raise ConfigError("buffer_size", "every rank must use the same buffer_size and buffer_count; "
                              f"(buffer_size, buffer_count) by rank: {every}")

        self._eager_limit = config.buffer_size
        self._pool_buf_size = config.buffer_size + _HDR.size
        # Eager messages at most this big are copied out of the pool buffer (which is reposted at once);
        # bigger ones are handed out zero-copy and the pool slot gets a spare buffer. Either way a
        # held buffer carries at least half its size in credit, so memory stays within 2x the credit.
        self._copy_limit = config.buffer_size // 2
        # Segments a rendezvous header can announce in one pool buffer.
        self._max_segments = (self._pool_buf_size - _HDR.size - _U32.size) // 8
        self._credit = config.buffer_size * config.buffer_count
        self._credit_batch = max(1, self._credit // 4)
        npeers = max(1, self.world - 1)
        self._recvs_per_peer = max(1, min(config.buffer_count, config.pool_buffers // npeers))
        self._spare_cap = config.pool_buffers
        # Recycled rendezvous buffers: fresh memory costs a page fault per page on first touch,
        # which halves large-message bandwidth, so released (and unreferenced) ones are kept.
        self._bulk_cache: list[Any] = []
        self._bulk_cache_bytes = 0
        # Bounded like the TCP channel's idle receive buffers: at least one buffer of the largest
        # message a program exchanges (up to twice memory_limit) is kept, so a stream of 256 MB messages
        # does not pay 65536 page faults per message.
        self._bulk_cache_cap = max(4 * self._credit, 2 * config.memory_limit)

        self._handler: ChannelHandler | None = None
        self._started = False
        self._closed = False
        self._owner_thread: int | None = None
        self._in_poll = False

        # Request slots: Testsome runs over ``_reqs``; ``_ops[i]`` says what slot i is for.
        self._reqs: list[Any] = []
        self._ops: list[Any] = []
        self._free_slots: list[int] = []
        self._statuses: list[Any] = []  # filled by Testsome; read only when it reports an error
        self._active = 0

        # Receive side.
        self._data_recvs: list[deque[_DataRecv]] = [deque() for _ in range(self.world)]
        self._ctrl_recvs: list[deque[_CtrlRecv]] = [deque() for _ in range(self.world)]
        self._order: dict[tuple[int, int], deque[_Incoming]] = {}
        self._spares: list[bytearray] = []
        self._bulk_pending = [0] * self.world
        # Rendezvous payloads moving (either direction): MPI needs frequent polls to pipeline them.
        self._bulk_active = 0
        self._released: deque[_Release] = deque()
        self._credit_out: dict[int, dict[int, int]] = {}
        self._credit_since: dict[int, float] = {}
        # Pre-posted payload receives (see _pre_offer): capacity offered per peer (0: none), receives
        # posted so far, the posted ones no header has claimed yet, where in a page the peer's payloads
        # start, and the total capacity offered (bounded by memory_limit).
        self._pre_cap = [0] * self.world
        self._pre_posted = [0] * self.world
        self._pre_q: list[deque[_PreRecv]] = [deque() for _ in range(self.world)]
        self._pre_page = [0] * self.world
        self._pre_total = 0
        self._pre_early = 0     # payloads received whose header has not been read yet
        self._pre_budget = config.memory_limit

        # Send side.
        self._inflight: dict[tuple[int, int], int] = {}
        self._blocked: set[tuple[int, int]] = set()
        self._pending_sends = [0] * self.world
        self._pending_total = 0  # over peers not lost (sends to a lost peer may never complete)
        self._posted_sends = [0] * self.world
        self._sendq: list[deque[tuple[Any, int, _Send]]] = [deque() for _ in range(self.world)]
        # Offers of pre-posted receives from each peer: (first receive number, capacity), and how
        # many of that peer's pre-posted receives we have used.
        self._pre_offers: list[deque[tuple[int, int]]] = [deque() for _ in range(self.world)]
        self._pre_used = [0] * self.world
        self._pre_page_sent = [-1] * self.world  # where in a page our last payload to each peer sat

        # Shared-memory landing slots (channels.shm_slots) between ranks on one host: ours, which peers
        # fill (_slots_in), and the peers' we fill (_slots_out).
        shared = bool(config.mpi_shared_memory) and shm_slots.supported()
        on_host = self._node_peers()   # collective: every rank calls it, whatever its own config says
        self._slot_peers = on_host if shared else set()
        if self._slot_peers:
            shm_slots.sweep_stale()
        self._slots_in = shm_slots.SlotOwner(budget=config.memory_limit, max_cap=config.memory_limit // 2)
        self._slots_out = shm_slots.SlotUser(enabled=shared)
        self._slot_slow = [False] * self.world   # a wait for a grant from that peer timed out
        self._slot_prefer = [True] * self.world  # wait for the slot of our previous message to that peer
        self._slot_probes = [0] * self.world     # sends since preferring it stopped paying off
        self._slot_want_last = [False] * self.world  # the deferred messages wait for that slot
        self._slot_wait_until = [0.0] * self.world   # messages for that peer wait for a slot till then
        # The large message waiting for a slot to come back, per peer (at most one: a second one sends
        # both through MPI, see _slot_send); smaller messages on its edge are refused meanwhile, and
        # the peers for which one was get on_credit once it has left (_slot_blocked).
        self._slot_deferred: dict[int, tuple[int, list[memoryview], list[Buffer], int, object]] = {}
        self._slot_blocked: set[int] = set()
        self._split_in: dict[tuple[int, int], _Incoming] = {}   # (peer, slot): split message being copied in

        # Liveness (as the TCP channel): when each peer was last heard from (any completed receive),
        # when we last sent it a heartbeat, and whether that heartbeat is still in MPI.
        self._peer_timeout = config.peer_timeout
        self._hb_interval = config.heartbeat_interval
        self._heard = [0.0] * self.world
        self._beat_sent = [0.0] * self.world
        self._beat_busy = [False] * self.world
        self._next_liveness = float("inf")

        # Peer state.
        self._bye_from: set[int] = set()
        self._bye_sent = False
        self._lost: dict[int, str] = {}

        # Handler callbacks waiting to run (so an exception in one never corrupts channel state).
        self._events: deque[tuple[Callable[..., None], tuple[Any, ...]]] = deque()

        self._wake = threading.Event()
        self._last_activity = time.monotonic()
        _OPEN_CHANNELS.add(self)
        #: Counters for tests and benchmarks.
        self.stats: dict[str, int] = {"msgs_sent": 0, "bytes_sent": 0, "msgs_received": 0,
                                      "bytes_received": 0, "eager_sent": 0, "rendezvous_sent": 0,
                                      "credit_msgs_sent": 0, "send_refused": 0,
                                      "rndv_buffers_reused": 0, "noncontiguous_sent": 0,
                                      "pre_sent": 0, "pre_skips": 0, "pre_received": 0,
                                      "slot_sent": 0, "slot_received": 0, "slot_offers": 0,
                                      "slots_retired": 0, "slot_waits": 0, "slot_wait_timeouts": 0,
                                      "slot_deferred": 0, "slot_refused": 0, "slot_split": 0}

    def _node_peers(self) -> set[int]:
        """The other ranks of the communicator on this host (collective: ``MPI_Comm_split_type``)."""
        MPI = self._MPI
        try:
            node = self._comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        except MPI.Exception as e:
            log.debug("rank %d: cannot tell which ranks share this host: %s", self.rank, e)
            return set()
        mine = node.Get_group()
        world = self._comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(mine, list(range(node.Get_size())), world)
        finally:
            mine.Free()
            world.Free()
            node.Free()
        return {r for r in ranks if r not in (self.rank, MPI.UNDEFINED)}

    # --- public API -----------------------------------------------------------------------------

    @property
    def comm(self) -> Any:
        """The channel's private communicator (a dup of the one it was built on)."""
        return self._comm

    def start(self, handler: ChannelHandler) -> None:
        """Check the thread level, pre-post the receives for every peer and begin delivering."""
        if self._started:
            raise TwisternetError("MPIChannel.start called twice")
        if self._closed:
            raise ClosedError("MPI channel is closed")
        MPI = self._MPI
        if self.requires_main_thread_progress:
            level = _level_name(MPI, self.thread_level)
            if self.config.progress != "manual" or not MPI.Is_thread_main():
                raise ConfigError(
                    "progress",
                    f"MPI provides only {level}, so the channel may only be driven from the thread that "
                    "initialised MPI: use progress='manual' and call progress from that thread (or "
                    "initialise MPI with THREAD_SERIALIZED or THREAD_MULTIPLE)")
            self._owner_thread = threading.get_ident()
        self._handler = handler
        for peer in range(self.world):
            if peer == self.rank:
                continue
            for _ in range(self._recvs_per_peer):
                self._post_data_recv(peer, bytearray(self._pool_buf_size))
            for _ in range(_CTRL_RECVS_PER_PEER):
                self._post_ctrl_recv(peer, bytearray(_CTRL_BUF_SIZE))
        now = time.monotonic()
        self._heard = [now] * self.world
        self._beat_sent = [now] * self.world
        self._next_liveness = now + min(self._hb_interval, _LIVENESS_TICK)
        self._started = True
        log.debug("MPI channel rank %d/%d started (thread level %s, %d eager receives per peer)",
                  self.rank, self.world, _level_name(MPI, self.thread_level), self._recvs_per_peer)

    def send(self, peer: int, edge: int, parts: Sequence[Buffer], token: object = None) -> bool:
        """Post one message for ``peer`` on ``edge``; False (nothing queued) when it lacks credit."""
        self._check_usable()
        if not isinstance(peer, int) or not 0 <= peer < self.world or peer == self.rank:
            raise ValueError(f"peer must be a rank in [0, {self.world}) other than {self.rank}, got {peer!r}")
        if not isinstance(edge, int) or not 0 <= edge < MAX_EDGE:
            raise ValueError(f"edge must be an int in [0, 2**31), got {edge!r}")
        if peer in self._lost:
            raise PeerLostError(peer, self._lost[peer])
        if peer in self._bye_from:
            raise ClosedError(f"rank {peer} has closed its channel; it accepts no more messages")
        if self._bye_sent:
            raise ClosedError("MPI channel is closing")
        views = [_byte_view(p) for p in parts]
        size = sum(v.nbytes for v in views)
        cost = size or 1
        key = (peer, edge)
        held = self._slot_deferred.get(peer)
        if held is not None and held[0] == edge and size <= self._eager_limit:
            # a large message on this edge waits for a slot: this one may not overtake it
            self._slot_blocked.add(peer)
            self.stats["send_refused"] += 1
            self.stats["slot_refused"] += 1
            return False
        inflight = self._inflight.get(key, 0)
        if not fits_credit(inflight, cost, self._credit):
            self._blocked.add(key)
            self.stats["send_refused"] += 1
            return False
        MPI = self._MPI
        try:
            if size <= self._eager_limit:
                wire = b"".join((_HDR.pack(_KIND_EAGER, 0, 0, edge, size), *views))
                self._submit(wire, TAG_DATA, _Send(peer, wire))
                if token is not None:  # the parts were copied: reusable now (reported by progress)
                    self._events.append((self._handler.on_sent, (token,)))  # type: ignore[union-attr]
                self.stats["eager_sent"] += 1
            else:
                segments = _segments(views)
                if not (peer in self._slot_peers and self._slot_send(peer, edge, views, segments, size, token)):
                    self._send_rendezvous(peer, edge, views, segments, size, token)
        except MPI.Exception as e:
            self._lose(peer, f"MPI error sending to it: {e.Get_error_string()}")
            raise PeerLostError(peer, self._lost[peer]) from e
        # (read again: a slot send may have polled and taken credit returns in meanwhile)
        self._inflight[key] = self._inflight.get(key, 0) + cost
        self.stats["msgs_sent"] += 1
        self.stats["bytes_sent"] += size
        return True

    def _send_rendezvous(self, peer: int, edge: int, views: list[memoryview], segments: list[Buffer],
                         size: int, token: object) -> None:
        """Send a message larger than a buffer: its header, then its ``segments`` zero-copy on TAG_BULK
        (or into the peer's pre-posted receive on TAG_PRE); ``on_sent`` once MPI is done with them."""
        MPI = self._MPI
        dtype = None
        if len(segments) > self._max_segments:
            # Too many to announce: one non-contiguous send (zero-copy, but MPI pipelines
            # it through small chunks, so it is slower than contiguous segments).
            dtype = self._gather_type([v for v in views if v.nbytes])
            segments = [dtype]
            lengths = [size]
            self.stats["noncontiguous_sent"] += 1
        else:
            lengths = [memoryview(seg).nbytes for seg in segments]
        page = 0
        if dtype is None:
            big = max(range(len(lengths)), key=lengths.__getitem__)
            page = (MPI.Get_address(segments[big]) - sum(lengths[:big])) % _PAGE
        inline: Buffer = b""
        if (dtype is None and len(segments) > 1 and lengths[0] <= _INLINE_MAX
                and _HDR.size + _U32.size + 8 * len(lengths) + lengths[0] <= self._pool_buf_size):
            # A small first segment (typically the codec's head before a large array) rides in
            # the header: one MPI message less each way per message.
            inline = segments[0]
            segments = segments[1:]
        group = _SendGroup(token, len(segments))
        pre = False
        if dtype is None and len(segments) == 1:
            # The peer places its pre-posted receive like our previous payload within a page;
            # a payload placed otherwise goes the usual way (placed by its header) instead.
            bpage = (page + (lengths[0] if inline else 0)) % _PAGE
            pre = (bpage == self._pre_page_sent[peer] and bool(self._pre_offers[peer])
                   and self._pre_fits(peer, lengths[-1]))
            self._pre_page_sent[peer] = bpage
        if pre:
            # The payload first: it can land in the receive the peer posted for it before
            # the peer has even read the header.
            seg = segments[0]
            self._submit([seg, MPI.BYTE], TAG_PRE, _Send(peer, seg, None, group, True))
            hdr = _rndv_header(edge, size, lengths, page, inline, _FLAG_PRE)
            self._submit(hdr, TAG_DATA, _Send(peer, hdr))
            self._pre_used[peer] += 1
            self.stats["pre_sent"] += 1
            segments = []
        else:
            hdr = _rndv_header(edge, size, lengths, page, inline)
            self._submit(hdr, TAG_DATA, _Send(peer, hdr))
        if dtype is not None:
            self._submit([MPI.BOTTOM, 1, dtype], TAG_BULK, _Send(peer, views, dtype, group, True))
        else:
            for seg in segments:
                self._submit([seg, MPI.BYTE], TAG_BULK, _Send(peer, seg, None, group, True))
        self.stats["rendezvous_sent"] += 1

    def progress(self, timeout: float = 0.0) -> bool:
        """Complete requests, deliver messages, return credit; wait up to ``timeout`` s for work."""
        self._check_usable()
        did = self._poll()
        if did or timeout <= 0:
            return did
        deadline = time.monotonic() + timeout
        wake = self._wake
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                return False
            idle = now - self._last_activity
            if idle < _SPIN or self._slot_deferred or (
                    (self._bulk_active or self._pending_total or self._slots_in.lent) and idle < _BUSY_SPIN):
                # Just after activity, or while sends / rendezvous payloads are moving (MPI over
                # shared memory, or a NIC without offload, advances them only while we poll): poll
                # back to back, giving the CPU away between polls once the first burst is over.
                if idle >= _SPIN:
                    os.sched_yield()
                if wake.is_set():
                    wake.clear()
                    return self._poll()
                if self._poll():
                    return True
                continue
            delay = self._backoff(idle)
            if self._credit_since:
                delay = min(delay, _CREDIT_MAX_DELAY / 2)
            if wake.wait(min(delay, remaining)):
                wake.clear()
                return self._poll()
            if self._poll():
                return True

    def flush_released(self) -> None:
        """Return what the handlers just released (slots are granted back at once: their sender may
        be waiting for one); credit joins the usual batches."""
        if self._released and not self._in_poll and self._started and not self._closed:
            self._check_thread()
            self._drain_released()

    def wakeup(self) -> None:
        """Cut a waiting :meth:`progress` short. Thread-safe; never calls MPI."""
        self._wake.set()

    def has_pending(self, peer: int | None = None) -> bool:
        """Whether sends to ``peer`` (or to anyone) have not completed yet; sends to a lost peer
        do not count (they may never complete)."""
        if peer is None:
            return self._pending_total > 0
        return self._pending_sends[peer] > 0 and peer not in self._lost

    def close(self, timeout: float) -> None:
        """Flush, say goodbye to every peer, wait (bounded) for theirs, then free all MPI resources."""
        if self._closed:
            return
        if not self._started:
            self._free_comm()
            self._closed = True
            _OPEN_CHANNELS.discard(self)
            return
        self._check_thread()
        deadline = time.monotonic() + max(0.0, timeout)
        try:
            # Every accepted message is posted or queued, in order, and MPI keeps a peer's TAG_DATA
            # messages in order, so the goodbye can go at once: the peer sees it after all our
            # headers. Then one phase waits for our sends to complete, for every peer's goodbye and
            # for the payloads those peers announced before it.
            for peer in list(self._slot_deferred):   # through MPI now: nothing may follow the goodbye
                self._slot_run_deferred(peer, give_up=True)
            self._bye_sent = True
            bye = _HDR.pack(_KIND_BYE, 0, 0, 0, 0)
            for peer in self._live_peers():
                try:
                    self._submit(bye, TAG_DATA, _Send(peer, bye))
                except self._MPI.Exception as e:
                    self._lose(peer, f"MPI error saying goodbye: {e.Get_error_string()}")
            while time.monotonic() < deadline and (self._waiting_for_peers() or self.has_pending()):
                self.progress(min(0.01, max(0.0, deadline - time.monotonic())))
            if self.has_pending():
                unfinished = [p for p in range(self.world) if self.has_pending(p)]
                log.warning("rank %d: closing with sends to ranks %s not completed after %gs",
                            self.rank, unfinished, timeout)
            missing = self._waiting_for_peers()
            if missing:
                log.warning("rank %d: no goodbye from ranks %s within %gs; closing anyway",
                            self.rank, missing, timeout)
            self._dispatch()
        finally:
            self._teardown()

    def abort(self, reason: str) -> None:
        """Leave at once without the goodbye: peers get an abort notice and report this rank lost."""
        if self._closed:
            return
        if not self._started:
            self._free_comm()
            self._closed = True
            _OPEN_CHANNELS.discard(self)
            return
        MPI = self._MPI
        msg = _encode_abort(reason)
        notices = []
        for peer in self._live_peers():
            if peer in self._bye_from:
                continue
            try:
                notices.append(self._comm.Isend(msg, peer, TAG_CTRL))
            except MPI.Exception:
                pass
        limit = time.monotonic() + 0.5
        try:
            while notices and not MPI.Request.Testall(notices) and time.monotonic() < limit:
                time.sleep(1e-4)
        except MPI.Exception:
            pass
        for req in notices:
            if req != MPI.REQUEST_NULL:
                _ORPHANED_SENDS.append(msg)  # MPI may still read it after Free
                try:
                    req.Free()
                except MPI.Exception:
                    pass
        log.warning("rank %d: channel aborted: %s", self.rank, reason)
        self._teardown()

    # --- sending helpers --------------------------------------------------------------------------

    def _gather_type(self, views: list[memoryview]) -> Any:
        """An hindexed byte datatype (relative to MPI.BOTTOM) that spans ``views`` in order."""
        MPI = self._MPI
        lengths: list[int] = []
        addrs: list[int] = []
        for v in views:
            base = MPI.Get_address(v)
            n = v.nbytes
            off = 0
            while off < n:
                step = min(_MAX_BLOCK, n - off)
                lengths.append(step)
                addrs.append(base + off)
                off += step
        return MPI.BYTE.Create_hindexed(lengths, addrs).Commit()

    def _pre_fits(self, peer: int, n: int) -> bool:
        """Whether a payload of ``n`` bytes can go into ``peer``'s next pre-posted receive. If that one
        is too small but a later offer is big enough and at most ``_MAX_SKIPS`` receives away, the
        smaller ones are used up first with empty sends (skips)."""
        offers = self._pre_offers[peer]
        used = self._pre_used[peer]
        while len(offers) > 1 and offers[1][0] <= used:
            offers.popleft()
        first, cap = offers[0]
        if first > used:
            return False
        if n <= cap:
            return True
        for first, cap in list(offers)[1:]:
            if cap >= n:
                if first - used > _MAX_SKIPS:
                    return False
                skip = _HDR.pack(_KIND_RNDV, _FLAG_PRE | _FLAG_SKIP, 0, 0, 0)
                for _ in range(first - used):
                    self._submit([b"", self._MPI.BYTE], TAG_PRE, _Send(peer, b""))
                    self._submit(skip, TAG_DATA, _Send(peer, skip))
                    self.stats["pre_skips"] += 1
                self._pre_used[peer] = first
                return True
        return False

    def _post(self, req: Any, op: Any) -> None:
        if self._free_slots:
            i = self._free_slots.pop()
            self._reqs[i] = req
            self._ops[i] = op
        else:
            self._reqs.append(req)
            self._ops.append(op)
        self._active += 1
        if type(op) is _BulkRecv:
            self._bulk_active += 1

    def _submit(self, spec: Any, tag: int, op: _Send, urgent: bool = False) -> None:
        """Isend ``spec`` to ``op.peer``, or queue it behind the peer's earlier sends when that peer
        already has ``_MAX_POSTED_SENDS`` in MPI (``urgent`` control messages skip the queue; they
        need no ordering). Bounding posted sends keeps ``Testsome`` arrays short: MPI completes
        queued small sends one per progress call, so thousands of posted ones cost O(n) per poll."""
        peer = op.peer
        self._pending_sends[peer] += 1
        if peer not in self._lost:
            self._pending_total += 1
        if op.bulk:
            self._bulk_active += 1
        q = self._sendq[peer]
        if not urgent and (q or self._posted_sends[peer] >= _MAX_POSTED_SENDS):
            q.append((spec, tag, op))
            return
        self._post(self._comm.Isend(spec, peer, tag), op)
        self._posted_sends[peer] += 1

    def _drain_sendq(self, peer: int) -> None:
        """Post queued sends to ``peer`` while it is below its limit of posted sends."""
        q = self._sendq[peer]
        while q and self._posted_sends[peer] < _MAX_POSTED_SENDS:
            spec, tag, op = q[0]
            try:
                req = self._comm.Isend(spec, peer, tag)
            except self._MPI.Exception as e:
                self._lose(peer, f"MPI error sending to it: {e.Get_error_string()}")
                return
            q.popleft()
            self._post(req, op)
            self._posted_sends[peer] += 1

    def _unaccount_send(self, op: _Send, posted: bool) -> None:
        peer = op.peer
        self._pending_sends[peer] -= 1
        if peer not in self._lost:
            self._pending_total -= 1
        if op.bulk:
            self._bulk_active -= 1
        if posted:
            self._posted_sends[peer] -= 1
        if op.datatype is not None:
            op.datatype.Free()

    def _post_data_recv(self, peer: int, buf: bytearray) -> None:
        op = _DataRecv(peer, buf)
        self._post(self._comm.Irecv(buf, peer, TAG_DATA), op)
        self._data_recvs[peer].append(op)

    def _post_ctrl_recv(self, peer: int, buf: bytearray) -> None:
        op = _CtrlRecv(peer, buf)
        self._post(self._comm.Irecv(buf, peer, TAG_CTRL), op)
        self._ctrl_recvs[peer].append(op)

    # --- the progress engine ------------------------------------------------------------------------

    @staticmethod
    def _backoff(idle: float) -> float:
        """Seconds to sleep between polls after ``idle`` seconds without work."""
        if idle < _SPIN:
            return 0.0
        if idle < 0.01:
            return 5e-5
        if idle < 1.0:
            return 5e-4
        return 2e-3

    def _poll(self) -> bool:
        """One pass: returned buffers and credit, request completions, credit flush, callbacks."""
        if self._in_poll:
            raise TwisternetError("MPIChannel.progress was called from inside a handler callback")
        self._check_thread()
        self._in_poll = True
        try:
            did = False
            if self._released:
                self._drain_released()
                did = True
            completed = False
            if self._active:
                completed = self._test_requests()
            if self._slot_deferred:         # messages waiting for a slot: wait no longer?
                now = time.monotonic()
                for peer in [p for p in self._slot_deferred if self._slot_wait_until[p] <= now]:
                    self._slot_run_deferred(peer)
            if completed or self._events:
                did = True
                self._dispatch()
                if self._released:  # consumers that release inside on_message: return it now
                    self._drain_released()
            if self._credit_out:
                self._flush_credit(quiet=not completed)
            now = time.monotonic()
            if now >= self._next_liveness:
                self._liveness(now)
                if self._events:
                    did = True
                    self._dispatch()
            if did:
                self._last_activity = time.monotonic()
            return did
        finally:
            self._in_poll = False

    def _test_requests(self) -> bool:
        if not self._test_once():
            return False
        if self._pre_early:
            # A payload landed in a pre-posted receive before its header was read. The header left
            # right behind it, so look again now instead of after a round through the caller.
            limit = time.monotonic() + _PRE_HEADER_WAIT
            while self._pre_early and time.monotonic() < limit:
                self._test_once()
        return True

    def _test_once(self) -> bool:
        MPI = self._MPI
        if len(self._statuses) < len(self._reqs):
            self._statuses.extend(MPI.Status() for _ in range(len(self._reqs) - len(self._statuses)))
        try:
            idx = MPI.Request.Testsome(self._reqs, self._statuses)
        except MPI.Exception:
            idx = self._find_failed()
        if not idx:
            return False
        ops = self._ops
        done = []
        for i in idx:
            done.append(ops[i])
            ops[i] = None
            self._free_slots.append(i)
        self._active -= len(idx)
        data_peers: set[int] = set()
        ctrl_peers: set[int] = set()
        for op in done:
            if op is None:
                continue
            cls = type(op)
            if cls is _DataRecv:
                op.done = True
                data_peers.add(op.peer)
            elif cls is _Send:
                self._send_done(op)
            elif cls is _BulkRecv:
                self._heard[op.peer] = time.monotonic()
                self._bulk_done(op)
            elif cls is _PreRecv:
                self._heard[op.peer] = time.monotonic()
                self._pre_done(op)
            elif cls is _CtrlRecv:
                op.done = True
                ctrl_peers.add(op.peer)
            elif cls is _Heartbeat:
                self._beat_busy[op.peer] = False
        if data_peers or ctrl_peers:
            now = time.monotonic()
            for peer in data_peers | ctrl_peers:
                self._heard[peer] = now
        for peer in ctrl_peers:
            q = self._ctrl_recvs[peer]
            while q and q[0].done:
                self._ctrl_received(q.popleft())
        for peer in data_peers:
            q = self._data_recvs[peer]
            while q and q[0].done:
                self._data_received(q.popleft())
        return True

    def _find_failed(self) -> list[int]:
        """Testsome raised (MPI_ERR_IN_STATUS): sort the requests it completed into good ones (returned)
        and failed ones, whose peers are reported lost.

        The error leaves the indices unreported, but every request Testsome completed is now
        REQUEST_NULL and the statuses hold their outcomes in ascending index order."""
        MPI = self._MPI
        null = MPI.REQUEST_NULL
        finished = [i for i, op in enumerate(self._ops) if op is not None and self._reqs[i] == null]
        completed: list[int] = []
        for k, i in enumerate(finished):
            err = self._statuses[k].Get_error() if k < len(self._statuses) else MPI.ERR_OTHER
            if err == MPI.SUCCESS:
                completed.append(i)
                continue
            op = self._ops[i]
            self._ops[i] = None
            self._free_slots.append(i)
            self._active -= 1
            peer = op.peer
            cls = type(op)
            if cls is _Send:
                self._unaccount_send(op, True)
            elif cls is _DataRecv or cls is _CtrlRecv:
                try:
                    (self._data_recvs if cls is _DataRecv else self._ctrl_recvs)[peer].remove(op)
                except ValueError:
                    pass
            elif cls is _BulkRecv:
                self._bulk_pending[peer] -= 1
                self._bulk_active -= 1
            elif cls is _PreRecv:
                if op.incoming is not None:
                    self._bulk_pending[peer] -= 1
                    self._bulk_active -= 1
                elif op in self._pre_q[peer]:
                    self._pre_q[peer].remove(op)
            try:
                what = MPI.Get_error_string(err)
            except MPI.Exception:
                what = f"MPI error {err}"
            self._lose(peer, f"MPI error on a {cls.__name__.strip('_')} request: {what}")
        return completed

    def _send_done(self, op: _Send) -> None:
        self._unaccount_send(op, True)
        peer = op.peer
        if self._sendq[peer] and peer not in self._lost:
            self._drain_sendq(peer)
        group = op.token
        if group is not None:
            if type(group) is _SendGroup:
                group.left -= 1
                if group.left or group.token is None:
                    return
                group = group.token
            self._events.append((self._handler.on_sent, (group,)))  # type: ignore[union-attr]

    def _data_received(self, op: _DataRecv) -> None:
        """A TAG_DATA message (taken in posting order): deliver, or start its rendezvous, or note a BYE."""
        peer = op.peer
        buf = op.buf
        kind, flags, page, edge, size = _HDR.unpack_from(buf, 0)
        if peer in self._lost:
            log.debug("rank %d: message of kind %d from lost rank %d dropped", self.rank, kind, peer)
            return
        if peer in self._bye_from:
            log.error("rank %d: message of kind %d from rank %d after its goodbye; dropped", self.rank, kind, peer)
            return
        if kind == _KIND_EAGER:
            if size > self._eager_limit:
                raise ProtocolError(f"eager message of {size} bytes from rank {peer} exceeds {self._eager_limit}")
            cost = size or 1
            if size <= self._copy_limit:
                data = memoryview(bytes(memoryview(buf)[_HDR.size:_HDR.size + size]))
                self._post_data_recv(peer, buf)
                rel = _Release(self, peer, edge, cost, None, True)
            else:
                data = memoryview(buf)[_HDR.size:_HDR.size + size]
                self._post_data_recv(peer, self._spares.pop() if self._spares else bytearray(self._pool_buf_size))
                rel = _Release(self, peer, edge, cost, buf, True)
            self.stats["msgs_received"] += 1
            self.stats["bytes_received"] += size
            q = self._order.get((peer, edge))
            if q:
                q.append(_Incoming(peer, edge, data, rel, True))
            else:
                self._events.append((self._handler.on_message, (peer, edge, data, rel)))  # type: ignore[union-attr]
        elif kind == _KIND_RNDV:
            if flags & _FLAG_PRE:
                self._pre_claim(peer, buf, flags, page, edge, size)
                return
            lengths = _rndv_lengths(buf, size)
            bulk = lengths[-1] if len(lengths) == 2 - (not flags & _FLAG_INLINE) else 0
            # A payload of one segment makes us offer pre-posted receives (_pre_offer): take a buffer
            # one of them can use next, so it is recycled rather than a fresh one faulted in.
            store = self._bulk_cache_take(max(size, _pre_cap(bulk) + _INLINE_MAX) + _PAGE)
            skip = (page - self._MPI.Get_address(store)) % _PAGE
            target = store[skip:skip + size]
            off = 0
            if flags & _FLAG_INLINE:
                start = _rndv_inline(buf, lengths, peer)
                off = lengths[0]
                target[:off] = memoryview(buf)[start:start + off]
                lengths = lengths[1:]
            self._post_data_recv(peer, buf)
            inc = _Incoming(peer, edge, memoryview(target), _Release(self, peer, edge, size, store, False),
                            False, len(lengths))
            key = (peer, edge)
            q = self._order.get(key)
            if q is None:
                q = self._order[key] = deque()
            q.append(inc)
            BYTE = self._MPI.BYTE
            first = off
            for n in lengths:
                self._post(self._comm.Irecv([target[off:off + n], BYTE], peer, TAG_BULK), _BulkRecv(peer, inc))
                off += n
            self._bulk_pending[peer] += len(lengths)
            if self._slot_grow(peer, size):
                self._pre_page[peer] = (page + first) % _PAGE
            elif bulk:
                self._pre_offer(peer, bulk, (page + first) % _PAGE)
        elif kind == _KIND_SLOT:
            self._slot_filled(peer, buf, flags, edge, size)
        elif kind == _KIND_SLOT_DONE:
            self._post_data_recv(peer, buf)
            self._slot_half_done(peer, edge)
        elif kind == _KIND_SLOT_ANSWER:
            self._post_data_recv(peer, buf)
            answer = _ANSWERS.get(flags)
            if answer is None:
                raise ProtocolError(f"unknown slot answer {flags} from rank {peer}")
            self._slots_in.answered(peer, answer, edge)
            if answer == "retired":
                self.stats["slots_retired"] += 1
        elif kind == _KIND_BYE:
            log.debug("rank %d: goodbye from rank %d", self.rank, peer)
            self._bye_from.add(peer)
            self._pre_drop(peer)
            self._slots_in.drop_peer(peer)
            self._slots_out.drop_peer(peer)
            if peer in self._slot_deferred:
                log.warning("rank %d: rank %d said goodbye; a message for it was still waiting for a "
                            "slot and is dropped", self.rank, peer)
            self._slot_drop_deferred(peer)
            self._credit_out.pop(peer, None)
            self._credit_since.pop(peer, None)
        else:
            raise ProtocolError(f"unknown message kind {kind} from rank {peer}")

    # --- pre-posted payload receives -----------------------------------------------------------------
    #
    # A rendezvous payload is normally received only once its header has been read, so the copy waits
    # for the receiver's Python between "header arrived" and "Irecv posted". For a peer that sends
    # payloads of one segment, the receiver instead keeps a payload receive posted ahead on TAG_PRE
    # (into a recycled buffer placed like the last payload within a page), so MPI can copy the next
    # payload the moment it arrives. The sender must know the receive is big enough: the receiver
    # offers, by a control message, "pre-posted receives number `first` on have room for `cap` bytes"
    # (cap only grows; a sender too big for the next receive uses it up with an empty send, a *skip*,
    # when a big enough one follows within _MAX_SKIPS), and the sender flags the header of each payload
    # it sent that way. MPI's non-overtaking rule matches the n-th TAG_PRE send with the n-th TAG_PRE
    # receive, and the headers say which messages those are. At most one receive per peer is posted
    # ahead (re-posted when its buffer comes back), others are posted when their header arrives, so
    # correctness never depends on timing. Offers are bounded in total by ``memory_limit`` and never
    # withdrawn; a peer's goodbye or loss cancels the receive posted ahead for it.

    def _pre_offer(self, peer: int, n: int, page: int) -> None:
        """A payload of ``n`` bytes in one segment (at ``page`` within a page) came from ``peer``
        without a pre-posted receive: offer receives big enough for it from now on, if memory allows."""
        self._pre_page[peer] = page
        have = self._pre_cap[peer]
        if n <= have or n < self._eager_limit or self._bye_sent or peer in self._bye_from or peer in self._lost:
            return
        cap = _pre_cap(n)
        if self._pre_total + cap - have > self._pre_budget:
            return
        msg = _encode_offer(self._pre_posted[peer], cap)
        try:
            self._submit(msg, TAG_CTRL, _Send(peer, msg), urgent=True)
        except self._MPI.Exception as e:
            self._lose(peer, f"MPI error offering pre-posted receives: {e.Get_error_string()}")
            return
        self._pre_total += cap - have
        self._pre_cap[peer] = cap

    def _post_pre(self, peer: int, cap: int) -> _PreRecv:
        """Post ``peer``'s next pre-posted receive, of ``cap`` bytes."""
        store = self._bulk_cache_take(cap + _INLINE_MAX + _PAGE)
        start = _INLINE_MAX + (self._pre_page[peer] - self._MPI.Get_address(store) - _INLINE_MAX) % _PAGE
        op = _PreRecv(peer, store, start, cap)
        self._post(self._comm.Irecv([store[start:start + cap], self._MPI.BYTE], peer, TAG_PRE), op)
        self._pre_posted[peer] += 1
        return op

    def _pre_claim(self, peer: int, buf: bytearray, flags: int, page: int, edge: int, size: int) -> None:
        """A header whose payload went to ``peer``'s next pre-posted receive (posted now if it was not)."""
        q = self._pre_q[peer]
        if flags & _FLAG_SKIP:
            self._post_data_recv(peer, buf)
            op = q.popleft() if q else self._post_pre(peer, 0)
            op.skip = True
            if op.done:
                self._pre_early -= 1
                self._pre_recycle(op)
            return
        lengths = _rndv_lengths(buf, size)
        off = 0
        if flags & _FLAG_INLINE:
            start = _rndv_inline(buf, lengths, peer)
            off = lengths[0]
            if len(lengths) != 2:
                raise ProtocolError(f"pre-posted rendezvous header from rank {peer} announces {len(lengths)} segments")
        elif len(lengths) != 1:
            raise ProtocolError(f"pre-posted rendezvous header from rank {peer} announces {len(lengths)} segments")
        n = lengths[-1]
        op = q.popleft() if q else self._post_pre(peer, n)
        if op.done:
            self._pre_early -= 1
        if n > op.cap:
            raise ProtocolError(f"rank {peer} sent {n} bytes to a pre-posted receive of {op.cap}")
        store = op.store
        op.store = None
        target = store[op.start - off:op.start + n]
        if off:
            target[:off] = memoryview(buf)[start:start + off]
        self._post_data_recv(peer, buf)
        self._pre_page[peer] = (page + off) % _PAGE
        self.stats["pre_received"] += 1
        self._slot_grow(peer, size)
        inc = _Incoming(peer, edge, memoryview(target), _Release(self, peer, edge, size, store, False), op.done)
        key = (peer, edge)
        order = self._order.get(key)
        if not op.done:
            op.incoming = inc
            inc.left = 1
            self._bulk_pending[peer] += 1
            self._bulk_active += 1
        elif not order:
            self._ready(inc)
            return
        if order is None:
            order = self._order[key] = deque()
        order.append(inc)
        if op.done:
            self._ready(inc)

    def _pre_done(self, op: _PreRecv) -> None:
        op.done = True
        if op.skip:
            self._pre_recycle(op)
            return
        inc = op.incoming
        if inc is None:
            self._pre_early += 1
            return  # its header has not been read yet; it claims the payload
        op.incoming = None
        self._bulk_pending[op.peer] -= 1
        self._bulk_active -= 1
        inc.left = 0
        self._ready(inc)

    def _pre_recycle(self, op: _PreRecv) -> None:
        if op.store is not None:
            self._bulk_cache_put(op.store)
            op.store = None

    def _pre_rearm(self, peer: int) -> None:
        """Post ``peer``'s next receive ahead of its header, if it has an offer and none is posted."""
        if (self._pre_cap[peer] and not self._pre_q[peer] and not self._closed
                and peer not in self._bye_from and peer not in self._lost):
            try:
                self._pre_q[peer].append(self._post_pre(peer, self._pre_cap[peer]))
            except self._MPI.Exception as e:
                self._lose(peer, f"MPI error posting a receive: {e.Get_error_string()}")

    def _pre_drop(self, peer: int) -> None:
        """``peer`` left or was lost: cancel the receives posted ahead for it (they complete as
        cancelled and their buffers are recycled) and give its offer's memory back."""
        self._pre_total -= self._pre_cap[peer]
        self._pre_cap[peer] = 0
        self._pre_offers[peer].clear()
        q = self._pre_q[peer]
        while q:
            op = q.popleft()
            op.skip = True
            if op.done:
                self._pre_early -= 1
                self._pre_recycle(op)
                continue
            for i, o in enumerate(self._ops):
                if o is op:
                    try:
                        self._reqs[i].Cancel()
                    except self._MPI.Exception:
                        pass
                    break

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
        dst = slot.payload
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
            self._submit([rest, self._MPI.BYTE], TAG_BULK, _Send(peer, rest, None, _SendGroup(token, 1), True))
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
        edge = self._slot_deferred.pop(peer)[0]
        self._pending_sends[peer] -= 1
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
        data = memoryview(target)
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

    def _bulk_done(self, op: _BulkRecv) -> None:
        inc = op.incoming
        self._bulk_pending[op.peer] -= 1
        self._bulk_active -= 1
        inc.left -= 1
        if inc.left:
            return
        self._ready(inc)

    def _ready(self, inc: _Incoming) -> None:
        """``inc``'s payload is complete: deliver it and whatever waited for it on its (peer, edge)."""
        inc.ready = True
        self.stats["msgs_received"] += 1
        self.stats["bytes_received"] += inc.data.nbytes
        key = (inc.peer, inc.edge)
        q = self._order.get(key)
        on_message = self._handler.on_message  # type: ignore[union-attr]
        if not q:  # not queued behind an earlier message (a payload read into a pre-posted receive)
            self._events.append((on_message, (inc.peer, inc.edge, inc.data, inc.release)))
            return
        while q and q[0].ready:
            m = q.popleft()
            self._events.append((on_message, (m.peer, m.edge, m.data, m.release)))
        if not q:
            self._order.pop(key, None)

    def _ctrl_received(self, op: _CtrlRecv) -> None:
        peer = op.peer
        buf = op.buf
        kind, body = _decode_ctrl(buf)
        if kind == _KIND_ABORT:
            reason = body
            self._lose(peer, f"rank {peer} aborted: {reason}" if reason else f"rank {peer} aborted")
            return
        if kind == _KIND_OFFER:
            first, cap = body
            offers = self._pre_offers[peer]
            if offers and (first < offers[-1][0] or cap <= offers[-1][1]) or not offers and first != 0:
                raise ProtocolError(f"rank {peer} offered pre-posted receives ({first}, {cap}) after {list(offers)}")
            offers.append((first, cap))
            body = ()
        elif kind in (_KIND_SLOT_OFFER, _KIND_SLOT_GRANT, _KIND_SLOT_RETIRE):
            if peer not in self._bye_from:
                self._slot_control(peer, kind, body)
            body = ()
        on_credit = self._handler.on_credit  # type: ignore[union-attr]
        for edge, nbytes in body:
            key = (peer, edge)
            left = self._inflight.get(key, 0) - nbytes
            if left < 0:
                log.error("rank %d: rank %d returned %d bytes of credit on edge %d, more than in flight",
                          self.rank, peer, nbytes, edge)
                left = 0
            if left:
                self._inflight[key] = left
            else:
                self._inflight.pop(key, None)
            if key in self._blocked:
                self._blocked.discard(key)
                self._events.append((on_credit, (peer, edge)))
        if peer not in self._lost and not self._closed:
            self._post_ctrl_recv(peer, buf)

    def _drain_released(self) -> None:
        released = self._released
        spares = self._spares
        now = None
        slot_news: dict[int, list[tuple[str, Any]]] = {}
        while released:
            rel = released.popleft()
            if rel.slot is not None:
                news = self._slots_in.released(rel.slot)
                rel.slot = None
                if news:
                    slot_news.setdefault(rel.peer, []).extend(news)
            elif rel.buf is not None:
                buf = rel.buf
                rel.buf = None
                # Recycle a buffer only if nothing but this frame refers to it: the consumer may keep
                # zero-copy views (e.g. decoded numpy arrays) after release, and those must stay intact.
                if sys.getrefcount(buf) <= 2:
                    if rel.pool:
                        if len(spares) < self._spare_cap:
                            spares.append(buf)
                    else:
                        self._bulk_cache_put(buf)
                del buf
                if not rel.pool and self._pre_cap[rel.peer]:
                    self._pre_rearm(rel.peer)   # most likely into the buffer just returned
            peer = rel.peer
            if peer in self._bye_from or peer in self._lost:
                continue
            per_edge = self._credit_out.get(peer)
            if per_edge is None:
                per_edge = self._credit_out[peer] = {}
                if now is None:
                    now = time.monotonic()
                self._credit_since[peer] = now
            per_edge[rel.edge] = per_edge.get(rel.edge, 0) + rel.cost
        for peer, news in slot_news.items():
            self._slot_tell(peer, news)

    def _bulk_cache_take(self, size: int) -> Any:
        """A buffer of at least ``size`` bytes for a rendezvous payload: the most recently recycled one
        of the best fit (at most twice as big), else a fresh uninitialised one (no memset; MPI writes
        every byte)."""
        best = -1
        cache = self._bulk_cache
        for i in range(len(cache) - 1, -1, -1):  # newest first: likely still in the CPU cache
            n = cache[i].nbytes
            if size <= n <= 2 * size and (best < 0 or n < cache[best].nbytes):
                best = i
        if best >= 0:
            arr = self._bulk_cache.pop(best)
            self._bulk_cache_bytes -= arr.nbytes
            self.stats["rndv_buffers_reused"] += 1
            return arr
        return np.empty(size, dtype=np.uint8)

    def _bulk_cache_put(self, arr: Any) -> None:
        cache = self._bulk_cache
        cache.append(arr)
        self._bulk_cache_bytes += arr.nbytes
        while self._bulk_cache_bytes > self._bulk_cache_cap or len(cache) > _BULK_CACHE_MAX:
            self._bulk_cache_bytes -= cache.pop(0).nbytes

    def _flush_credit(self, quiet: bool) -> None:
        """Send batched credit returns: all of them when ``quiet``, else only full or old batches."""
        now = time.monotonic()
        batch = self._credit_batch
        for peer in list(self._credit_out):
            per_edge = self._credit_out[peer]
            if not (quiet or now - self._credit_since[peer] >= _CREDIT_MAX_DELAY
                    or max(per_edge.values()) >= batch):
                continue
            del self._credit_out[peer]
            del self._credit_since[peer]
            for msg in _encode_credit(list(per_edge.items())):
                try:
                    self._submit(msg, TAG_CTRL, _Send(peer, msg), urgent=True)
                except self._MPI.Exception as e:
                    self._lose(peer, f"MPI error returning credit: {e.Get_error_string()}")
                    break
                self.stats["credit_msgs_sent"] += 1

    def _dispatch(self) -> None:
        """Run queued handler callbacks; one that raises leaves the rest queued for the next call."""
        events = self._events
        while events:
            fn, args = events.popleft()
            fn(*args)

    # --- peers, checks, teardown -------------------------------------------------------------------

    def _lose(self, peer: int, reason: str) -> None:
        """Mark ``peer`` lost (once) and report it, unless it already left cleanly."""
        if peer in self._lost or peer in self._bye_from:
            return
        self._pending_total -= self._pending_sends[peer]
        self._lost[peer] = reason
        self._pre_drop(peer)
        self._slots_in.drop_peer(peer)
        self._slots_out.drop_peer(peer)
        if self._handler is not None:
            self._slot_drop_deferred(peer)
        log.warning("rank %d: lost rank %d: %s", self.rank, peer, reason)
        q = self._sendq[peer]
        while q:
            self._unaccount_send(q.popleft()[2], False)
        self._credit_out.pop(peer, None)
        self._credit_since.pop(peer, None)
        for key in [k for k in self._split_in if k[0] == peer]:
            del self._split_in[key]
        for key in [k for k in self._order if k[0] == peer]:
            del self._order[key]
        if self._handler is not None:
            self._events.append((self._handler.on_peer_lost, (peer, reason)))

    def _liveness(self, now: float) -> None:
        """Send each live peer its heartbeat when due; report peers silent for ``peer_timeout`` lost.

        A peer that said goodbye is neither checked nor sent to, and once our own goodbye is out we
        send no more heartbeats (a peer may free its communicator right after it has all goodbyes)
        and check nobody (close() bounds that wait itself)."""
        self._next_liveness = now + min(self._hb_interval, _LIVENESS_TICK)
        for peer in range(self.world):
            if peer == self.rank or peer in self._lost or peer in self._bye_from:
                continue
            if self._bye_sent:
                continue
            silent = now - self._heard[peer]
            if silent > self._peer_timeout:
                self._lose(peer, f"no message or heartbeat for {silent:.1f}s (peer_timeout "
                                 f"{self._peer_timeout:g}s): the process is stopped, hung or unreachable")
                if self.config.mpi_abort_on_error:
                    _SILENT_LOST[self._world_rank(peer)] = self._lost.get(peer, "silent")
                continue
            if not self._beat_busy[peer] and now - self._beat_sent[peer] >= self._hb_interval:
                try:
                    req = self._comm.Isend(_HEARTBEAT_MSG, peer, TAG_CTRL)
                except self._MPI.Exception as e:
                    self._lose(peer, f"MPI error sending a heartbeat: {e.Get_error_string()}")
                    continue
                self._post(req, _Heartbeat(peer, _HEARTBEAT_MSG))
                self._beat_busy[peer] = True
                self._beat_sent[peer] = now

    def _world_rank(self, peer: int) -> int:
        """``peer``'s rank in COMM_WORLD (the channel may run on a split communicator)."""
        MPI = self._MPI
        mine, world = self._comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            return int(MPI.Group.Translate_ranks(mine, [peer], world)[0])
        except MPI.Exception:
            return peer
        finally:
            mine.Free()
            world.Free()

    def _live_peers(self) -> list[int]:
        return [p for p in range(self.world) if p != self.rank and p not in self._lost]

    def _waiting_for_peers(self) -> list[int]:
        return [p for p in self._live_peers() if p not in self._bye_from or self._bulk_pending[p]]

    def _check_usable(self) -> None:
        if self._closed:
            raise ClosedError("MPI channel is closed")
        if not self._started:
            raise TwisternetError("MPIChannel.start(handler) must be called first")
        if self._owner_thread is not None:
            self._check_thread()

    def _check_thread(self) -> None:
        if self._owner_thread is not None and threading.get_ident() != self._owner_thread:
            raise TwisternetError(
                f"MPI provides only {_level_name(self._MPI, self.thread_level)}: the MPI channel must be "
                "driven from the thread that initialised MPI")

    def _teardown(self) -> None:
        """Cancel pre-posted receives, drop what is left and free the communicator."""
        MPI = self._MPI
        self._closed = True
        for q in self._sendq:  # never handed to MPI: just drop them
            while q:
                self._unaccount_send(q.popleft()[2], False)
        cancelled = []
        for i, op in enumerate(self._ops):
            if op is None:
                continue
            req = self._reqs[i]
            if isinstance(op, _Send):
                try:
                    req.Free()  # completes in the background (or never, if the peer is gone)
                except MPI.Exception:
                    pass
                # MPI may still read the buffers after Free: they must outlive this channel.
                _ORPHANED_SENDS.append(op.keep)
                continue
            try:
                req.Cancel()
                cancelled.append(req)
            except MPI.Exception:
                pass
        limit = time.monotonic() + 1.0
        while cancelled and time.monotonic() < limit:
            try:
                if MPI.Request.Testall(cancelled):
                    break
            except MPI.Exception:
                break
            time.sleep(1e-4)
        else:
            if cancelled and time.monotonic() >= limit:
                log.warning("rank %d: %d cancelled receives did not complete", self.rank, len(cancelled))
        self._reqs.clear()
        self._ops.clear()
        self._free_slots.clear()
        self._active = 0
        self._data_recvs = [deque() for _ in range(self.world)]
        self._ctrl_recvs = [deque() for _ in range(self.world)]
        self._pre_q = [deque() for _ in range(self.world)]
        self._order.clear()
        self._spares.clear()
        self._slots_in.close()      # views handed out stay valid; the files are unlinked
        self._slots_out.close()
        self._slot_deferred.clear()
        self._split_in.clear()
        self._slot_blocked.clear()
        self._free_comm()
        _OPEN_CHANNELS.discard(self)
        log.debug("MPI channel rank %d closed", self.rank)

    def _free_comm(self) -> None:
        try:
            if self._comm != self._MPI.COMM_NULL:
                self._comm.Free()
        except self._MPI.Exception as e:
            log.warning("rank %d: freeing the channel communicator failed: %s", self.rank, e)


def create_channel(config: "Config", *, comm: Any = None, rank: int | None = None,
                   world: int | None = None, **_launch_info: Any) -> MPIChannel:
    """Build the MPI channel on ``comm`` (default ``MPI.COMM_WORLD``), initialising MPI if needed.

    Collective over ``comm``: every rank must call it (it dups the communicator). ``rank``/``world``,
    if given by the caller (or set in ``config``), must agree with the communicator. Other launch
    information passed by the core's registry is ignored.
    """
    MPI = _import_mpi()
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        # Registered after mpi4py's own exit hook, so it runs first (atexit is last-in first-out).
        import atexit
        atexit.register(_close_leftover_channels)
        atexit.register(_abort_if_peers_froze)
        _ATEXIT_REGISTERED = True
    if config.mpi_abort_on_error:
        _install_abort_hook(MPI)
    if comm is None:
        comm = MPI.COMM_WORLD
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise TypeError(f"comm must be an mpi4py intracommunicator, got {comm!r}")
    for key, given in (("rank", rank), ("world", world)):
        actual = comm.Get_rank() if key == "rank" else comm.Get_size()
        for source, value in (("argument", given), ("config", getattr(config, key))):
            if value is not None and value != actual:
                raise ConfigError(key, f"{source} says {value} but the MPI communicator says {actual}")
    return MPIChannel(config, comm, MPI)
