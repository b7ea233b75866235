"""The MPI transport: a :class:`~twisternet.channel.Channel` over mpi4py non-blocking point-to-point calls.

All traffic lives on a private ``Dup`` of the user's communicator, on four tags: ``TAG_DATA`` (a 16-byte
header, then the payload of an eager message), ``TAG_BULK`` (rendezvous payloads, zero-copy from the
caller's buffers), ``TAG_PRE`` (payloads into receives posted ahead of their header) and ``TAG_CTRL``
(credit returns, aborts, heartbeats, the shared-memory slot protocol of :mod:`channels.shm_slots`).
Credit follows the interface (:func:`twisternet.channel.fits_credit`); ranks stuck without an MPI error
are found by heartbeats; with ``mpi_abort_on_error`` an uncaught exception ends the job through
``MPI_Abort``. One concept per module: ``wire``, ``launch``, ``records``, ``requests``, ``receive``,
``rendezvous``, ``preposted``, ``slots``, ``credit``, ``buffers``, ``liveness``, composed by
``channel`` (:class:`MPIChannel`).

The wire protocol, receive buffers, flow control, polling, threads, failure handling and liveness are
described in docs/channels.md (section "MPI").
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
