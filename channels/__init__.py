"""Transports that move framed buffers between ranks: TCP (Unix sockets between same-host peers), MPI,
and an in-process channel for tests. Each registers with the core by name (see twisternet.channel)."""

from .mpi import MPIChannel, mpi_launch_info, under_mpi_launcher

__all__ = ["MPIChannel", "mpi_launch_info", "under_mpi_launcher"]
