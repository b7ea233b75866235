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
flood of empty messages is flow-controlled too.) Returns ride on the next eager message to that peer
when one goes out first (up to 8 ``(edge, bytes)`` entries after its header, flag ``_FLAG_CREDIT``:
in request/reply traffic no control message per message); otherwise they are batched per peer and
sent once one edge has a quarter of its credit pending, when a poll finds nothing else to do, or
after at most one millisecond.

Threads. The channel asks for ``MPI_THREAD_MULTIPLE`` if it has to initialise MPI itself, and works with
``THREAD_SERIALIZED``: every poll and every ``send`` holds the channel's poll lock, and a waiting
``progress(timeout)`` releases it between polls, so any thread may drive the channel (a caller
waiting for its reply calls ``progress(0)``, which returns False at once while another thread is
inside a poll, and never waits for another thread's timeout). Under ``THREAD_FUNNELED`` or
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

Waiting. MPI has no file descriptor to wait on, so :meth:`MPIChannel.progress` polls ``Testsome`` over the
outstanding sends and payload receives and the *oldest* data and control receive of each peer (the others stay
posted, untested: MPI matches a peer's messages in posting order, so they cannot complete first as far as
delivery goes; each is tested with ``Test`` when it becomes the oldest, so a burst is taken in one poll, and
``Testsome`` over 34 receives per peer cost ~20 us per poll): back to back for ``busy_poll_us`` (auto: 1 ms)
after the last activity; then, while sends or rendezvous payloads are moving (MPI over shared memory advances
them only while somebody polls), back to back with a ``sched_yield`` between polls for up to 50 ms; otherwise
with sleeps of 50 us (idle < 10 ms), 0.5 ms (idle < 1 s) and 2 ms beyond, on an Event that
:meth:`MPIChannel.wakeup` sets. A sender filling one of our shared-memory slots counts as a payload moving
(its header may come any moment). An idle process uses a few percent of a core.

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

Layout (one concept per module): :mod:`.wire` (tags, kinds, structs, encoders and decoders),
:mod:`.launch` (importing and initialising MPI, the abort hook, exit hooks), :mod:`.records` (the
bookkeeping object of each outstanding request), :mod:`.requests` (the request table, ``Testsome``
polling and the send queue), :mod:`.receive` (data and control messages as they arrive; the eager
path), :mod:`.rendezvous`, :mod:`.preposted` (pre-posted payload receives), :mod:`.slots` (the
shared-memory slot protocol), :mod:`.credit` (bytes in flight and batched returns), :mod:`.buffers` (reuse of
rendezvous buffers), :mod:`.liveness` (heartbeats, lost peers, abort and teardown) and
:mod:`.channel` (:class:`MPIChannel`, composing them, and :func:`create_channel`).
"""

from twisternet.launch_env import (  # re-exported: read in one place
    mpi_launch_info,
    under_mpi_launcher,
)

from .channel import MPIChannel, create_channel
from .wire import TAG_BULK, TAG_CTRL, TAG_DATA, TAG_PRE

__all__ = [
    "MPIChannel",
    "create_channel",
    "under_mpi_launcher",
    "mpi_launch_info",
    "TAG_DATA",
    "TAG_BULK",
    "TAG_CTRL",
    "TAG_PRE",
]
