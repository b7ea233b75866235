"""``torch.distributed`` backend "twisternet": a pure-Python ProcessGroup over a twisternet Context.

``import twisternet.torch`` registers it (``Backend.register_backend("twisternet", ..., devices=["cpu"])``),
after which ``torch.distributed.init_process_group(backend="twisternet")`` works wherever ``tn.init()``
does (torchrun, ``twisternet run``, mpiexec; see :func:`twisternet.torch.init_process_group` for the last
two, which do not set torch's env:// variables). Collectives go through the functional layer
(:mod:`twisternet.functional`): its algorithm selection (shared memory on one host, ring, tree, or
in-network with ``via="innet"``), automatic edges (one stream per process group) and non-blocking
handles, which back the ``Work`` objects returned here. Tensors must be on the CPU; they are reduced in
place through numpy views of their memory (no copy in or out).

Supported: allreduce (SUM, AVG, MIN, MAX, PRODUCT) and allreduce_coalesced, broadcast, allgather (and
all_gather_into_tensor), reduce_scatter (and reduce_scatter_tensor), reduce, gather, scatter, alltoall
(and all_to_all_single), barrier, send/recv. Anything else raises :class:`TorchBackendError` naming the
operation; so do tensors on another device or of a dtype numpy lacks (bfloat16), on every rank of the
call (the other ranks raise RemoteError naming the rank whose input was bad).

Layout (one concept per module): ``backend`` (registration, group creation, ``init_process_group``),
``group`` (the ProcessGroup), ``work`` (Work objects), ``tensors`` (op translation, tensor checks and
copies), ``p2p`` (send/recv), ``process_context`` (the Context the backend uses).
"""

from __future__ import annotations

import logging
import os
import zlib
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from twisternet import functional as F
from twisternet.errors import ConfigError

from .group import BACKEND_NAME, ProcessGroupTwisternet
from .process_context import _context
from .tensors import TorchBackendError

log = logging.getLogger(__name__)

#: Environment variable choosing the allreduce algorithm of every group ("auto", "shm", "ring", "doubling", "tree",
#: "innet"); not a TWISTERNET_ variable, which would be read as a configuration key.
VIA_ENV = "TORCH_TWISTERNET_VIA"
_default_via: str | None = None


# ---------------------------------------------------------------------------------- creation
def _via(backend_options: Any) -> str:
    via = None
    if isinstance(backend_options, dict):
        via = backend_options.get("via")
    elif backend_options is not None:
        via = getattr(backend_options, "via", None)
    via = via or _default_via or os.environ.get(VIA_ENV) or "auto"
    from collectives.allreduce import VIAS
    if via not in VIAS:
        raise ConfigError("via", f"the twisternet backend's via must be one of {', '.join(VIAS)}, got {via!r}")
    return via


def _stream_of(global_ranks: list[int], world: int, group_id: str) -> int:
    """The automatic edge stream of a group, the same on every member rank: torch numbers its groups
    "0" (the world), "1", "2", ... in creation order on every rank, and group ``g`` gets stream ``1 + g``
    (no two groups share one); a group named otherwise (hashed names) gets one derived from its name and
    ranks, in the upper half of the streams."""
    from collectives.edges import AUTO_STREAMS
    if group_id.isdigit() and 1 + int(group_id) < AUTO_STREAMS // 2:
        return 1 + int(group_id)
    if group_id in ("default_pg", "") and global_ranks == list(range(world)):
        return 1
    half = AUTO_STREAMS // 2
    return half + zlib.crc32(f"{group_id}|{global_ranks}".encode()) % half


def _create(opts: Any, backend_options: Any) -> ProcessGroupTwisternet:
    """torch's creator hook (``extended_api=True``): a group from torch's store, rank and size."""
    group_rank, group_size = int(opts.group_rank), int(opts.group_size)
    global_ranks = list(opts.global_ranks_in_group) or list(range(group_size))
    ctx = _context(opts.store)
    if ctx.rank != global_ranks[group_rank]:
        raise TorchBackendError(f"twisternet backend: torch says this process is rank {global_ranks[group_rank]} "
                                f"but twisternet joined it as rank {ctx.rank}; start the job so that both "
                                "agree (torchrun, or twisternet.torch.init_process_group)")
    if max(global_ranks) >= ctx.world:
        raise TorchBackendError(f"twisternet backend: the group's ranks {global_ranks} exceed the twisternet job "
                                f"of {ctx.world}")
    timeout = opts.timeout.total_seconds() if isinstance(opts.timeout, timedelta) else None
    pg = ProcessGroupTwisternet(ctx, group_rank, global_ranks, _stream_of(global_ranks, ctx.world,
                                                                          str(opts.group_id)),
                                _via(backend_options), timeout)
    log.debug("twisternet process group %s: rank %d of %d (global ranks %s)", opts.group_id, group_rank,
              group_size, global_ranks)
    return pg


def register() -> None:
    """Register the "twisternet" backend with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu"])


def _outward_address() -> str | None:
    """This host's address on the route to the twisternet master (``TWISTERNET_MASTER``), which the other
    hosts of the job reach it by; None when there is no master address (then the hostname is used).
    A host name need not resolve on the other hosts (containers, the emulated cluster)."""
    import socket
    master = os.environ.get("TWISTERNET_MASTER", "")
    host, _, port = master.rpartition(":")
    if not host:
        return None
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port or 1)))       # UDP: picks the route, sends nothing
            return str(s.getsockname()[0])
    except (OSError, ValueError):
        return None

def init_process_group(backend: str = BACKEND_NAME, *, via: str | None = None, timeout: float | None = None,
                       **kwargs: Any) -> Any:
    """``torch.distributed.init_process_group`` for any launcher ``tn.init()`` knows: under torchrun (or
    with torch's env:// variables set) it is the plain call; under ``twisternet run`` or mpiexec the
    Context comes first and rank 0 hosts torch's TCPStore on a free port it tells the others. Returns
    the Context. ``via`` sets the allreduce algorithm of the twisternet backend."""
    global _default_via
    if via is not None:
        _default_via = _via({"via": via})
    td = timedelta(seconds=timeout) if timeout is not None else None
    if td is not None:
        kwargs.setdefault("timeout", td)
    if all(os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        dist.init_process_group(backend, **kwargs)
        return _context() if backend == BACKEND_NAME else None
    import socket

    ctx = _context()
    port = None
    if ctx.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    here = socket.gethostname()
    host0, addr0, port = F.broadcast((here, _outward_address(), port) if ctx.rank == 0 else None, src=0, ctx=ctx)
    host = "127.0.0.1" if host0 == here else (addr0 or host0)
    store = dist.TCPStore(host, port, ctx.world, ctx.rank == 0, timeout=td or timedelta(seconds=300))
    dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.world, **kwargs)
    return ctx
