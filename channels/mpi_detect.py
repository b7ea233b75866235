"""Tell whether this process was started by an MPI launcher, without importing mpi4py."""

from __future__ import annotations

import os
from typing import Mapping

_MARKERS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS",
            "HYDI_CONTROL_FD", "MPIEXEC_HOSTNAME", "PMI_FD", "SLURM_MPI_TYPE_PMI")


def under_mpi_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True when environment variables set by mpirun/mpiexec (MPICH hydra, PMI, PMIx, Open MPI) exist."""
    env = os.environ if env is None else env
    return any(k in env for k in _MARKERS)
