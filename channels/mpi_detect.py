"""Tell whether this process was started by an MPI launcher, without importing mpi4py (which would
initialise MPI): the one implementation lives in :mod:`channels.mpi`, importable without mpi4py."""

from __future__ import annotations

from .mpi import mpi_launch_info, under_mpi_launcher

__all__ = ["under_mpi_launcher", "mpi_launch_info"]
